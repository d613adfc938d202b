//! What the CPU backend holds, as functions of the model's dimensions: used both where the
//! backend allocates (so a loaded backend reports these figures) and by the memory planner
//! (`vlm plan`, `kvcache_num_blocks: 0`), so the plan is the allocation.
use vlm_compute::VisionConfig;
use vlm_config::plan::{
    BucketBytes, BufferPolicy, Dtypes, ModelDims, Part, PoolUse, Sizing, CPU_PROCESS_BASELINE,
};
use vlm_config::{DeployConfig, Dtype, VisualConfig};

/// The ViT dimensions the engine's buffers depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VitDims {
    pub hidden: u64,
    pub intermediate: u64,
    pub heads: u64,
    pub out_hidden: u64,
    pub deepstack_levels: u64,
    /// Raw patches per merged token (spatial_merge_size^2).
    pub merge_unit: u64,
}

impl VitDims {
    pub fn of(cfg: &VisionConfig) -> VitDims {
        VitDims {
            hidden: cfg.hidden_size as u64,
            intermediate: cfg.intermediate_size as u64,
            heads: cfg.num_heads as u64,
            out_hidden: cfg.out_hidden_size as u64,
            deepstack_levels: cfg.deepstack_visual_indexes.len() as u64,
            merge_unit: cfg.merge_unit() as u64,
        }
    }
    pub fn from_plan(d: &ModelDims) -> VitDims {
        VitDims {
            hidden: d.vision_hidden,
            intermediate: d.vision_intermediate,
            heads: d.vision_heads,
            out_hidden: d.vision_out_hidden,
            deepstack_levels: d.deepstack_levels,
            merge_unit: d.spatial_merge * d.spatial_merge,
        }
    }
    pub fn head_dim(&self) -> u64 {
        self.hidden / self.heads.max(1)
    }
    /// Width of the engine's wide buffer: qkv, then the MLP hidden, then the merger hidden.
    pub fn big_width(&self) -> u64 {
        self.intermediate.max(3 * self.hidden).max(self.hidden)
    }
}

/// Bytes of one ViT bucket of `rows` on the engine: `held` are the buffers allocated at load
/// and kept (the residual stream, norm/attention output, q, k, v and the wide buffer, all f32:
/// `rows x (5 hidden + big_width)`), `total` adds what one run allocates (rotary and position
/// tables, one attention tile's scratch per thread of `tiles` = (query rows, keys), outputs).
pub fn vit_bucket_bytes(d: &VitDims, rows: u64, threads: u64, tiles: (u64, u64)) -> (u64, u64) {
    let held = rows * (5 * d.hidden + d.big_width());
    let tables = rows * (d.head_dim() + 8); // cos, sin, pos taps
    let (qt, kt) = tiles;
    let scratch = threads * (qt * kt + 3 * qt);
    let tokens = rows / d.merge_unit.max(1);
    let outputs = tokens * d.out_hidden * (1 + d.deepstack_levels);
    (4 * held, 4 * (held + tables + scratch + outputs))
}

/// The CPU backend's [`Sizing`]: the ViT engine's per-bucket buffers (held from load, one set
/// per core of the vision pool), the LM's per-op buffers, f32 activations, a bf16 KV cache for
/// bf16 weights, one dummy KV block, the weights once for a pool of cores.
#[derive(Debug, Clone, Copy)]
pub struct CpuSizing {
    /// The ViT's attention tiles (they size each run's scratch).
    pub attention_tiles: (u64, u64),
}

impl CpuSizing {
    pub fn new(visual: &vlm_config::KernelConfig) -> CpuSizing {
        let [q, k] = visual.attention_tiles;
        CpuSizing {
            attention_tiles: (q as u64, k as u64),
        }
    }
}

impl Sizing for CpuSizing {
    fn backend(&self, _: Part) -> &'static str {
        "cpu"
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
        let (held, bytes) = vit_bucket_bytes(
            &VitDims::from_plan(dims),
            rows,
            crate::vit::THREADS_PER_DEVICE,
            self.attention_tiles,
        );
        BucketBytes { bytes, held }
    }
    fn vit_buffers(&self, _: &VisualConfig) -> BufferPolicy {
        BufferPolicy::PerGraph
    }
    fn lm_step(&self, dims: &ModelDims, cfg: &DeployConfig, rows: u64, logit_rows: u64) -> u64 {
        vlm_model::sizing::lm_step_bytes(dims, cfg, rows, logit_rows)
    }
    fn lm_buffers(&self) -> BufferPolicy {
        BufferPolicy::PerRun
    }
    fn pool(&self, _: Part, _: u32) -> Result<PoolUse, String> {
        Ok(PoolUse::Host)
    }
    fn process_baseline(&self) -> u64 {
        CPU_PROCESS_BASELINE
    }
}
