//! What the CUDA backend holds, for the planner: candle's accelerator figures (each GPU its own
//! weights; buffers per run from the stream-ordered pool; one GPU per LM replica) under this
//! backend's name, plus the decode kernel's split partials in the LM step.
use crate::select::{MAX_SPLITS, MIN_SPLIT_TOKENS};
use vlm_backend_candle::sizing::CandleSizing;
use vlm_config::plan::{BucketBytes, BufferPolicy, Dtypes, ModelDims, Part, PoolUse, Sizing};
use vlm_config::{DeployConfig, Dtype, VisualConfig};

#[derive(Debug, Clone, Copy)]
pub struct CudaSizing {
    base: CandleSizing,
}

impl Default for CudaSizing {
    fn default() -> Self {
        CudaSizing {
            base: CandleSizing { accelerator: true },
        }
    }
}

/// f32 split partials of one decode step of `rows` rows at the longest context `max_ctx`:
/// (rows, heads, splits, head_dim + 2).
pub fn decode_partial_bytes(dims: &ModelDims, rows: u64, max_ctx: u64) -> u64 {
    let splits = max_ctx
        .div_ceil(MIN_SPLIT_TOKENS as u64)
        .clamp(1, MAX_SPLITS as u64);
    4 * rows * dims.text_heads * splits * (dims.head_dim + 2)
}

impl Sizing for CudaSizing {
    fn backend(&self, _: Part) -> &'static str {
        "cuda"
    }
    fn dtypes(&self, part: Part, dtype: Dtype) -> Dtypes {
        self.base.dtypes(part, dtype)
    }
    fn weight_bytes(&self, dims: &ModelDims, part: Part, weights: Dtype) -> u64 {
        self.base.weight_bytes(dims, part, weights)
    }
    fn kv_extra_blocks(&self) -> u32 {
        self.base.kv_extra_blocks()
    }
    fn vit_bucket(&self, dims: &ModelDims, visual: &VisualConfig, rows: u64) -> BucketBytes {
        self.base.vit_bucket(dims, visual, rows)
    }
    fn vit_buffers(&self, visual: &VisualConfig) -> BufferPolicy {
        self.base.vit_buffers(visual)
    }
    fn lm_step(&self, dims: &ModelDims, cfg: &DeployConfig, rows: u64, logit_rows: u64) -> u64 {
        self.base.lm_step(dims, cfg, rows, logit_rows)
            + decode_partial_bytes(dims, rows, cfg.max_seq_len as u64)
    }
    fn lm_buffers(&self) -> BufferPolicy {
        self.base.lm_buffers()
    }
    fn pool(&self, part: Part, n: u32) -> Result<PoolUse, String> {
        self.base
            .pool(part, n)
            .map_err(|e| e.replace("the candle backend", "the cuda backend"))
    }
    fn process_baseline(&self) -> u64 {
        self.base.process_baseline()
    }
}
