//! The Qwen3-VL ViT and its fixed-shape bucket graphs.
//!
//! One struct per checkpoint module under `model.visual` (`patch_embed.proj`, `pos_embed`,
//! `blocks.{i}.{norm1, norm2, attn.qkv, attn.proj, mlp.linear_fc1, mlp.linear_fc2}`,
//! `merger.*`, `deepstack_merger_list.{k}.*`). Token order everywhere is merge-block order, as
//! the processor emits the patches.
mod attention;
mod block;
mod engine;
mod graphs;
mod kernels;
mod linear;
mod merger;
mod model;
mod patch_embed;
mod pos_embed;
mod rope;

pub use attention::{spans_for, Span};
pub use block::{AttnContext, VisionAttention, VisionBlock, VisionMlp};
pub use graphs::{estimate_memory_bytes, BucketRun, GraphBackend, VisionGraphs};
pub use linear::{LayerNorm, Linear};
pub use merger::PatchMerger;
pub use model::{VisionModel, VisionTrace, VISION_PREFIX};
pub use patch_embed::PatchEmbed;
pub use pos_embed::{axis_taps, merge_block_coords, PosEmbed};
pub use rope::{VisionRope, VISION_ROPE_THETA};
