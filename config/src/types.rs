//! The normalized deployment config: what the services run with, after aliases are resolved,
//! defaults filled in and every rule checked (see [`crate::DeployConfig::from_value`]).
use serde::Serialize;

/// What happens to an image whose patch count is over the largest ViT bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Oversize {
    /// Refuse the image (the library's behaviour).
    #[default]
    Reject,
    /// Resize it (keeping the aspect ratio) so that it fits the largest bucket.
    Downscale,
}

/// Compute dtype of a part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    #[default]
    F32,
    F16,
    Bf16,
}

impl Dtype {
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        }
    }
}

/// The LM's KV cache dtype as configured (`kv_cache_dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum KvCacheDtype {
    /// The backend's choice for the weights: bf16 for bf16 weights, else f32.
    #[default]
    Auto,
    /// FP8 E4M3 codes with a scale of 1.0 (vLLM's `--kv-cache-dtype fp8` without calibrated
    /// scales); values past +-448 saturate. Half a bf16 cache's bytes per token, so twice the
    /// tokens in the same memory and half the KV bytes a decode step reads.
    Fp8E4m3,
}

/// The dtype a KV cache holds, as the planner sizes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KvDtype {
    F32,
    F16,
    Bf16,
    Fp8E4m3,
}

impl KvDtype {
    pub fn bytes(self) -> u64 {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
            KvDtype::Fp8E4m3 => 1,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp8E4m3 => "fp8_e4m3",
        }
    }
}

impl From<Dtype> for KvDtype {
    fn from(d: Dtype) -> Self {
        match d {
            Dtype::F32 => KvDtype::F32,
            Dtype::F16 => KvDtype::F16,
            Dtype::Bf16 => KvDtype::Bf16,
        }
    }
}

impl KvCacheDtype {
    /// The cache dtype: `backend` (the backend's choice for the weights) unless one is named.
    pub fn resolve(self, backend: KvDtype) -> KvDtype {
        match self {
            KvCacheDtype::Auto => backend,
            KvCacheDtype::Fp8E4m3 => KvDtype::Fp8E4m3,
        }
    }
}

/// Which compute backend runs a part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// The build's best backend for the part's devices.
    #[default]
    Auto,
    /// The hand-written CPU engine.
    Cpu,
    /// candle's ops.
    Candle,
    /// NVIDIA GPUs: cuBLAS GEMMs and this project's paged-attention kernels (a build with the
    /// `cuda` feature).
    Cuda,
}

/// A kernel feature: used when the CPU has it (`auto`), required (`on`) or never used (`off`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Toggle {
    #[default]
    Auto,
    On,
    Off,
}

/// Default ViT attention tile: query rows x keys per tile.
pub const DEFAULT_ATTENTION_TILES: [u32; 2] = [256, 512];

/// The `kernels` section (top level for the LM, `visual.kernels` for the ViT).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct KernelConfig {
    pub backend: BackendChoice,
    /// bf16 products on AVX512-BF16 for bf16 weights; `off` = the f32/widening paths.
    pub bf16_dot: Toggle,
    /// Intel AMX tiles for those bf16 products.
    pub amx: Toggle,
    /// `Auto` or `Off` only; `off` = the scalar decode gemv and candle's quantized products
    /// (not our k-quant gemv), for testing.
    pub simd: Toggle,
    /// ViT attention tile: query rows x keys per tile, each >= 8 (`visual.kernels` only).
    pub attention_tiles: [u32; 2],
    /// Log the ViT engine's per-phase wall time for every run (`visual.kernels` only).
    pub profile: bool,
}

impl Default for KernelConfig {
    fn default() -> Self {
        KernelConfig {
            backend: BackendChoice::default(),
            bf16_dot: Toggle::default(),
            amx: Toggle::default(),
            simd: Toggle::default(),
            attention_tiles: DEFAULT_ATTENTION_TILES,
            profile: false,
        }
    }
}

/// The top-level `kernels` as written out: only the keys valid there, so that the normalized
/// config (`vlm config check`) reads back as the same config.
fn serialize_lm_kernels<S: serde::Serializer>(k: &KernelConfig, s: S) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct LmKernels {
        backend: BackendChoice,
        bf16_dot: Toggle,
        amx: Toggle,
        simd: Toggle,
    }
    LmKernels {
        backend: k.backend,
        bf16_dot: k.bf16_dot,
        amx: k.amx,
        simd: k.simd,
    }
    .serialize(s)
}

/// The whole config: the LM at the top level, the ViT under `visual`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeployConfig {
    /// Longest context (prompt + generated) of one sequence, in tokens.
    pub max_seq_len: u32,
    /// Tokens per KV block (the library's flash-attention partition).
    pub kvcache_partition_len: u32,
    /// KV blocks in the pool; 0 = automatic (as many as fit the memory given).
    pub kvcache_num_blocks: u32,
    /// Most sequences running at once, for the whole model.
    pub batch_size: u32,
    /// One decode graph per entry, ascending; the largest equals `batch_size`.
    pub decoder_batch_sizes: Vec<u32>,
    /// Tokens per prefill chunk.
    pub prefill_chunk_size: u32,
    /// Devices of the LM; `device.len() == num_devices`.
    pub num_devices: u32,
    pub device: Vec<u32>,
    /// false = prepare and report only, do not start serving (a dry run).
    pub create_runtimes: bool,
    /// The compute dtype; F32 until `auto` is resolved ([`DeployConfig::resolve_auto_dtype`]).
    pub dtype: Dtype,
    /// The config asked for `dtype: auto` (or named none) and it is not resolved yet.
    #[serde(skip)]
    pub dtype_auto: bool,
    /// Kernel choices of the LM (`attention_tiles` and `profile` stay at their defaults here:
    /// they are `visual.kernels` keys, so they are not written out either).
    #[serde(serialize_with = "serialize_lm_kernels")]
    pub kernels: KernelConfig,
    /// KV blocks are content-addressed and reused across requests that share a prefix
    /// (conversation turns, a shared system prompt or image); freed blocks stay cached until
    /// the pool needs them.
    pub prefix_caching: bool,
    /// The KV cache's dtype: `auto` (the backend's for the weights) or `fp8_e4m3`.
    pub kv_cache_dtype: KvCacheDtype,
    pub visual: VisualConfig,
}

/// The `visual` section.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VisualConfig {
    /// ViT buckets in raw 16-px patches, ascending.
    pub max_seq_len: Vec<u32>,
    pub num_devices: u32,
    pub device: Vec<u32>,
    pub create_runtimes: bool,
    /// Processor limits on the resized image, in pixels.
    pub min_pixels: u64,
    pub max_pixels: u64,
    pub oversize: Oversize,
    /// As the LM's `dtype` and `dtype_auto`.
    pub dtype: Dtype,
    #[serde(skip)]
    pub dtype_auto: bool,
    /// Kernel choices of the ViT.
    pub kernels: KernelConfig,
}

impl DeployConfig {
    /// KV blocks one full-length sequence needs.
    pub fn blocks_per_sequence(&self) -> u32 {
        self.max_seq_len / self.kvcache_partition_len
    }
}
