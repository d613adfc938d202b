//! Qwen3-VL numerics on candle, written once: the checkpoint's weights tree and the forward of
//! each tower, over the [`Kernels`] a backend plugs in (`backends/cpu`, `backends/candle`).
//!
//! The vision part and the LM part load independently ([`vision::VisionModel::load`],
//! [`text::TextModel::load`]), so a vision replica never maps LM weights and vice versa.
//! [`oracle::Oracle`] is the in-process test oracle. Services do not use this crate: they talk
//! to the seam (`vlm-compute`), which [`lm_backend::TextBackend`] implements for any kernels.
pub mod dtype;
pub mod error;
pub mod fp8;
pub mod gguf;
pub mod kernels;
pub mod lm_backend;
pub mod oracle;
pub mod quant_config;
pub(crate) mod quant_writer;
pub mod resident;
pub mod sizing;
pub mod text;
pub mod vision;
pub mod w4a16;
pub mod w8a8;
pub mod weights;

pub use error::{ModelError, Result};
pub use kernels::Kernels;

/// The dtype of this crate's tensors and weights (candle's), for callers that name one.
pub use candle_core::DType;
