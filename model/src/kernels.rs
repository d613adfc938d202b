//! What a backend plugs into the one Qwen3-VL forward of this crate: how it holds a linear
//! weight and multiplies by it, and how it attends over the paged KV cache. The layers call
//! these and never ask which device or instruction set they run on (candle's `CustomOp` idea:
//! one op, one place per device).
//!
//! Implementations: `backends/cpu` (the hand-tuned bf16 / AMX kernels) and `backends/candle`
//! (candle's own ops, any device). A new backend implements this trait (or runs a forward of
//! its own, such as compiled graphs) and the seam's `LmBackend` / `VisionBackend`.
use crate::error::Result;
use crate::text::AttnCall;
use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor};
use std::sync::Arc;

pub trait Kernels: Clone + Send + Sync + std::fmt::Debug + 'static {
    /// A linear layer's weight as this backend holds it (packed, on device, ...).
    type Weight: Clone + Send + Sync + std::fmt::Debug;

    /// The backend's name (`cpu`, `candle`).
    fn name(&self) -> &'static str;
    /// Where activations and weights live.
    fn device(&self) -> &Device;

    /// Takes a (out, in) weight as loaded from the checkpoint (in its storage dtype, on
    /// [`Self::device`]).
    fn weight(&self, w: Tensor) -> Result<Self::Weight>;
    /// Takes a block-quantized (out, in) weight (GGUF's Q8_0, Q4_K, ...), to multiply by
    /// without a float copy. Backends that cannot refuse it, naming themselves.
    fn quantized_weight(&self, w: Arc<QTensor>) -> Result<Self::Weight> {
        Err(crate::ModelError::weights(format!(
            "the {} backend does not run block-quantized weights ({:?}); use the cpu backend",
            self.name(),
            w.dtype()
        )))
    }
    /// Takes an int8 (out, in) weight with per-output-channel scales (a W8A8 checkpoint's),
    /// whose products quantize each activation row to int8 with a scale of its own. Backends
    /// that cannot refuse it, naming themselves.
    fn int8_weight(&self, w: crate::w8a8::Int8Linear) -> Result<Self::Weight> {
        Err(crate::ModelError::weights(format!(
            "the {} backend does not run W8A8 int8 weights ({}x{}); use the cpu backend",
            self.name(),
            w.n,
            w.k
        )))
    }
    /// Takes a 4-bit (out, in) weight with a scale per output row and group of inputs (a
    /// W4A16 checkpoint's), whose products keep the activations in floats. Backends that
    /// cannot refuse it, naming themselves.
    fn int4_weight(&self, w: crate::w4a16::Int4Linear) -> Result<Self::Weight> {
        Err(crate::ModelError::weights(format!(
            "the {} backend does not run W4A16 4-bit weights ({}x{}); use the cpu backend",
            self.name(),
            w.n,
            w.k
        )))
    }
    /// Takes an FP8 e4m3 (out, in) weight with block scales (an FP8 checkpoint's), whose
    /// products keep the activations in floats. Backends that cannot refuse it, naming
    /// themselves.
    fn fp8_weight(&self, w: crate::fp8::Fp8Linear) -> Result<Self::Weight> {
        Err(crate::ModelError::weights(format!(
            "the {} backend does not run FP8 weights ({}x{}); use the cpu backend",
            self.name(),
            w.n,
            w.k
        )))
    }
    /// (out, in) of a weight.
    fn weight_dims(&self, w: &Self::Weight) -> (usize, usize);
    /// One weight computing all of `parts` (same input) at once, their outputs side by side in
    /// order, when the backend gains from it (one input conversion, one dispatch); `None` keeps
    /// them separate.
    fn fuse(&self, _parts: &[&Self::Weight]) -> Option<Self::Weight> {
        None
    }
    /// One weight for an MLP's gate and up (both (inter, in)) that [`Self::gate_up_silu`]
    /// takes: by default [`Self::fuse`] of the two (outputs side by side); a backend may lay
    /// it out for a product that applies the SiLU itself. `None` keeps them separate.
    fn fuse_gate_up(&self, gate: &Self::Weight, up: &Self::Weight) -> Option<Self::Weight> {
        self.fuse(&[gate, up])
    }
    /// x (rows, in) f32 -> silu(x · gateᵀ) * (x · upᵀ) (rows, inter) for a weight from
    /// [`Self::fuse_gate_up`] (`Qwen3VLTextMLP` before its down projection).
    fn gate_up_silu(&self, x: &Tensor, w: &Self::Weight, inter: usize) -> Result<Tensor> {
        self.silu_mul(&self.matmul(x, w)?, inter)
    }
    /// x (rows, in) f32 -> x · Wᵀ (rows, out) f32.
    fn matmul(&self, x: &Tensor, w: &Self::Weight) -> Result<Tensor>;
    /// Whether each row of [`Self::matmul`] by `w` comes out the same bits whatever other rows
    /// share the call. A model whose products all do runs prefill chunks and decode rows
    /// through the weights together (`TextModel::packed_step`) without changing any
    /// sequence's numbers.
    fn row_independent(&self, _w: &Self::Weight) -> bool {
        false
    }
    /// Rows `ids` of W (out, in) as (ids.len(), in) f32: the embedding lookup of a tied
    /// `lm_head`.
    fn rows_of(&self, w: &Self::Weight, ids: &[u32]) -> Result<Tensor>;

    /// y (n, 2*inter) = [gate | up] -> silu(gate) * up (n, inter) (`Qwen3VLTextMLP` on a fused
    /// gate/up weight).
    fn silu_mul(&self, y: &Tensor, inter: usize) -> Result<Tensor> {
        let gate = y.narrow(1, 0, inter)?;
        let up = y.narrow(1, inter, inter)?;
        Ok((candle_nn::ops::silu(&gate)? * up)?)
    }

    /// x (n, heads, head_dim) rotated by the tables of its n rows, cos and sin (n, head_dim/2)
    /// (`q*cos + rotate_half(q)*sin`): candle's `rope_thd` by default, the reference's form.
    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        crate::text::rope_rows(x, cos, sin)
    }

    /// x (..., dim) f32 contiguous -> x / sqrt(mean(x²) + eps) * w over the last dim, w (dim,)
    /// f32 (`Qwen3VLTextRMSNorm`): candle's `rms_norm` by default.
    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(x, w, eps)?)
    }

    /// a + b, same shape (the residual adds).
    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        Ok((a + b)?)
    }

    /// The KV cache dtype for weights stored as `weights`.
    fn kv_dtype(&self, weights: DType) -> DType;

    /// Writes the call's k, v into the cache at the positions its rows give, then returns the
    /// attention of q over the cache, (n, heads * head_dim): causal within a chunk, GQA,
    /// softmax(q·kᵀ · scale)·v.
    fn attention(&self, call: &AttnCall) -> Result<Tensor>;

    /// Runs one forward step (`f`): a backend may prepare its threads for the step's many
    /// short kernels and release them after (the CPU backend keeps its pool spinning).
    fn step<R>(&self, f: impl FnOnce() -> R) -> R {
        f()
    }
}
