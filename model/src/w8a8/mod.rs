//! Checkpoint directories in compressed-tensors' `int-quantized` W8A8 layout, as llm-compressor
//! writes them and vLLM serves them (`CompressedTensorsW8A8Int8`): each quantized linear weight
//! is `{name}.weight` int8 (out, in) with `{name}.weight_scale` (out, 1), one symmetric scale per
//! output channel; activations are quantized at run time, one symmetric int8 scale per token.
//! Modules the checkpoint keeps in floats (its `ignore` list: the head, the vision tower) are
//! read as usual.
//!
//! [`open_dir`] validates the checkpoint's `quantization_config` and refuses what this server
//! does not run, naming the key; [`Int8Source::linear`] reads one weight for the backend's
//! [`crate::Kernels::int8_weight`]; [`quantize_checkpoint_w8a8`] writes such a directory from a
//! float checkpoint (`vlm quantize --scheme w8a8`).
mod scheme;
mod source;
mod writer;

pub use scheme::check_quantization_config;
pub use source::{open_dir, Int8Source};
pub use writer::{quantize_checkpoint_w8a8, quantize_rows, w8a8_config};

/// A linear weight as int8 values, one scale per output row: `W[n][k] = values[n * k + k'] *
/// scales[n]`.
#[derive(Debug, Clone)]
pub struct Int8Linear {
    /// Output rows.
    pub n: usize,
    /// Input columns.
    pub k: usize,
    /// Row-major (n, k).
    pub values: Vec<i8>,
    /// Per output row.
    pub scales: Vec<f32>,
}

impl Int8Linear {
    /// Row `r` in floats (`values * scale`, as the reference dequantizes it).
    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        let s = self.scales[r];
        self.values[r * self.k..(r + 1) * self.k]
            .iter()
            .map(|&v| v as f32 * s)
            .collect()
    }
}
