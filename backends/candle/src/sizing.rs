//! What the candle backend holds (the planner's [`Sizing`]): every buffer is allocated per op
//! and freed after the run, so a part holds its weights, its KV pool and one run's activations
//! (`graph_vit_elems`, `graph_lm_elems`: the forward's live tensors, f32) at a time. On a CUDA
//! build each device of a pool holds its own copy; on the CPU the pool's cores share one.
use vlm_config::plan::{
    graph_vit_elems, BucketBytes, BufferPolicy, Dtypes, ModelDims, Part, PoolUse, Sizing,
    CPU_PROCESS_BASELINE,
};
use vlm_config::{DeployConfig, Dtype, VisualConfig};

#[derive(Debug, Clone, Copy, Default)]
pub struct CandleSizing {
    /// The devices are GPUs (each holds its own copy), not the host's cores.
    pub accelerator: bool,
}

impl Sizing for CandleSizing {
    fn backend(&self, _: Part) -> &'static str {
        "candle"
    }
    fn dtypes(&self, _: Part, dtype: Dtype) -> Dtypes {
        vlm_model::sizing::dtypes(dtype)
    }
    fn weight_bytes(&self, dims: &ModelDims, part: Part, weights: Dtype) -> u64 {
        vlm_model::sizing::weight_bytes(dims, part, weights)
    }
    fn kv_extra_blocks(&self) -> u32 {
        vlm_model::sizing::KV_EXTRA_BLOCKS
    }
    fn vit_bucket(&self, dims: &ModelDims, _: &VisualConfig, rows: u64) -> BucketBytes {
        BucketBytes {
            bytes: 4 * graph_vit_elems(dims, rows),
            held: 0,
        }
    }
    fn vit_buffers(&self, _: &VisualConfig) -> BufferPolicy {
        BufferPolicy::PerRun
    }
    fn lm_step(&self, dims: &ModelDims, cfg: &DeployConfig, rows: u64, logit_rows: u64) -> u64 {
        vlm_model::sizing::lm_step_bytes(dims, cfg, rows, logit_rows)
    }
    fn lm_buffers(&self) -> BufferPolicy {
        BufferPolicy::PerRun
    }
    fn pool(&self, part: Part, n: u32) -> Result<PoolUse, String> {
        if !self.accelerator {
            return Ok(PoolUse::Host);
        }
        match part {
            Part::Visual => Ok(PoolUse::Replicas),
            Part::Lm if n <= 1 => Ok(PoolUse::Replicas),
            Part::Lm => Err(format!(
                "the candle backend runs the LM on one device, and this pool has {n}; tensor \
                 parallel is not implemented: run one LM replica per device"
            )),
        }
    }
    fn process_baseline(&self) -> u64 {
        if self.accelerator {
            0
        } else {
            CPU_PROCESS_BASELINE
        }
    }
}
