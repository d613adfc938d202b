//! Bias-free linear layer whose weight storage dtype is a choice (f32, f16 or bf16) while the
//! activations stay f32.
//!
//! On a CPU with AVX512-BF16, bf16 weights are packed at load for [`crate::cpu::bf16_gemm`] and
//! every row count (decode and prefill) goes through it: activations rounded to bf16 on entry,
//! f32 accumulation — the reference's bf16 math, at twice the f32 FMA rate and, for decode, at
//! memory speed. Otherwise, on CPU, a few rows (decode) go through [`super::gemv`], which
//! streams the weight once in its storage dtype with f32 activations; many rows (prefill) go
//! through candle's f32 matmul for f32 weights, and through [`super::tiled`] (widening a tile at
//! a time, then `gemm`) for half-precision ones. Other devices use candle's matmul throughout,
//! widening half-precision weights per call.
use super::gemv::{gemv, WeightElem};
use super::tiled::matmul_widening;
use crate::cpu::{bf16_dot_available, matmul_packed, PackedB};
use crate::error::{ModelError, Result};
use candle_core::{CpuStorage, CustomOp2, DType, Device, Layout, Shape, Tensor};
use candle_nn::VarBuilder;
use std::sync::Arc;

/// Rows up to which the CPU path streams the weights with the decode kernel.
pub const SMALL_ROWS: usize = 16;

/// `y = x · Wᵀ`, W of shape (out_dim, in_dim).
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Weight,
    in_dim: usize,
    out_dim: usize,
}

/// How the weight is held.
#[derive(Debug, Clone)]
enum Weight {
    /// (out_dim, in_dim) in the storage dtype.
    Tensor(Tensor),
    /// bf16, packed for the AVX512-BF16 kernel (B = Wᵀ: n = out_dim, k = in_dim).
    Packed(Arc<PackedB>),
}

impl Linear {
    /// Wraps a weight of shape (out_dim, in_dim) stored as f32, f16 or bf16.
    pub fn from_weight(weight: Tensor) -> Result<Self> {
        let (out_dim, in_dim) = weight.dims2()?;
        match weight.dtype() {
            DType::F32 | DType::F16 | DType::BF16 => {}
            other => {
                return Err(ModelError::Weights(format!(
                    "linear weight dtype {other:?} is not supported (f32, f16, bf16)"
                )))
            }
        }
        let weight = weight.contiguous()?;
        let weight = match PackedB::from_bf16_tensor(&weight)? {
            Some(p) if bf16_dot_available() => Weight::Packed(Arc::new(p)),
            _ => Weight::Tensor(weight),
        };
        Ok(Linear {
            weight,
            in_dim,
            out_dim,
        })
    }

    /// Loads `{vb prefix}.weight` of shape (out_dim, in_dim) in the builder's dtype.
    pub fn load(vb: &VarBuilder, in_dim: usize, out_dim: usize) -> Result<Self> {
        Self::from_weight(vb.get((out_dim, in_dim), "weight")?)
    }

    /// One layer computing `parts` (all of the same input) at once, their outputs side by side
    /// in order, when all are packed with panel-aligned widths (q/k/v, gate/up of the 2B model);
    /// `None` otherwise. One call then converts the input once and dispatches once.
    pub fn fuse(parts: &[&Linear]) -> Option<Linear> {
        let packed: Vec<&PackedB> = parts
            .iter()
            .map(|l| l.packed().map(|p| p.as_ref()))
            .collect::<Option<_>>()?;
        let fused = PackedB::concat_n(&packed)?;
        Some(Linear {
            in_dim: fused.k(),
            out_dim: fused.n(),
            weight: Weight::Packed(Arc::new(fused)),
        })
    }

    /// The packed bf16 weight, when this layer runs the AVX512-BF16 kernel.
    pub fn packed(&self) -> Option<&Arc<PackedB>> {
        match &self.weight {
            Weight::Packed(p) => Some(p),
            Weight::Tensor(_) => None,
        }
    }
    pub fn in_dim(&self) -> usize {
        self.in_dim
    }
    pub fn out_dim(&self) -> usize {
        self.out_dim
    }

