//! Errors of the vision service: [`VisionError`] for one call (mapped to a gRPC status in exactly
//! one place, `From<VisionError> for Status`) and [`ServeError`] for start-up and serving.
use std::net::SocketAddr;
use std::path::PathBuf;

/// Why one Encode (or one image of it) failed. No tonic in the variants; the status code is
/// chosen only in the `From` impl below.
#[derive(Debug, Clone, thiserror::Error)]
pub enum VisionError {
    /// The line of images waiting for a queue slot has no room for the request's images.
    #[error(
        "vision queue is full: {requested} image(s) requested, {waiting} already waiting for one \
         of {capacity} slots (at most {max_waiting} images wait, --max-waiting-images); retry \
         later or on another replica"
    )]
    Overloaded {
        requested: usize,
        waiting: usize,
        max_waiting: usize,
        capacity: usize,
    },
    /// The request's images waited longer than the service allows for a queue slot.
    #[error(
        "vision queue is full: the request's images waited {waited_ms} ms for a slot, the \
         limit is {limit_ms} ms (--max-queue-wait-ms); retry later or on another replica"
    )]
    QueueTimeout { waited_ms: u64, limit_ms: u64 },
    /// The caller's input is invalid; the message names the limit and the value received.
    #[error("{}", match .image { Some(i) => format!("image {i}: {}", .message), None => .message.clone() })]
    Validation {
        image: Option<usize>,
        message: String,
    },
    /// The caller went away (dropped the stream) before the work was done.
    #[error("request cancelled by the caller")]
    Cancelled,
    /// The caller's deadline (`grpc-timeout`) passed before the work was done.
    #[error("deadline of {timeout_ms} ms passed before the images were encoded")]
    DeadlineExceeded { timeout_ms: u64 },
    /// The service is loading its weights or draining.
    #[error("vision service is not ready: {0}")]
    NotReady(String),
    /// The model failed on an input it accepted (a bug or an environment problem).
    #[error("image {image}: model error: {message}")]
    Model { image: usize, message: String },
    /// Anything else that is our fault.
    #[error("internal error: {0}")]
    Internal(String),
}

impl VisionError {
    pub fn invalid(image: usize, message: impl Into<String>) -> Self {
        VisionError::Validation {
            image: Some(image),
            message: message.into(),
        }
    }
    pub fn invalid_request(message: impl Into<String>) -> Self {
        VisionError::Validation {
            image: None,
            message: message.into(),
        }
    }

    /// The `status` label of `vlm_vision_requests_total`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            VisionError::Overloaded { .. } | VisionError::QueueTimeout { .. } => "overloaded",
            VisionError::Validation { .. } => "invalid",
            VisionError::Cancelled => "cancelled",
            VisionError::DeadlineExceeded { .. } => "deadline",
            VisionError::NotReady(_) => "unavailable",
            VisionError::Model { .. } | VisionError::Internal(_) => "internal",
        }
    }
}

impl From<VisionError> for tonic::Status {
    fn from(e: VisionError) -> Self {
        let msg = e.to_string();
        match e {
            VisionError::Overloaded { .. } | VisionError::QueueTimeout { .. } => {
                tonic::Status::resource_exhausted(msg)
            }
            VisionError::Validation { .. } => tonic::Status::invalid_argument(msg),
            VisionError::Cancelled => tonic::Status::cancelled(msg),
            VisionError::DeadlineExceeded { .. } => tonic::Status::deadline_exceeded(msg),
            VisionError::NotReady(_) => tonic::Status::unavailable(msg),
            VisionError::Model { .. } | VisionError::Internal(_) => tonic::Status::internal(msg),
        }
    }
}

/// Why the service could not start or stopped with an error. Each variant names the stage.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("config: {0}")]
    Config(String),
    #[error("device pool: {0}")]
    Device(#[from] vlm_service_kit::affinity::NoSuchCore),
    /// Loading the weights or preparing the buckets on the compute backend.
    #[error("loading the vision model from {dir}: {source}")]
    Load {
        dir: PathBuf,
        #[source]
        source: vlm_compute::ComputeError,
    },
    #[error("cannot bind {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("reflection: {0}")]
    Reflection(String),
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("compute thread: {0}")]
    Thread(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn one_mapping_to_status() {
        let cases = [
            (
                VisionError::Overloaded {
                    requested: 1,
                    waiting: 4,
                    max_waiting: 4,
                    capacity: 2,
                },
                Code::ResourceExhausted,
            ),
            (
                VisionError::QueueTimeout {
                    waited_ms: 10,
                    limit_ms: 10,
                },
                Code::ResourceExhausted,
            ),
            (VisionError::invalid(2, "bad"), Code::InvalidArgument),
            (VisionError::Cancelled, Code::Cancelled),
            (
                VisionError::DeadlineExceeded { timeout_ms: 5 },
                Code::DeadlineExceeded,
            ),
            (VisionError::NotReady("loading".into()), Code::Unavailable),
            (
                VisionError::Model {
                    image: 0,
                    message: "x".into(),
                },
                Code::Internal,
            ),
            (VisionError::Internal("x".into()), Code::Internal),
        ];
        for (e, code) in cases {
            assert_eq!(tonic::Status::from(e).code(), code);
        }
    }

    #[test]
    fn messages_name_the_limit_and_the_value() {
        let s = VisionError::Overloaded {
            requested: 2,
            waiting: 1024,
            max_waiting: 1024,
            capacity: 16,
        }
        .to_string();
        assert!(s.contains("at most 1024 images wait"), "{s}");
        let s = VisionError::invalid(3, "image is 9x9, over 4").to_string();
        assert!(s.starts_with("image 3: "), "{s}");
    }
}
