//! What a compute backend holds, from the model's dimensions alone: the planner's input.
//!
//! Each backend implements [`Sizing`] next to the code that allocates, with the same functions
//! (`backends/cpu/src/sizing.rs`, `backends/candle/src/sizing.rs`), so the plan is what the
//! services hold; `vlm_backends` picks the implementation for a config the way the services
//! pick their backend. [`RblnSizing`] models the runtime of the seeds' NPUs (compiled graphs
//! per bucket, everything in 16 bits, tensor parallel over a part's devices), for planning
//! those kinds.
use super::device::BufferPolicy;
use super::dims::ModelDims;
use super::inputs::{Part, PlanOptions};
use crate::types::{DeployConfig, Dtype, KvDtype, VisualConfig};
use serde::Serialize;

/// The dtypes of one part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Dtypes {
    pub weights: Dtype,
    pub activations: Dtype,
    /// The KV cache's (LM) when the config leaves `kv_cache_dtype` at `auto`.
    pub kv: KvDtype,
}

/// Bytes of one ViT bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BucketBytes {
    /// Peak bytes of one run at the bucket (held buffers included).
    pub bytes: u64,
    /// Of `bytes`, what is allocated at load and held for the service's life.
    pub held: u64,
}

/// What a part's pool of N devices does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolUse {
    /// Every byte divided over the devices (tensor parallel).
    Split,
    /// Each device holds its own copy of the weights and its own buffers (one instance per
    /// device).
    Replicas,
    /// The devices are cores sharing one memory: the weights once; the ViT's bucket buffers
    /// once per core (one instance per core); the LM's once (one engine over the cores).
    Host,
}

pub trait Sizing: Send + Sync {
    /// The backend's name for `part`, shown in the plan.
    fn backend(&self, part: Part) -> &'static str;
    /// The dtypes a part whose config says `dtype` runs with.
    fn dtypes(&self, part: Part, dtype: Dtype) -> Dtypes;
    /// Bytes of `part`'s weights stored as `weights`.
    fn weight_bytes(&self, dims: &ModelDims, part: Part, weights: Dtype) -> u64;
    /// KV blocks allocated beyond the usable ones (a dummy block for padded decode rows).
    fn kv_extra_blocks(&self) -> u32;
    /// One ViT bucket of `rows` raw patches.
    fn vit_bucket(&self, dims: &ModelDims, visual: &VisualConfig, rows: u64) -> BucketBytes;
    /// How the ViT's bucket buffers occupy memory.
    fn vit_buffers(&self, visual: &VisualConfig) -> BufferPolicy;
    /// Activation bytes of one LM step of `rows` rows, `logit_rows` of them producing logits.
    fn lm_step(&self, dims: &ModelDims, cfg: &DeployConfig, rows: u64, logit_rows: u64) -> u64;
    /// How the LM's step buffers occupy memory.
    fn lm_buffers(&self) -> BufferPolicy;
    /// What a pool of `n` devices does for `part`; an error when the backend cannot run that
    /// pool (the message says why and what to do).
    fn pool(&self, part: Part, n: u32) -> Result<PoolUse, String>;
    /// The service process's own footprint outside the itemised figures (host backends).
    fn process_baseline(&self) -> u64;
}

/// The seeds' NPU runtime (RBLN ATOM / REBEL) as the planner models it: weights, KV cache and
/// activations in one 16-bit dtype (or `--dtype`), every compiled graph keeping its buffers,
/// attention one KV partition at a time, both parts split over their devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RblnSizing {
    pub dtype: Dtype,
}

impl RblnSizing {
    /// The runtime of an RBLN `kind`, in its native dtype or `--dtype`'s.
    pub fn for_kind(kind: &super::device::DeviceKind, opts: &PlanOptions) -> Self {
        RblnSizing {
            dtype: opts.dtype.or(kind.native_dtype).unwrap_or(Dtype::Bf16),
        }
    }
}

impl Sizing for RblnSizing {
    fn backend(&self, _: Part) -> &'static str {
        "rbln"
    }
    fn dtypes(&self, _: Part, _: Dtype) -> Dtypes {
        Dtypes {
            weights: self.dtype,
            activations: self.dtype,
            kv: self.dtype.into(),
        }
    }
    fn weight_bytes(&self, dims: &ModelDims, part: Part, weights: Dtype) -> u64 {
        let p = dims.params();
        let all = match part {
            Part::Visual => p.visual,
            Part::Lm => p.text,
        };
        all * weights.bytes()
    }
    fn kv_extra_blocks(&self) -> u32 {
        0
    }
    fn vit_bucket(&self, dims: &ModelDims, _: &VisualConfig, rows: u64) -> BucketBytes {
        BucketBytes {
            bytes: graph_vit_elems(dims, rows) * self.dtype.bytes(),
            held: 0,
        }
    }
    fn vit_buffers(&self, _: &VisualConfig) -> BufferPolicy {
        BufferPolicy::PerGraph
    }
    fn lm_step(&self, dims: &ModelDims, cfg: &DeployConfig, rows: u64, logit_rows: u64) -> u64 {
        graph_lm_elems(dims, rows, logit_rows, cfg.kvcache_partition_len as u64)
            * self.dtype.bytes()
    }
    fn lm_buffers(&self) -> BufferPolicy {
        BufferPolicy::PerGraph
    }
    fn pool(&self, _: Part, _: u32) -> Result<PoolUse, String> {
        Ok(PoolUse::Split)
    }
    fn process_baseline(&self) -> u64 {
        0
    }
}

/// Activation elements of one compiled ViT graph at `b` raw patches: per row the residual
/// stream, norm output, qkv, q/k/v per head, attention output, MLP hidden, the pixel row, the
/// position row and the rotary row; one block of attention scores and probabilities (query
/// blocks of 16 Mi score elements, 16..1024 rows); the merger and deepstack buffers.
pub fn graph_vit_elems(dims: &ModelDims, b: u64) -> u64 {
    let (d, i, h) = (
        dims.vision_hidden,
        dims.vision_intermediate,
        dims.vision_heads,
    );
    let head_dim = d / h.max(1);
    let per_row = 11 * d + i + dims.patch_dim + head_dim;
    let q_block = ((16u64 << 20) / (h * b).max(1) / 16 * 16)
        .clamp(16, 1024)
        .min(b);
    let scores = 2 * h * q_block * b;
    let unit = dims.spatial_merge * dims.spatial_merge;
    let merged = d * unit;
    let merger =
        b / unit.max(1) * (2 * merged + dims.vision_out_hidden * (1 + dims.deepstack_levels));
    b * per_row + scores + merger
}

/// Activation elements of one LM step of `rows` rows (`logit_rows` of them produce logits)
/// attending to `keys` keys: per row hidden x 4, q x 2, k + v, the MLP's gate, up and
/// activation, staged image embeddings with their deepstack levels, rotary; scores and
/// probabilities; logits.
pub fn graph_lm_elems(dims: &ModelDims, rows: u64, logit_rows: u64, keys: u64) -> u64 {
    let h = dims.text_hidden;
    let q = dims.text_heads * dims.head_dim;
    let kv = dims.text_kv_heads * dims.head_dim;
    let per_row = 4 * h
        + 2 * q
        + 2 * kv
        + 3 * dims.text_intermediate
        + dims.vision_out_hidden * (1 + dims.deepstack_levels)
        + dims.head_dim;
    let scores = 2 * dims.text_heads * rows * keys;
    rows * per_row + scores + logit_rows * dims.vocab
}
