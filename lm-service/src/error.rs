//! The LM service's error type and its single mapping to a gRPC status.
use tonic::{Code, Status};

/// Everything a request or the service can fail with. Messages name the limit and the value,
/// or the endpoint.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LmError {
    /// The request is invalid (prompt over max_seq_len, over the pool, ids out of vocab,
    /// embeddings that do not match the grid, ...).
    #[error("{0}")]
    Validation(String),
    /// A dependency (the vision endpoint) cannot be reached, or the service is not ready /
    /// draining.
    #[error("{0}")]
    Unavailable(String),
    /// The vision replica the request named failed or cannot be reached: the LM itself is
    /// fine (the status carries `vlm-failed-part: vision`, so the caller blames vision).
    #[error("{0}")]
    VisionUnavailable(String),
    /// The vision replica's queue is full (RESOURCE_EXHAUSTED there); the status carries
    /// `vlm-failed-part: vision`, as for [`LmError::VisionUnavailable`].
    #[error("{0}")]
    Overloaded(String),
    /// The request was cancelled (deadline passed).
    #[error("{0}")]
    Cancelled(String),
    /// A bug or a failed tensor operation.
    #[error("{0}")]
    Internal(String),
}

impl LmError {
    pub fn validation(msg: impl Into<String>) -> Self {
        LmError::Validation(msg.into())
    }
    pub fn internal(msg: impl Into<String>) -> Self {
        LmError::Internal(msg.into())
    }
    /// A label for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            LmError::Validation(_) => "validation",
            LmError::Unavailable(_) => "unavailable",
            LmError::VisionUnavailable(_) => "vision_unavailable",
            LmError::Overloaded(_) => "overloaded",
            LmError::Cancelled(_) => "cancelled",
            LmError::Internal(_) => "internal",
        }
    }
}

impl From<vlm_compute::ComputeError> for LmError {
    fn from(e: vlm_compute::ComputeError) -> Self {
        match e {
            vlm_compute::ComputeError::InvalidInput(m) => LmError::Validation(m),
            other => LmError::Internal(other.to_string()),
        }
    }
}

/// Status metadata naming the part that failed when it is not the LM itself.
pub const FAILED_PART: &str = "vlm-failed-part";

impl From<LmError> for Status {
    fn from(e: LmError) -> Status {
        let code = match &e {
            LmError::Validation(_) => Code::InvalidArgument,
            LmError::Unavailable(_) | LmError::VisionUnavailable(_) => Code::Unavailable,
            LmError::Overloaded(_) => Code::ResourceExhausted,
            LmError::Cancelled(_) => Code::Cancelled,
            LmError::Internal(_) => Code::Internal,
        };
        let mut status = Status::new(code, e.to_string());
        if matches!(e, LmError::VisionUnavailable(_) | LmError::Overloaded(_)) {
            status.metadata_mut().insert(
                FAILED_PART,
                tonic::metadata::MetadataValue::from_static("vision"),
            );
        }
        status
    }
}

/// Why the service could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("config: {0}")]
    Config(String),
    #[error("model: {0}")]
    Model(String),
    #[error("bind {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("grpc server: {0}")]
    Transport(String),
}
