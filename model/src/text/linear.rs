//! Bias-free linear layer (`nn.Linear(bias=False)`): the weight is held the way the backend's
//! [`Kernels`] want it (packed, widened, on device); activations are f32.
use crate::error::{ModelError, Result};
use crate::kernels::Kernels;
use crate::weights::Weights;
use candle_core::quantized::QTensor;
use candle_core::{DType, Tensor};
use std::sync::Arc;

/// `y = x · Wᵀ`, W of shape (out_dim, in_dim).
#[derive(Debug, Clone)]
pub struct Linear<K: Kernels> {
    k: K,
    weight: K::Weight,
    in_dim: usize,
    out_dim: usize,
}

impl<K: Kernels> Linear<K> {
    /// Wraps a weight of shape (out_dim, in_dim) stored as f32, f16 or bf16.
    pub fn from_weight(k: &K, weight: Tensor) -> Result<Self> {
        let (out_dim, in_dim) = weight.dims2()?;
        match weight.dtype() {
            DType::F32 | DType::F16 | DType::BF16 => {}
            other => {
                return Err(ModelError::weights(format!(
                    "linear weight dtype {other:?} is not supported (f32, f16, bf16)"
                )))
            }
        }
        Ok(Linear {
            weight: k.weight(weight.contiguous()?)?,
            k: k.clone(),
            in_dim,
            out_dim,
        })
    }

    /// Loads `{prefix}.weight` of shape (out_dim, in_dim): kept int8 (W8A8), 4-bit (W4A16),
    /// FP8 or block-quantized (GGUF) when the checkpoint stores it so, else in the builder's
    /// dtype.
    pub fn load(k: &K, w: &Weights, in_dim: usize, out_dim: usize) -> Result<Self> {
        // The quantized directories' linears, checked against the model's shape.
        let shaped = |(n, kk): (usize, usize), tensor: &str| {
            if (n, kk) == (out_dim, in_dim) {
                return Ok(());
            }
            Err(ModelError::weights(format!(
                "{}.{tensor} holds [{n}, {kk}], the model expects [{out_dim}, {in_dim}]",
                w.vb().prefix()
            )))
        };
        let weight = if let Some(q) = w.fp8_linear()? {
            shaped((q.n, q.k), "weight")?;
            Some(k.fp8_weight(q)?)
        } else if let Some(q) = w.int4_linear()? {
            shaped((q.n, q.k), "weight_packed")?;
            Some(k.int4_weight(q)?)
        } else if let Some(q) = w.int8_linear()? {
            shaped((q.n, q.k), "weight")?;
            Some(k.int8_weight(q)?)
        } else {
            None
        };
        if let Some(weight) = weight {
            return Ok(Linear {
                weight,
                k: k.clone(),
                in_dim,
                out_dim,
            });
        }
        if let Some(q) = w.quantized("weight")? {
            let dims = q.shape().dims().to_vec();
            if dims != [out_dim, in_dim] {
                return Err(ModelError::weights(format!(
                    "{}.weight has shape {dims:?}, the model expects [{out_dim}, {in_dim}]",
                    w.vb().prefix()
                )));
            }
            return Self::from_quantized(k, q);
        }
        Self::from_weight(k, w.vb().get((out_dim, in_dim), "weight")?)
    }

    /// Wraps a block-quantized (out_dim, in_dim) weight, which the backend multiplies by
    /// without a float copy ([`Kernels::quantized_weight`]).
    pub fn from_quantized(k: &K, weight: Arc<QTensor>) -> Result<Self> {
        let (out_dim, in_dim) = weight.shape().dims2()?;
        Ok(Linear {
            weight: k.quantized_weight(weight)?,
            k: k.clone(),
            in_dim,
            out_dim,
        })
    }

    /// One layer computing `parts` (all of the same input) at once, their outputs side by side
    /// in order, when the backend fuses such weights ([`Kernels::fuse`]); `None` otherwise.
    pub fn fuse(parts: &[&Linear<K>]) -> Option<Linear<K>> {
        let first = parts.first()?;
        let weights: Vec<&K::Weight> = parts.iter().map(|l| &l.weight).collect();
        let weight = first.k.fuse(&weights)?;
        let (out_dim, in_dim) = first.k.weight_dims(&weight);
        Some(Linear {
            k: first.k.clone(),
            weight,
            in_dim,
            out_dim,
        })
    }

    /// The MLP's gate and up as one layer for [`Self::forward_gate_up_silu`]
    /// ([`Kernels::fuse_gate_up`]); `None` when the backend keeps them apart.
    pub fn fuse_gate_up(gate: &Linear<K>, up: &Linear<K>) -> Option<Linear<K>> {
        let weight = gate.k.fuse_gate_up(&gate.weight, &up.weight)?;
        let (out_dim, in_dim) = gate.k.weight_dims(&weight);
        Some(Linear {
            k: gate.k.clone(),
            weight,
            in_dim,
            out_dim,
        })
    }

    /// The weight as the backend holds it.
    pub fn weight(&self) -> &K::Weight {
        &self.weight
    }
    pub fn in_dim(&self) -> usize {
        self.in_dim
    }
    pub fn out_dim(&self) -> usize {
        self.out_dim
    }

    /// x: (..., in_dim) f32 -> (..., out_dim) f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.rows_through(x, self.out_dim, |x2| self.k.matmul(x2, &self.weight))
    }

    /// A [`Self::fuse_gate_up`] layer: x (..., in_dim) -> silu(gate) * up (..., inter).
    pub fn forward_gate_up_silu(&self, x: &Tensor, inter: usize) -> Result<Tensor> {
        self.rows_through(x, inter, |x2| self.k.gate_up_silu(x2, &self.weight, inter))
    }

    /// x (..., in_dim) as contiguous f32 rows through `f`, whose (rows, width) result is
    /// reshaped back to (..., width).
    fn rows_through(
        &self,
        x: &Tensor,
        width: usize,
        f: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let last = dims.last().copied().unwrap_or(0);
        if last != self.in_dim {
            return Err(ModelError::invalid(format!(
                "linear expects last dim {}, got shape {dims:?}",
                self.in_dim
            )));
        }
        let rows: usize = dims[..dims.len() - 1].iter().product();
        let x2 = x.reshape((rows, self.in_dim))?.to_dtype(DType::F32)?;
        let y = f(&x2.contiguous()?)?;
        let mut out_dims = dims;
        if let Some(l) = out_dims.last_mut() {
            *l = width;
        }
        Ok(y.reshape(out_dims)?)
    }
}
