//! The Qwen3 decoder, multimodal RoPE, and the paged KV cache.
//!
//! The struct tree mirrors the checkpoint (`model.language_model.*`, `lm_head`):
//! [`TextModel`] → `embed_tokens`, [`DecoderLayer`] (`layers.{i}`) → [`Attention`]
//! (`self_attn`: `{q,k,v,o}_proj`, `q_norm`, `k_norm`) and [`Mlp`] (`mlp.{gate,up,down}_proj`),
//! [`RmsNorm`] (`input_layernorm`, `post_attention_layernorm`, `norm`), [`Linear`] (`lm_head`,
//! or `embed_tokens` when tied). Every type is generic over the backend's [`crate::Kernels`].
//!
//! The model owns weights only. A step is a [`BatchInput`] (a prefill chunk of one sequence, or
//! a padded decode batch) run against a caller-owned [`PagedKvCache`]; it returns the logits of
//! the last position of each row.
mod attention;
mod batch;
mod kv_cache;
mod layer;
mod linear;
mod mlp;
mod model;
mod norm;
pub mod paged_attention;
mod rope;
mod step;

pub use attention::Attention;
pub use batch::{BatchInput, DecodeBatch};
pub use kv_cache::{CacheGeometry, PagedKvCache};
pub use layer::DecoderLayer;
pub use linear::Linear;
pub use mlp::Mlp;
pub use model::TextModel;
pub use norm::RmsNorm;
pub use rope::{rope_rows, MRope};
pub use step::{causal_mask, AttnCall, AttnRows};
