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
    pub dtype: Dtype,
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
    pub dtype: Dtype,
}

impl DeployConfig {
    /// KV blocks one full-length sequence needs.
    pub fn blocks_per_sequence(&self) -> u32 {
        self.max_seq_len / self.kvcache_partition_len
    }
}
