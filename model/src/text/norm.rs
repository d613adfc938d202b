//! `Qwen3VLTextRMSNorm`: `x * rsqrt(mean(x^2) + eps) * w`, in f32 (the activations are f32).
use crate::error::Result;
use crate::kernels::Kernels;
use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;

#[derive(Debug, Clone)]
pub struct RmsNorm {
    /// (dim,) f32 whatever the weight storage dtype of the linear layers.
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    /// Loads `{vb prefix}.weight` of shape (dim,).
    pub fn new(dim: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        let weight = vb.set_dtype(DType::F32).get(dim, "weight")?;
        Ok(RmsNorm {
            weight,
            eps: eps as f32,
        })
    }

    /// x: (..., dim) -> (..., dim) f32, normalised over the last dim by the backend's kernel.
    pub fn forward<K: Kernels>(&self, k: &K, x: &Tensor) -> Result<Tensor> {
        let x = x.to_dtype(DType::F32)?.contiguous()?;
        k.rms_norm(&x, &self.weight, self.eps)
    }
}
