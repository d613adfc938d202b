//! Checkpoint directories in compressed-tensors' `pack-quantized` W4A16 layout, as
//! llm-compressor's `W4A16` preset writes them and vLLM serves them (`CompressedTensorsWNA16`):
//! each quantized linear weight is `{name}.weight_packed` int32 (out, in / 8), eight 4-bit
//! values a word (value `i` of a word in bits `4i..4i + 4`, stored `+ 8`), with
//! `{name}.weight_scale` (out, in / group), one symmetric scale per output row and group of
//! `group_size` inputs, and `{name}.weight_shape` (out, in). Activations stay in floats. Only
//! the symmetric scheme is served (no `weight_zero_point`) and groups in file order (no
//! `actorder`, `weight_g_idx`); others are refused at start, naming the key or tensor.
//!
//! [`open_dir`] validates the checkpoint; [`Int4Source::linear`] reads one weight for the
//! backend's [`crate::Kernels::int4_weight`]; [`quantize_checkpoint_w4a16`] writes such a
//! directory from a float checkpoint (`vlm quantize --scheme w4a16`).
mod scheme;
mod source;
mod writer;

pub use scheme::check_quantization_config;
pub use source::{open_dir, Int4Source};
pub use writer::{quantize_checkpoint_w4a16, w4a16_config};

/// Group size `vlm quantize --scheme w4a16` writes by default (llm-compressor's preset).
pub const DEFAULT_GROUP: usize = 128;

/// A linear weight as 4-bit values with a scale per output row and group of inputs:
/// `W[r][i] = values[r * k + i] * scales[r * (k / group) + i / group]`.
#[derive(Debug, Clone)]
pub struct Int4Linear {
    /// Output rows.
    pub n: usize,
    /// Input columns (a multiple of `group`).
    pub k: usize,
    /// Inputs per scale (even).
    pub group: usize,
    /// Row-major (n, k), each in -8..=7.
    pub values: Vec<i8>,
    /// Row-major (n, k / group).
    pub scales: Vec<f32>,
}
