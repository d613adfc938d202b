//! Linear layer and LayerNorm as the ViT uses them: weights held as the backend's [`Kernels`]
//! want them (from the compute dtype), activations and biases in f32.
use crate::error::{ModelError, Result};
use crate::kernels::Kernels;
use candle_core::{DType, Module, Tensor};
use candle_nn::VarBuilder;

/// `nn.Linear(in, out, bias=True)`: y = x @ W^T + b.
#[derive(Debug, Clone)]
pub struct Linear<K: Kernels> {
    k: K,
    weight: K::Weight,
    /// (out,) f32.
    bias: Tensor,
}

impl<K: Kernels> Linear<K> {
    /// Loads `{vb}.weight` (out, in) in `dtype` and `{vb}.bias` (out,) in f32.
    pub fn new(k: &K, vb: VarBuilder, in_dim: usize, out_dim: usize, dtype: DType) -> Result<Self> {
        let weight = vb.to_dtype(dtype).get((out_dim, in_dim), "weight")?;
        let bias = vb.to_dtype(DType::F32).get(out_dim, "bias")?;
        Self::from_parts(k, weight, bias)
    }

    /// From an already shaped (out, in) weight and an (out,) bias.
    pub fn from_parts(k: &K, weight: Tensor, bias: Tensor) -> Result<Self> {
        let (out_dim, _) = weight.dims2()?;
        if bias.dims() != [out_dim] {
            return Err(ModelError::weights(format!(
                "bias shape {:?} does not match weight shape {:?}",
                bias.dims(),
                weight.dims()
            )));
        }
        Ok(Linear {
            weight: k.weight(weight.contiguous()?)?,
            k: k.clone(),
            bias: bias.to_dtype(DType::F32)?,
        })
    }

    /// The weight as the backend holds it.
    pub fn weight(&self) -> &K::Weight {
        &self.weight
    }
    /// (out,), f32.
    pub fn bias(&self) -> &Tensor {
        &self.bias
    }
    pub fn out_dim(&self) -> usize {
        self.bias.dims()[0]
    }

    /// (N, in) f32 -> (N, out) f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self
            .k
            .matmul(&x.to_dtype(DType::F32)?.contiguous()?, &self.weight)?;
        Ok(y.broadcast_add(&self.bias)?)
    }
}

/// `nn.LayerNorm(dim, eps=1e-6)` with weight and bias, in f32.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    /// (dim,) f32.
    weight: Tensor,
    /// (dim,) f32.
    bias: Tensor,
    eps: f64,
    inner: candle_nn::LayerNorm,
}

/// The ViT's LayerNorm epsilon (`nn.LayerNorm(..., eps=1e-6)` in modeling_qwen3_vl.py).
pub const LN_EPS: f64 = 1e-6;

impl LayerNorm {
    /// Loads `{vb}.weight` and `{vb}.bias`, both (dim,).
    pub fn new(vb: VarBuilder, dim: usize) -> Result<Self> {
        let vb = vb.to_dtype(DType::F32);
        let weight = vb.get(dim, "weight")?;
        let bias = vb.get(dim, "bias")?;
        let inner = candle_nn::LayerNorm::new(weight.clone(), bias.clone(), LN_EPS);
        Ok(LayerNorm {
            weight,
            bias,
            eps: LN_EPS,
            inner,
        })
    }
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
    pub fn bias(&self) -> &Tensor {
        &self.bias
    }
    pub fn eps(&self) -> f64 {
        self.eps
    }
    /// (..., dim) f32 -> same shape.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.contiguous()?;
        Ok(self.inner.forward(&x)?)
    }
}
