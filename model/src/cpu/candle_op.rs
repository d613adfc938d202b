//! The bf16 kernel as a candle op, for layers that hold a [`PackedB`] weight.
use super::packed::PackedB;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use std::sync::Arc;

/// x (m, k) · packed Wᵀ -> (m, n) f32 (x converted to f32 first if it is not).
pub fn matmul_packed(x: &Tensor, w: &Arc<PackedB>) -> candle_core::Result<Tensor> {
    x.to_dtype(DType::F32)?
        .contiguous()?
        .apply_op1_no_bwd(&PackedMatmul(w.clone()))
}

/// candle op: x (m, k) f32 contiguous · packed bf16 Wᵀ -> (m, n) f32.
struct PackedMatmul(Arc<PackedB>);

impl CustomOp1 for PackedMatmul {
    fn name(&self) -> &'static str {
        "packed-bf16-matmul"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, k) = l.shape().dims2()?;
        let (n, k2) = (self.0.n(), self.0.k());
        if k != k2 {
            candle_core::bail!("{}: inner dims {k} vs {k2}", self.name());
        }
        let x = match (s, l.contiguous_offsets()) {
            (CpuStorage::F32(x), Some((a, b))) => &x[a..b],
            _ => candle_core::bail!("{}: lhs must be contiguous f32", self.name()),
        };
        let mut out = vec![0f32; m * n];
        // SAFETY: x holds (m, k), out (m, n); both row-major and disjoint.
        unsafe {
            crate::cpu::bf16_gemm::gemm(
                m,
                k,
                x.as_ptr(),
                k,
                self.0.view(),
                out.as_mut_ptr(),
                n,
                false,
                true,
            )
        };
        Ok((CpuStorage::F32(out), Shape::from((m, n))))
    }
}
