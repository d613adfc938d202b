//! The compute seam: what the services need from a compute backend, and the host-side data that
//! crosses it. No tensor library here.
//!
//! * LM: [`LmBackend`] — one step of prefill chunks (of one or several sequences) and a decode
//!   batch bucket over the paged KV cache, logits out to the host for sampling, report its
//!   memory.
//! * ViT: [`VisionBackend`] — encode one image in one bucket, report the bytes each bucket holds.
//! * Data: [`HostTensor`] (little-endian bytes + dtype + shape), [`ImageEmbeds`], the ViT's
//!   input [`PixelValues`] (made by `vlm-preprocess`, which the seam does not depend on), the
//!   step inputs ([`PrefillChunk`], [`DecodeRow`]) built from a [`PromptLayout`].
//! * The checkpoint's `config.json` ([`Qwen3VlConfig`]), which backends and services share.
//!
//! A backend is a crate under `backends/` that implements these traits and reports its own sizes
//! to the planner (`vlm_config::plan::Sizing`); `backends/` (crate `vlm-backends`) picks one.
pub mod embeds;
pub mod embeds_cache;
pub mod error;
pub mod info;
pub mod layout;
pub mod lm;
pub mod memory;
pub mod model_config;
pub mod pixels;
pub mod rope_index;
pub mod tensor;
pub mod vision;

pub use embeds::ImageEmbeds;
pub use embeds_cache::EmbedsCache;
pub use error::{ComputeError, Result};
pub use info::BackendInfo;
pub use layout::{build_chunk, PromptLayout};
pub use lm::{check_table, step_apart, DecodeRow, ImageRows, LmBackend, PrefillChunk, StepLogits};
pub use memory::{BucketMemory, LmMemory, VisionMemory};
pub use model_config::{Qwen3VlConfig, TextConfig, VisionConfig};
pub use pixels::PixelValues;
pub use rope_index::{decode_position, get_rope_index, get_rope_index_runs, Position3};
pub use tensor::{HostDtype, HostTensor};
pub use vision::{VisionBackend, VisionRun};

/// Index of the largest logit; the first one on ties (as `torch.argmax`): greedy sampling.
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}
