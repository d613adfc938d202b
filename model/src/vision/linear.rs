//! Linear layer and LayerNorm as the ViT uses them: weights in the compute dtype, activations
//! and biases in f32 (candle's CPU bf16/f16 elementwise paths are slow and lose precision).
//! bf16 weights on a CPU with AVX512-BF16 are packed at load for [`crate::cpu::bf16_gemm`].
use crate::cpu::{bf16_dot_available, matmul_packed, PackedB};
use crate::error::{ModelError, Result};
use candle_core::{DType, Module, Tensor};
use candle_nn::VarBuilder;
use std::sync::Arc;

/// `nn.Linear(in, out, bias=True)`: y = x @ W^T + b.
#[derive(Debug, Clone)]
pub struct Linear {
    /// (out, in) in the compute dtype, unless packed.
    weight: Option<Tensor>,
    /// The bf16 weight packed for the AVX512-BF16 kernel (then `weight` is `None`).
    packed: Option<Arc<PackedB>>,
    /// (out,) f32.
    bias: Tensor,
}

impl Linear {
    /// Loads `{vb}.weight` (out, in) and `{vb}.bias` (out,).
    pub fn new(vb: VarBuilder, in_dim: usize, out_dim: usize, dtype: DType) -> Result<Self> {
        let weight = vb.to_dtype(dtype).get((out_dim, in_dim), "weight")?;
        let bias = vb.to_dtype(DType::F32).get(out_dim, "bias")?;
        Self::from_parts(weight, bias)
    }

    /// From an already shaped (out, in) weight and an (out,) bias.
    pub fn from_parts(weight: Tensor, bias: Tensor) -> Result<Self> {
        let (out_dim, _) = weight.dims2()?;
        if bias.dims() != [out_dim] {
            return Err(ModelError::Weights(format!(
                "bias shape {:?} does not match weight shape {:?}",
                bias.dims(),
                weight.dims()
            )));
        }
        let bias = bias.to_dtype(DType::F32)?;
        let weight = weight.contiguous()?;
        Ok(match PackedB::from_bf16_tensor(&weight)? {
            Some(p) if bf16_dot_available() => Linear {
                weight: None,
                packed: Some(Arc::new(p)),
                bias,
            },
            _ => Linear {
                weight: Some(weight),
                packed: None,
                bias,
            },
        })
    }

    /// (out, in), compute dtype; `None` when the weight is held packed.
    pub fn weight(&self) -> Option<&Tensor> {
        self.weight.as_ref()
    }
    /// The packed bf16 weight, when this layer runs the AVX512-BF16 kernel.
    pub fn packed(&self) -> Option<&Arc<PackedB>> {
        self.packed.as_ref()
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
        let weight = match (&self.weight, &self.packed) {
            (Some(w), _) => w,
            (None, Some(p)) => {
                let y = matmul_packed(x, p)?;
                return Ok(y.broadcast_add(&self.bias)?);
            }
            (None, None) => unreachable!("a linear holds its weight one way or the other"),
        };
        let dtype = weight.dtype();
        let y = if x.dtype() == dtype {
            x.matmul(&weight.t()?)?
        } else {
            x.to_dtype(dtype)?.matmul(&weight.t()?)?
        };
        let y = if y.dtype() == DType::F32 {
            y
        } else {
            y.to_dtype(DType::F32)?
        };
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
