//! Picks the compute backend of each part from its `kernels` config and loads it behind the
//! seam's traits. The services call only this and `vlm-compute`; a new backend is a folder
//! under `backends/` plus one arm in [`Backend`] and in the functions below.
//!
//! What a pool of N devices (`device: [...]`) does, per backend:
//!
//! | backend | a device is | LM pool of N | ViT pool of N |
//! |---|---|---|---|
//! | `cpu` | a host core | one engine; the service pins its N compute threads one per core | N instances, one image at a time each, one copy of the weights |
//! | `candle` | the CPU, or a CUDA GPU (`cuda` feature) | N = 1 only (no tensor parallel) | N instances, each device its own weights |
//! | `cuda` | a CUDA GPU (`cuda` feature) | N = 1 only (no tensor parallel) | N instances, each GPU its own weights |
use std::path::Path;
use vlm_compute::{ComputeError, LmBackend, Result, VisionBackend};
use vlm_config::plan::{
    BucketBytes, BufferPolicy, DeviceKind, Dtypes, ModelDims, Part as PlanPart, PlanOptions,
    PoolUse, RblnSizing, Sizing,
};
use vlm_config::{
    BackendChoice, DeployConfig, Dtype, KernelConfig, KvCacheDtype, Toggle, VisualConfig,
};

/// A compute backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// `backends/cpu`: the hand-tuned CPU kernels.
    Cpu,
    /// `backends/candle`: candle's ops on the CPU or (with `cuda`) a GPU.
    Candle,
    /// `backends/cuda`: resident bf16 weights, cuBLAS, the paged-attention kernels (a `cuda`
    /// build).
    Cuda,
}

/// Which part a backend is chosen for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Lm,
    Vision,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Candle => "candle",
            Backend::Cuda => "cuda",
        }
    }

    /// Whether the part's device ids are host cores (the service pins its compute threads to
    /// them) rather than accelerator ordinals.
    pub fn devices_are_cores(self) -> bool {
        match self {
            Backend::Cpu => true,
            Backend::Candle => !cfg!(feature = "cuda"),
            Backend::Cuda => false,
        }
    }

    /// The backend `kernels.backend` names for a part of `dtype`; `auto` is the build's best:
    /// the CUDA backend on a CUDA build; otherwise the CPU backend, except for a ViT the CPU engine does
    /// not run (f16, or bf16 without AVX512-BF16), which takes candle.
    pub fn resolve(kernels: &KernelConfig, dtype: Dtype, part: Part) -> Result<Backend> {
        let chosen = match kernels.backend {
            BackendChoice::Cpu => Backend::Cpu,
            BackendChoice::Candle => Backend::Candle,
            BackendChoice::Cuda if cfg!(feature = "cuda") => Backend::Cuda,
            BackendChoice::Cuda => {
                return Err(ComputeError::options(
                    "kernels.backend is cuda but this build has no CUDA: build with \
                     `--features cuda` (scripts/cuda-toolkit.sh sets up the toolkit)",
                ))
            }
            BackendChoice::Auto if cfg!(feature = "cuda") => Backend::Cuda,
            BackendChoice::Auto => match part {
                Part::Lm => Backend::Cpu,
                Part::Vision => {
                    let opts = vlm_backend_cpu::CpuOptions::resolve(kernels)?;
                    if vlm_backend_cpu::vit::engine_runs(dtype, &opts) {
                        Backend::Cpu
                    } else {
                        Backend::Candle
                    }
                }
            },
        };
        if matches!(chosen, Backend::Candle | Backend::Cuda) {
            for (key, t) in [
                ("bf16_dot", kernels.bf16_dot),
                ("amx", kernels.amx),
                ("simd", kernels.simd),
            ] {
                if t != Toggle::Auto {
                    return Err(ComputeError::options(format!(
                        "kernels.{key} is {t:?} but this part runs on the {} backend, which \
                         has no such kernel choice; leave it auto or set backend: cpu",
                        chosen.name()
                    )));
                }
            }
        }
        Ok(chosen)
    }
}

/// What an LM backend is loaded with.
#[derive(Debug, Clone)]
pub struct LmLoad<'a> {
    pub model_dir: &'a Path,
    pub dtype: Dtype,
    /// `kv_cache_dtype`: FP8 runs on the CPU backend only.
    pub kv_cache_dtype: KvCacheDtype,
    pub kernels: &'a KernelConfig,
    /// Usable KV blocks (resolved from `kvcache_num_blocks`) and tokens per block.
    pub num_blocks: usize,
    pub block_len: usize,
    /// The LM's device pool (`device`).
    pub devices: &'a [u32],
}

