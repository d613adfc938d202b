//! Qwen3-VL numerics on candle: checkpoint loading, image preprocessing, the ViT run at fixed
//! bucket shapes, and the Qwen3 decoder over a paged KV cache. No networking here.
//!
//! The vision part and the LM part load independently ([`vision::VisionModel::load`],
//! [`text::TextModel::load`]), so a vision replica never maps LM weights and vice versa.

pub mod config;
pub mod cpu;
pub mod device;
pub mod embeds;
pub mod error;
pub mod make;
pub mod pipeline;
pub mod preprocess;
pub mod text;
pub mod tokenizer;
pub mod vision;
pub mod weights;

pub use config::{Qwen3VlConfig, TextConfig, VisionConfig};
pub use error::{ModelError, Result};
