//! Typed calls to the LM service; their errors say whether another replica may be tried.
use crate::error::{GatewayError, OverloadReason};
use crate::validation::{ValidRequest, VisionRef};
use vlm_proto::v1 as pb;

/// Which part of the stack a failure is blamed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Lm,
    /// The vision replica the LM was sent to (the LM says so with `vlm-failed-part: vision`).
    Vision,
}

/// Status metadata an upstream sets when the part that failed is not itself.
pub const FAILED_PART: &str = "vlm-failed-part";

/// How an upstream call failed. Messages name addresses: they are for logs, not clients
/// (the conversion to [`GatewayError`] leaves them out).
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    /// A queue upstream (the vision replica's wait line, or its queue-wait limit) is full:
    /// RESOURCE_EXHAUSTED. Not retried here: the request already waited its turn there.
    #[error("{addr} busy: {message}")]
    Busy {
        addr: String,
        message: String,
        part: Part,
    },
    /// Connection refused, reset, timed out, or the replica said UNAVAILABLE: try another.
    #[error("{addr} unreachable: {message}")]
    Unreachable {
        addr: String,
        message: String,
        code: tonic::Code,
        part: Part,
        /// The call failed below gRPC (the status carries the transport's error, not one the
        /// replica sent): the connection died, which may say nothing of the replica.
        transport: bool,
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
        let part = match s.metadata().get(FAILED_PART).map(|v| v.as_bytes()) {
            Some(b"vision") => Part::Vision,
            _ => Part::Lm,
        };
        match s.code() {
            ResourceExhausted => ClientError::Busy {
                addr: addr.to_string(),
                message: s.message().to_string(),
                part,
            },
            Unavailable | Unknown | Internal | Aborted | DeadlineExceeded | Cancelled => {
                ClientError::Unreachable {
                    addr: addr.to_string(),
                    message: format!("{:?}: {}", s.code(), s.message()),
                    code: s.code(),
                    part,
                    // tonic sets a source only on statuses it made from a transport error.
                    transport: std::error::Error::source(&s).is_some(),
                }
            }
            code => ClientError::Refused {
                addr: addr.to_string(),
                status: s.message().to_string(),
                code,
            },
        }
    }

    /// The part to blame: a vision failure never takes the LM replica out of rotation.
    pub fn part(&self) -> Part {
        match self {
            ClientError::Unreachable { part, .. } | ClientError::Busy { part, .. } => *part,
            ClientError::Refused { .. } => Part::Lm,
        }
    }

    /// The LM call failed on its connection (not with a status from the LM): worth one more
    /// try on the same replica over a new connection.
    pub fn connection_failed(&self) -> bool {
        matches!(
            self,
            ClientError::Unreachable {
                transport: true,
                part: Part::Lm,
                ..
            }
        )
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
        // No addresses: those are logged where the failure is seen.
        match e {
            // The upstream's own words name the queue and its limit; only addresses go.
            ClientError::Busy { message, part, .. } => GatewayError::Overloaded {
                reason: match part {
                    Part::Vision => OverloadReason::VisionBusy,
                    Part::Lm => OverloadReason::LmBusy,
                },
                message: crate::error::scrub_addresses(&message),
            },
            ClientError::Unreachable {
                part: Part::Vision,
                code,
                ..
            } => GatewayError::Unavailable(format!(
                "the vision service failed ({code:?}) encoding this request's images; requests \
                 without images are still served"
            )),
            ClientError::Unreachable { code, .. } => {
                GatewayError::Unavailable(format!("the LM service is unavailable ({code:?})"))
            }
            ClientError::Refused {
                code: tonic::Code::InvalidArgument | tonic::Code::OutOfRange,
                status,
                ..
            } => GatewayError::UpstreamInvalid(crate::error::scrub_addresses(&status)),
            ClientError::Refused { code, .. } => {
                GatewayError::Internal(format!("the LM service refused the request ({code:?})"))
            }
        }
    }
}

/// The `Lm.Generate` request for a validated request; `videos[k]` are video k's temporal
/// groups, decoded and resized ([`crate::video::decode_groups`]).
pub fn lm_request(
    request_id: &str,
    req: &ValidRequest,
    videos: &[Vec<crate::video::Group>],
    vision_replica: String,
) -> pb::LmGenerateRequest {
    let image = |i: &crate::validation::ValidImage| {
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
            video: false,
        }
    };
    let mut images = Vec::with_capacity(req.order.len());
    for r in &req.order {
        match *r {
            VisionRef::Image(k) => images.push(image(&req.images[k])),
            VisionRef::Video(k) => {
                let v = &req.videos[k];
                let g = v.geometry.group_grid();
                let grid = pb::ImageGrid {
                    t: g[0],
                    h: g[1],
                    w: g[2],
                };
                for (gi, (a, b)) in videos[k].iter().enumerate() {
                    let hash = v.group_hash(gi);
                    images.push(pb::LmImage {
                        content_hash: hash.clone(),
                        grid: Some(grid),
                        input: Some(pb::ImageInput {
                            source: Some(pb::image_input::Source::Pixels(pb::ResizedPixels {
                                width: a.width(),
                                height: a.height(),
                                rgb8: a.as_raw().clone(),
                                second_frame: b.as_raw().clone(),
                            })),
                            content_hash: hash,
                            expected_grid: Some(grid),
                            min_pixels: 0,
                            max_pixels: 0,
                        }),
                        video: true,
                    });
                }
            }
        }
    }
    pb::LmGenerateRequest {
        request_id: request_id.to_string(),
        input_ids: req.input_ids.clone(),
        images,
        vision_replica,
        sampling: Some(pb::SamplingParams {
            // Stop strings are the gateway's job.
            stop: Vec::new(),
            ..req.sampling.to_wire()
        }),
    }
}
