//! Checkpoint directories in the FP8 block layout Qwen publishes its FP8 models in (and
//! DeepSeek before it; what vLLM loads as `Fp8LinearMethod` with `weight_block_size`):
//! `quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [bn, bk]}`; each
//! quantized linear weight is `{name}.weight` float8 e4m3fn (out, in) with
//! `{name}.weight_scale_inv` (ceil(out / bn), ceil(in / bk)), one scale per block of bn output
//! rows and bk inputs (`W = fp8 * scale_inv`, the name notwithstanding). Activations stay in
//! floats (the CPU has no FP8 arithmetic; vLLM's CPU kernel keeps them in bf16 too, where its
//! GPU kernels quantize them per token group). Modules the checkpoint keeps in floats
//! (`modules_to_not_convert`) are read as usual; FP8 tensors outside the LM's linears, static
//! activation scales and per-tensor FP8 (no `weight_block_size`) are refused at start, naming
//! the key or tensor.
//!
//! [`open_dir`] validates the checkpoint; [`Fp8Source::linear`] reads one weight for the
//! backend's [`crate::Kernels::fp8_weight`]; [`quantize_checkpoint_fp8`] writes such a
//! directory from a float checkpoint (`vlm quantize --scheme fp8-block`).
mod scheme;
mod source;
mod writer;

pub use scheme::check_quantization_config;
pub use source::{open_dir, Fp8Source};
pub use writer::{fp8_config, quantize_checkpoint_fp8};

/// A linear weight as e4m3fn codes with a scale per block: `W[r][i] = e4m3(codes[r * k + i])
/// * scales[(r / block_n) * ceil(k / block_k) + i / block_k]`.
#[derive(Debug, Clone)]
pub struct Fp8Linear {
    /// Output rows.
    pub n: usize,
    /// Input columns (a multiple of `block_k`).
    pub k: usize,
    /// Output rows and inputs per scale block.
    pub block_n: usize,
    pub block_k: usize,
    /// Row-major (n, k) e4m3fn bytes (no NaN: refused at load).
    pub codes: Vec<u8>,
    /// Row-major (ceil(n / block_n), k / block_k).
    pub scales: Vec<f32>,
}

impl Fp8Linear {
    /// The scale of row `r` and input block `g`.
    pub fn scale(&self, r: usize, g: usize) -> f32 {
        self.scales[(r / self.block_n) * (self.k / self.block_k) + g]
    }
}

/// The value of an e4m3fn byte (OCP FP8: bias 7, no infinities, 0x7F/0xFF NaN).
pub fn e4m3_value(code: u8) -> f32 {
    float8::F8E4M3::from_bits(code).to_f32()
}
