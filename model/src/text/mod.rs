//! The Qwen3 decoder, multimodal RoPE, and the paged KV cache.
//!
//! The struct tree mirrors the checkpoint (`model.language_model.*`, `lm_head`):
//! [`TextModel`] → [`Embedding`] (`embed_tokens`), [`DecoderLayer`] (`layers.{i}`) →
//! [`Attention`] (`self_attn`: `{q,k,v,o}_proj`, `q_norm`, `k_norm`) and [`Mlp`]
//! (`mlp.{gate,up,down}_proj`), [`RmsNorm`] (`input_layernorm`, `post_attention_layernorm`,
//! `norm`), [`Linear`] (`lm_head`, or `embed_tokens` when tied).
//!
//! The model owns weights only. A step is a [`BatchInput`] (a prefill chunk of one sequence, or
//! a padded decode batch) run against a caller-owned [`PagedKvCache`]; it returns the logits of
//! the last position of each row. [`PromptLayout`] turns a tokenized multimodal prompt into 3-D
//! positions ([`get_rope_index`]) and prefill chunks.
mod attention;
mod batch;
mod chunk_attention;
mod decode_attention;
mod gemv;
mod kv_cache;
mod layer;
mod linear;
mod mlp;
mod model;
mod norm;
mod rope;
mod tiled;

pub use attention::Attention;
pub use batch::{BatchInput, DecodeBatch, DecodeRow, ImageRows, PrefillChunk, PromptLayout};
pub use kv_cache::PagedKvCache;
pub use layer::DecoderLayer;
pub use linear::{Linear, SMALL_ROWS};
pub use mlp::Mlp;
pub use model::{kv_dtype_for, Embedding, TextModel};
pub use norm::RmsNorm;
pub use rope::{decode_position, get_rope_index, MRope, Position3};
