//! The ViT on the CPU: the bucket engine ([`engine`]) behind the seam's [`VisionBackend`], one
//! instance per core of the vision pool. The weights are loaded once and shared by the pool;
//! each instance has its own buffers for every bucket, allocated at load, so the cores never
//! wait on each other and a bucket's memory is known before the first image.
pub mod engine;

use crate::ops::CpuKernels;
use crate::options::CpuOptions;
use crate::sizing::{vit_bucket_bytes, VitDims};
use engine::Workspace;
use std::path::Path;
use std::sync::{Arc, Mutex};
use vlm_compute::{
    BackendInfo, BucketMemory, ComputeError, HostTensor, ImageEmbeds, PixelValues, Result,
    VisionBackend, VisionMemory, VisionRun,
};
use vlm_config::plan::Part;
use vlm_model::vision::{buckets, VisionModel};

/// Threads one device (core) runs an image on.
pub(crate) const THREADS_PER_DEVICE: u64 = 1;

/// One bucket of one device: its buffers and what they hold.
#[derive(Debug)]
struct Bucket {
    len: usize,
    memory: BucketMemory,
    /// Runs of one bucket on one device take turns on them.
    workspace: Mutex<Workspace>,
}

/// The ViT prepared at its buckets on one core.
#[derive(Debug)]
pub struct CpuVision {
    model: Arc<VisionModel<CpuKernels>>,
    opts: CpuOptions,
    lens: Vec<usize>,
    buckets: Vec<Bucket>,
    weight_bytes: u64,
    info: BackendInfo,
}

/// Whether the engine runs a model of `dtype` with these options: f32, or bf16 with the bf16
/// products (`kernels.bf16_dot`).
pub fn engine_runs(dtype: vlm_config::Dtype, opts: &CpuOptions) -> bool {
    match dtype {
        vlm_config::Dtype::F32 => true,
        vlm_config::Dtype::Bf16 => opts.bf16_dot,
        vlm_config::Dtype::F16 => false,
    }
}

/// Loads the vision tower once and prepares every bucket on each of `cores` (the pool).
pub fn load(
    dir: &Path,
    dtype: vlm_config::Dtype,
    buckets: &[usize],
    cores: &[usize],
    opts: CpuOptions,
) -> Result<Vec<CpuVision>> {
    if !engine_runs(dtype, &opts) {
        return Err(ComputeError::options(format!(
            "the CPU ViT engine runs f32 weights, or bf16 with kernels.bf16_dot (this CPU: {}); \
             {dtype:?} needs visual.kernels.backend: candle",
            if crate::kernels::bf16_dot_available() {
                "has AVX512-BF16"
            } else {
                "no AVX512-BF16"
            }
        )));
    }
    let plan_dims = vlm_config::plan::ModelDims::from_dir(dir)
        .map_err(|e| ComputeError::Weights(e.to_string()))?;
    let weight_bytes = vlm_model::sizing::weight_bytes(&plan_dims, Part::Visual, dtype);
    let dtype = vlm_model::dtype::candle_dtype(dtype);
    let kernels = CpuKernels::new(opts);
    let model = Arc::new(VisionModel::load(&kernels, dir, dtype).map_err(ComputeError::from)?);
    let cfg = model.config();
    let lens = buckets::prepare(buckets, cfg.merge_unit())?;
    let dims = VitDims::of(cfg);
    let tiles = (opts.attention_tiles.0 as u64, opts.attention_tiles.1 as u64);
    cores
        .iter()
        .map(|&core| {
            let buckets = lens
                .iter()
                .map(|&len| {
                    let (held, bytes) =
                        vit_bucket_bytes(&dims, len as u64, THREADS_PER_DEVICE, tiles);
                    Bucket {
                        len,
                        memory: BucketMemory {
                            bucket: len,
                            bytes,
                            held_bytes: held,
                        },
                        workspace: Mutex::new(Workspace::new(cfg, len)),
                    }
                })
                .collect();
            Ok(CpuVision {
                model: Arc::clone(&model),
                opts,
                lens: lens.clone(),
                buckets,
                weight_bytes,
                info: BackendInfo {
                    backend: "cpu",
                    device: format!("cpu core {core}"),
                    dtype: vlm_model::dtype::host_dtype(dtype),
                    kernels: opts.describe(),
                },
            })
        })
        .collect()
}

impl VisionBackend for CpuVision {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn buckets(&self) -> &[usize] {
        &self.lens
    }

    fn memory(&self) -> VisionMemory {
        VisionMemory {
            weight_bytes: self.weight_bytes,
            weights_shared: true,
            buckets: self.buckets.iter().map(|b| b.memory).collect(),
        }
    }

    fn encode_in(&self, bucket: usize, pv: &PixelValues) -> Result<VisionRun> {
        let grid = pv.grid_thw;
        let rows = pv.rows();
        self.model
            .check_input(&[rows, pv.row_len()], grid)
            .map_err(ComputeError::from)?;
        let slot = self
            .buckets
            .iter()
            .find(|b| b.len == bucket && bucket >= rows)
            .ok_or_else(|| {
                ComputeError::invalid(format!(
                    "no ViT bucket {bucket} holding {rows} patches (buckets {:?})",
                    self.lens
                ))
            })?;
        let (merged, deepstack) = {
            let mut ws = slot
                .workspace
                .lock()
                .map_err(|_| ComputeError::invalid("ViT workspace poisoned by an earlier panic"))?;
            engine::run(&self.model, &mut ws, &pv.values, grid, &self.opts)
                .map_err(ComputeError::from)?
        };
        let cfg = self.model.config();
        let tokens = rows / cfg.merge_unit();
        let shape = vec![tokens, cfg.out_hidden_size];
        Ok(VisionRun {
            embeds: ImageEmbeds {
                embeds: HostTensor::from_f32(&merged, shape.clone())?,
                deepstack: deepstack
                    .iter()
                    .map(|d| HostTensor::from_f32(d, shape.clone()))
                    .collect::<Result<_>>()?,
                grid_thw: grid,
            },
            bucket,
            padding_fraction: (bucket - rows) as f32 / bucket as f32,
        })
    }
}

impl CpuVision {
    /// The loaded model (shared by the pool), for tests that compare with its exact forward.
    pub fn model(&self) -> &Arc<VisionModel<CpuKernels>> {
        &self.model
    }
}