/// Loads the LM on the backend its `kernels` config resolves to.
pub fn load_lm(l: &LmLoad) -> Result<Box<dyn LmBackend>> {
    let backend = Backend::resolve(l.kernels, l.dtype, Part::Lm)?;
    if l.kv_cache_dtype != KvCacheDtype::Auto && backend != Backend::Cpu {
        return Err(ComputeError::options(format!(
            "kv_cache_dtype {} runs on the cpu backend; this LM runs on {}: leave \
             kv_cache_dtype auto or set kernels.backend: cpu",
            l.kv_cache_dtype.resolve(l.dtype.into()).as_str(),
            backend.name()
        )));
    }
    Ok(match backend {
        Backend::Cpu => {
            let opts = vlm_backend_cpu::CpuOptions::resolve(l.kernels)?;
            let cores: Vec<usize> = l.devices.iter().map(|&d| d as usize).collect();
            Box::new(vlm_backend_cpu::lm::load(
                l.model_dir,
                l.dtype,
                l.kv_cache_dtype,
                l.num_blocks,
                l.block_len,
                &cores,
                opts,
            )?)
        }
        Backend::Candle => Box::new(vlm_backend_candle::lm::load(
            l.model_dir,
            l.dtype,
            l.num_blocks,
            l.block_len,
            l.devices,
        )?),
        Backend::Cuda => cuda_lm(l)?,
    })
}

#[cfg(feature = "cuda")]
fn cuda_lm(l: &LmLoad) -> Result<Box<dyn LmBackend>> {
    Ok(Box::new(vlm_backend_cuda::gpu::lm::load(
        l.model_dir,
        l.dtype,
        l.num_blocks,
        l.block_len,
        l.devices,
    )?))
}

#[cfg(not(feature = "cuda"))]
fn cuda_lm(_: &LmLoad) -> Result<Box<dyn LmBackend>> {
    Err(no_cuda())
}

#[cfg(feature = "cuda")]
fn cuda_vision(l: &VisionLoad) -> Result<Vec<Box<dyn VisionBackend>>> {
    Ok(
        vlm_backend_cuda::gpu::vision::load(l.model_dir, l.dtype, l.buckets, l.devices)?
            .into_iter()
            .map(|v| Box::new(v) as Box<dyn VisionBackend>)
            .collect(),
    )
}

#[cfg(not(feature = "cuda"))]
fn cuda_vision(_: &VisionLoad) -> Result<Vec<Box<dyn VisionBackend>>> {
    Err(no_cuda())
}

#[cfg(not(feature = "cuda"))]
fn no_cuda() -> ComputeError {
    ComputeError::options("the cuda backend is not in this build (build with `--features cuda`)")
}

/// What a vision backend is loaded with.
#[derive(Debug, Clone)]
pub struct VisionLoad<'a> {
    pub model_dir: &'a Path,
    pub dtype: Dtype,
    pub kernels: &'a KernelConfig,
    /// ViT buckets in raw patches.
    pub buckets: &'a [usize],
    /// The ViT's device pool (`visual.device`): one instance each.
    pub devices: &'a [u32],
}

/// Loads the ViT on the backend its `kernels` config resolves to: one instance per device.
pub fn load_vision(l: &VisionLoad) -> Result<Vec<Box<dyn VisionBackend>>> {
    Ok(match Backend::resolve(l.kernels, l.dtype, Part::Vision)? {
        Backend::Cpu => {
            let opts = vlm_backend_cpu::CpuOptions::resolve(l.kernels)?;
            let cores: Vec<usize> = l.devices.iter().map(|&d| d as usize).collect();
            vlm_backend_cpu::vit::load(l.model_dir, l.dtype, l.buckets, &cores, opts)?
                .into_iter()
                .map(|v| Box::new(v) as Box<dyn VisionBackend>)
                .collect()
        }
        Backend::Candle => {
            vlm_backend_candle::vision::load(l.model_dir, l.dtype, l.buckets, l.devices)?
                .into_iter()
                .map(|v| Box::new(v) as Box<dyn VisionBackend>)
                .collect()
        }
        Backend::Cuda => cuda_vision(l)?,
    })
}

