//! The CPU kernels as candle ops on contiguous CPU tensors: the bf16 GEMM for packed weights
//! (and its gate/up form with the SiLU applied), the decode gemv and the widening prefill
//! matmul for dense ones.
use super::gemv::{gemv, Isa};
use super::packed::PackedB;
use super::tiled::matmul_widening;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};
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
        if self.0.gate_up() {
            candle_core::bail!(
                "{}: an interleaved gate/up weight multiplies through gate_up_silu",
                self.name()
            );
        }
        let x = match (s, l.contiguous_offsets()) {
            (CpuStorage::F32(x), Some((a, b))) => &x[a..b],
            _ => candle_core::bail!("{}: lhs must be contiguous f32", self.name()),
        };
        if k == 0 {
            return Ok((CpuStorage::F32(vec![0f32; m * n]), Shape::from((m, n))));
        }
        // Not zeroed first: the product overwrites every value (in a 256-token prefill's
        // profile the zeroing, `memset`, fell from 6.1% to 1.55% of the samples).
        let mut out: Vec<f32> = Vec::with_capacity(m * n);
        // SAFETY: x holds (m, k), out has room for (m, n); both row-major and disjoint. With
        // `accumulate` false and k > 0 the product writes each of C's m x n values before it
        // reads any (`matches_rounded_reference_on_all_edges` checks that on every edge), so
        // the vector is whole when its length is set.
        unsafe {
            crate::kernels::bf16_gemm::gemm(
                m,
                k,
                x.as_ptr(),
                k,
                self.0.view(),
                out.as_mut_ptr(),
                n,
                false,
                true,
            );
            out.set_len(m * n);
        }
        Ok((CpuStorage::F32(out), Shape::from((m, n))))
    }
}

/// x (m, k) -> silu(x · gateᵀ) * (x · upᵀ) (m, inter) for an interleaved gate/up packing
/// ([`PackedB::interleave_gate_up`] of two (inter, k) weights).
pub fn gate_up_silu(x: &Tensor, w: &Arc<PackedB>, inter: usize) -> candle_core::Result<Tensor> {
    x.to_dtype(DType::F32)?
        .contiguous()?
        .apply_op1_no_bwd(&GateUpSilu(w.clone(), inter))
}

/// candle op: x (m, k) f32 contiguous through an interleaved gate/up packing -> (m, inter).
struct GateUpSilu(Arc<PackedB>, usize);

impl CustomOp1 for GateUpSilu {
    fn name(&self) -> &'static str {
        "packed-bf16-gate-up-silu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        use super::packed::NR;
        let (m, k) = l.shape().dims2()?;
        let (w, inter) = (&self.0, self.1);
        if !w.gate_up() || w.n() != 2 * inter || k != w.k() || k == 0 {
            candle_core::bail!(
                "{}: x (_, {k}) through a weight of ({}, {}) for {inter} outputs",
                self.name(),
                w.n(),
                w.k()
            );
        }
        let x = match (s, l.contiguous_offsets()) {
            (CpuStorage::F32(x), Some((a, b))) => &x[a..b],
            _ => candle_core::bail!("{}: lhs must be contiguous f32", self.name()),
        };
        let mut out: Vec<f32> = Vec::with_capacity(m * inter);
        if w.amx() {
            // The tiles' sums go through memory: the plain product, then the SiLU per half.
            let mut y: Vec<f32> = Vec::with_capacity(m * 2 * inter);
            // SAFETY: as in `PackedMatmul`: every value of y is written before its length is
            // set.
            unsafe {
                super::bf16_gemm::gemm(
                    m,
                    k,
                    x.as_ptr(),
                    k,
                    w.view(),
                    y.as_mut_ptr(),
                    2 * inter,
                    false,
                    true,
                );
                y.set_len(m * 2 * inter);
            }
            out.resize(m * inter, 0.0);
            let half = NR / 2;
            for (o, y) in out.chunks_exact_mut(half).zip(y.chunks_exact(NR)) {
                super::softmax::silu_mul_row(&y[..half], &y[half..], o);
            }
        } else {
            // SAFETY: x holds (m, k), out has room for (m, inter); the product writes every
            // value (16 per panel and row, inter = 16 x panels) before the length is set.
            unsafe {
                super::bf16_gemm::gemm_gate_up_silu(
                    m,
                    k,
                    x.as_ptr(),
                    k,
                    w.view(),
                    out.as_mut_ptr(),
                    inter,
                    true,
                );
                out.set_len(m * inter);
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((m, inter))))
    }
}

/// candle op: lhs (m, k) f32 contiguous, rhs (n, k) weight contiguous -> (m, n) f32.
pub(crate) struct SmallRowsMatmul(pub(crate) Isa);

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
        let isa = self.0;
        match s2 {
            CpuStorage::F32(w) => gemv(isa, x, m, k, &w[a..b], n, &mut out),
            CpuStorage::F16(w) => gemv(isa, x, m, k, &w[a..b], n, &mut out),
            CpuStorage::BF16(w) => gemv(isa, x, m, k, &w[a..b], n, &mut out),
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
pub(crate) struct WideningMatmul;

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
