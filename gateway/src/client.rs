//! Typed calls to the LM service; their errors say whether another replica may be tried.
use crate::error::GatewayError;
use crate::validation::ValidRequest;
use vlm_proto::v1 as pb;

/// How an upstream call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    /// Connection refused, reset, timed out, or the replica said UNAVAILABLE / busy: try
    /// another.
    #[error("{addr} unreachable: {message}")]
    Unreachable {
        addr: String,
        message: String,
        code: tonic::Code,
    },
    /// The replica refused the request itself (INVALID_ARGUMENT, ...): do not retry.
    #[error("{addr}: {status}")]
    Refused {
        addr: String,
        status: String,
        code: tonic::Code,
    },
}

impl ClientError {
    pub fn from_status(addr: &str, s: tonic::Status) -> Self {
        use tonic::Code::*;
        match s.code() {
            Unavailable | Unknown | Internal | Aborted | DeadlineExceeded | ResourceExhausted
            | Cancelled => ClientError::Unreachable {
                addr: addr.to_string(),
                message: format!("{:?}: {}", s.code(), s.message()),
                code: s.code(),
            },
            code => ClientError::Refused {
                addr: addr.to_string(),
                status: s.message().to_string(),
                code,
            },
        }
    }

    pub fn retryable(&self) -> bool {
        matches!(self, ClientError::Unreachable { .. })
    }

    /// The replica itself looks down (not merely busy): take it out of rotation until a poll
    /// finds it healthy again.
    pub fn replica_down(&self) -> bool {
        use tonic::Code::*;
        matches!(
            self,
            ClientError::Unreachable {
                code: Unavailable | Unknown | Internal | DeadlineExceeded,
                ..
            }
        )
    }
}

impl From<ClientError> for GatewayError {
    fn from(e: ClientError) -> Self {
        match e {
            ClientError::Unreachable { .. } => GatewayError::Unavailable(e.to_string()),
            ClientError::Refused {
                code: tonic::Code::InvalidArgument | tonic::Code::OutOfRange,
                status,
                ..
            } => GatewayError::UpstreamInvalid(status),
            ClientError::Refused { .. } => GatewayError::Internal(e.to_string()),
        }
    }
}

/// The `Lm.Generate` request for a validated request.
pub fn lm_request(
    request_id: &str,
    req: &ValidRequest,
    vision_endpoint: String,
) -> pb::LmGenerateRequest {
    pb::LmGenerateRequest {
        request_id: request_id.to_string(),
        input_ids: req.input_ids.clone(),
        images: req
            .images
            .iter()
            .map(|i| {
                let grid = pb::ImageGrid {
                    t: i.grid[0],
                    h: i.grid[1],
                    w: i.grid[2],
                };
                pb::LmImage {
                    content_hash: i.content_hash.to_vec(),
                    grid: Some(grid),
                    input: Some(pb::ImageInput {
                        source: Some(pb::image_input::Source::Encoded(pb::EncodedImage {
                            data: i.data.to_vec(),
                            mime_type: i.mime_type.clone(),
                        })),
                        content_hash: i.content_hash.to_vec(),
                        expected_grid: Some(grid),
                        min_pixels: i.budget.min_pixels.unwrap_or(0),
                        max_pixels: i.budget.max_pixels.unwrap_or(0),
                    }),
                }
            })
            .collect(),
        vision_endpoint,
        sampling: Some(pb::SamplingParams {
            // Stop strings are the gateway's job.
            stop: Vec::new(),
            ..req.sampling.to_wire()
        }),
    }
}