    /// x: (..., in_dim) f32 -> (..., out_dim) f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let last = dims.last().copied().unwrap_or(0);
        if last != self.in_dim {
            return Err(ModelError::invalid(format!(
                "linear expects last dim {}, got shape {dims:?}",
                self.in_dim
            )));
        }
        let rows: usize = dims[..dims.len() - 1].iter().product();
        let x2 = x.reshape((rows, self.in_dim))?;
        let cpu = matches!(x.device(), Device::Cpu);
        let y = match &self.weight {
            Weight::Packed(p) => matmul_packed(&x2, p)?,
            Weight::Tensor(w) if cpu && rows <= SMALL_ROWS => x2
                .to_dtype(DType::F32)?
                .contiguous()?
                .apply_op2_no_bwd(w, &SmallRowsMatmul)?,
            Weight::Tensor(w) if cpu && w.dtype() != DType::F32 => x2
                .to_dtype(DType::F32)?
                .contiguous()?
                .apply_op2_no_bwd(w, &WideningMatmul)?,
            Weight::Tensor(w) => {
                let w = if w.dtype() == DType::F32 {
                    w.clone()
                } else {
                    w.to_dtype(DType::F32)?
                };
                x2.to_dtype(DType::F32)?.matmul(&w.t()?)?
            }
        };
        let mut out_dims = dims;
        if let Some(l) = out_dims.last_mut() {
            *l = self.out_dim;
        }
        Ok(y.reshape(out_dims)?)
    }
}

/// candle op: lhs (m, k) f32 contiguous, rhs (n, k) weight contiguous -> (m, n) f32.
struct SmallRowsMatmul;

impl CustomOp2 for SmallRowsMatmul {
    fn name(&self) -> &'static str {
        "small-rows-matmul"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, m, k, n, (a, b)) = operands(self.name(), s1, l1, l2)?;
        let mut out = vec![0f32; m * n];
        fn run<W: WeightElem>(x: &[f32], m: usize, k: usize, w: &[W], n: usize, out: &mut [f32]) {
            gemv(x, m, k, w, n, out)
        }
        match s2 {
            CpuStorage::F32(w) => run(x, m, k, &w[a..b], n, &mut out),
            CpuStorage::F16(w) => run(x, m, k, &w[a..b], n, &mut out),
            CpuStorage::BF16(w) => run(x, m, k, &w[a..b], n, &mut out),
            _ => candle_core::bail!("small-rows-matmul: weight must be f32, f16 or bf16"),
        }
        Ok((CpuStorage::F32(out), Shape::from((m, n))))
    }
}

/// The operands of a (m, k) x (n, k)^T matmul: the contiguous f32 lhs, m, k, n and the
/// contiguous range of the weight's storage.
type Operands<'a> = (&'a [f32], usize, usize, usize, (usize, usize));

fn operands<'a>(
    op: &str,
    s1: &'a CpuStorage,
    l1: &Layout,
    l2: &Layout,
) -> candle_core::Result<Operands<'a>> {
    let (m, k) = l1.shape().dims2()?;
    let (n, k2) = l2.shape().dims2()?;
    if k != k2 {
        candle_core::bail!("{op}: inner dims {k} vs {k2}");
    }
    let x = match (s1, l1.contiguous_offsets()) {
        (CpuStorage::F32(x), Some((a, b))) => &x[a..b],
        _ => candle_core::bail!("{op}: lhs must be contiguous f32"),
    };
    let Some(range) = l2.contiguous_offsets() else {
        candle_core::bail!("{op}: weight must be contiguous")
    };
    Ok((x, m, k, n, range))
}

/// candle op: lhs (m, k) f32 contiguous, rhs (n, k) f16/bf16 contiguous -> (m, n) f32.
struct WideningMatmul;

impl CustomOp2 for WideningMatmul {
    fn name(&self) -> &'static str {
        "widening-matmul"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, m, k, n, (a, b)) = operands(self.name(), s1, l1, l2)?;
        let mut out = vec![0f32; m * n];
        match s2 {
            CpuStorage::F16(w) => matmul_widening(x, m, k, &w[a..b], n, &mut out),
            CpuStorage::BF16(w) => matmul_widening(x, m, k, &w[a..b], n, &mut out),
            _ => candle_core::bail!("widening-matmul: weight must be f16 or bf16"),
        }
        Ok((CpuStorage::F32(out), Shape::from((m, n))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_large_row_paths_agree_for_each_storage_dtype() -> Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (70, 96), &dev)?;
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let lin = Linear::from_weight(w.to_dtype(dtype)?)?;
            let x = Tensor::randn(0f32, 1.0, (2, 20, 96), &dev)?;
            let big = lin.forward(&x)?; // 40 rows: matmul path
            let small = lin.forward(&x.narrow(1, 0, 3)?)?; // 6 rows: kernel path
            let diff = (big.narrow(1, 0, 3)? - &small)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert!(diff < 1e-4, "{dtype:?}: {diff}");
            assert_eq!(small.dims(), &[2, 3, 70]);
        }
        Ok(())
    }
}
