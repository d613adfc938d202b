//! The Qwen3-VL ViT: the checkpoint's tree and its one forward (in the backend's kernels).
//!
//! One struct per checkpoint module under `model.visual` (`patch_embed.proj`, `pos_embed`,
//! `blocks.{i}.{norm1, norm2, attn.qkv, attn.proj, mlp.linear_fc1, mlp.linear_fc2}`,
//! `merger.*`, `deepstack_merger_list.{k}.*`). Token order everywhere is merge-block order, as
//! the processor emits the patches. [`buckets`] has the rules of a bucketed (padded) run.
mod attention;
mod block;
pub mod buckets;
mod linear;
mod merger;
mod model;
mod patch_embed;
mod pos_embed;
mod rope;

pub use attention::{query_block_rows, spans_for, Span, SCORE_BLOCK_ELEMS};
pub use block::{AttnContext, VisionAttention, VisionBlock, VisionMlp};
pub use linear::{LayerNorm, Linear, LN_EPS};
pub use merger::PatchMerger;
pub use model::{VisionModel, VisionOutput, VisionTrace, VISION_PREFIX};
pub use patch_embed::PatchEmbed;
pub use pos_embed::{axis_taps, merge_block_coords, PosEmbed};
pub use rope::{VisionRope, VISION_ROPE_THETA};