/// The planner's sizes for `cfg` on devices of `kind`, from the backends the services would
/// run: the seeds' NPU runtime for RBLN kinds; the CUDA backend for a GPU kind (candle's when
/// the config names candle); on the host, each part's
/// backend as [`Backend::resolve`] picks it.
pub fn sizing(
    cfg: &DeployConfig,
    kind: &DeviceKind,
    opts: &PlanOptions,
) -> Result<Box<dyn Sizing>> {
    if let Some(native) = kind.native_dtype {
        return Ok(Box::new(RblnSizing {
            dtype: opts.dtype.unwrap_or(native),
        }));
    }
    if !kind.shared_pool {
        if cfg.kernels.backend == BackendChoice::Candle {
            return Ok(Box::new(vlm_backend_candle::sizing::CandleSizing {
                accelerator: true,
            }));
        }
        return Ok(Box::new(vlm_backend_cuda::CudaSizing::default()));
    }
    let of = |b: Backend, visual_kernels: &KernelConfig| -> Box<dyn Sizing> {
        match b {
            Backend::Cpu => Box::new(vlm_backend_cpu::sizing::CpuSizing::new(visual_kernels)),
            Backend::Candle => {
                Box::new(vlm_backend_candle::sizing::CandleSizing { accelerator: false })
            }
            Backend::Cuda => Box::new(vlm_backend_cuda::CudaSizing::default()),
        }
    };
    let vdtype = opts.dtype.unwrap_or(cfg.visual.dtype);
    let ldtype = opts.dtype.unwrap_or(cfg.dtype);
    Ok(Box::new(PartSizing {
        visual: of(
            Backend::resolve(&cfg.visual.kernels, vdtype, Part::Vision)?,
            &cfg.visual.kernels,
        ),
        lm: of(
            Backend::resolve(&cfg.kernels, ldtype, Part::Lm)?,
            &cfg.visual.kernels,
        ),
    }))
}

/// Each part's figures from its own backend.
struct PartSizing {
    visual: Box<dyn Sizing>,
    lm: Box<dyn Sizing>,
}

impl PartSizing {
    fn of(&self, part: PlanPart) -> &dyn Sizing {
        match part {
            PlanPart::Visual => self.visual.as_ref(),
            PlanPart::Lm => self.lm.as_ref(),
        }
    }
}

impl Sizing for PartSizing {
    fn backend(&self, part: PlanPart) -> &'static str {
        self.of(part).backend(part)
    }
    fn dtypes(&self, part: PlanPart, dtype: Dtype) -> Dtypes {
        self.of(part).dtypes(part, dtype)
    }
    fn weight_bytes(&self, dims: &ModelDims, part: PlanPart, weights: Dtype) -> u64 {
        self.of(part).weight_bytes(dims, part, weights)
    }
    fn kv_extra_blocks(&self) -> u32 {
        self.lm.kv_extra_blocks()
    }
    fn vit_bucket(&self, dims: &ModelDims, visual: &VisualConfig, rows: u64) -> BucketBytes {
        self.visual.vit_bucket(dims, visual, rows)
    }
    fn vit_buffers(&self, visual: &VisualConfig) -> BufferPolicy {
        self.visual.vit_buffers(visual)
    }
    fn lm_step(&self, dims: &ModelDims, cfg: &DeployConfig, rows: u64, logit_rows: u64) -> u64 {
        self.lm.lm_step(dims, cfg, rows, logit_rows)
    }
    fn lm_buffers(&self) -> BufferPolicy {
        self.lm.lm_buffers()
    }
    fn pool(&self, part: PlanPart, n: u32) -> std::result::Result<PoolUse, String> {
        self.of(part).pool(part, n)
    }
    fn process_baseline(&self) -> u64 {
        self.visual
            .process_baseline()
            .max(self.lm.process_baseline())
    }
}

/// The memory of the host a service on `backend` starts on (`MemAvailable` or the container's
/// limit), or, for a GPU, of the first device of the pool as its driver reports it now
/// (`cuMemGetInfo`: free memory, less the CUDA backend's margin).
pub fn device_kind(backend: Backend, devices: &[u32]) -> Result<DeviceKind> {
    if backend.devices_are_cores() {
        return DeviceKind::cpu_available().map_err(|e| ComputeError::options(e.to_string()));
    }
    gpu_kind(devices.first().copied().unwrap_or(0))
}

#[cfg(feature = "cuda")]
fn gpu_kind(ordinal: u32) -> Result<DeviceKind> {
    let dev = vlm_backend_cuda::gpu::device::open(ordinal)?;
    let mem = vlm_backend_cuda::gpu::device::memory(&dev)?;
    Ok(vlm_backend_cuda::plan::device_kind(&mem))
}

#[cfg(not(feature = "cuda"))]
fn gpu_kind(_: u32) -> Result<DeviceKind> {
    Err(no_cuda())
}
