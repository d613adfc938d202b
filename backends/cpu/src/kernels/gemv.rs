//! `y = x · Wᵀ` for a few rows of `x` (decode steps), CPU only.
//!
//! Decoding one token per sequence is a matrix-vector product per weight matrix: every weight is
//! read once and used `m` times (m = decode-batch rows, <= 16), so the time is the time to stream
//! the weights from memory. candle's generic matmul is built for large `m`, and for bf16 it
//! converts the whole weight to f32 on every call. This kernel streams the weight once in its
//! storage dtype (f32, f16 or bf16), widens 16 values at a time to f32 in registers and
//! accumulates in f32 against f32 activations. A kernel call takes a block of weight rows (4 with
//! AVX-512, 2 with AVX2) against up to 4 rows of `x`, so each loaded x vector serves several
//! weight rows and each weight vector several x rows; larger batches take the same weight block
//! again for the next 4 rows of x while it is still in L1, so memory traffic is one pass over the
//! weights whatever `m` is.
//!
//! The result of each (row of x, row of W) dot product is computed in the same order whatever
//! `m` is, so a sequence decoded alone or in a padded batch gets bit-identical projections.
use super::ptr::SendPtr;
use half::{bf16, f16};

/// A weight element the kernel can widen to f32.
pub(crate) trait WeightElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// Which vector loader the SIMD kernels use.
    const KIND: Kind;
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Kind {
    F32,
    F16,
    BF16,
}

impl WeightElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    const KIND: Kind = Kind::F32;
}
impl WeightElem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    const KIND: Kind = Kind::F16;
}
impl WeightElem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    const KIND: Kind = Kind::BF16;
}

/// Output rows handled by one parallel task: big enough that the rayon overhead is noise, small
/// enough that two cores get balanced work on the smallest matrices of the 2B model.
const ROWS_PER_TASK: usize = 64;
/// Below this many weights the whole product runs on the calling thread.
const PARALLEL_MIN_WEIGHTS: usize = 1 << 16;

/// `out[r*n + j] = sum_i x[r*k + i] * w[j*k + i]` for `r < m`, `j < n`, with the kernels of
/// `isa` (the backend's choice, see [`Isa::detect`]).
/// `x`: (m, k) row-major f32; `w`: (n, k) row-major; `out`: (m, n) row-major.
pub(crate) fn gemv<W: WeightElem>(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
    n: usize,
    out: &mut [f32],
) {
    assert!(
        x.len() >= m * k && w.len() >= n * k && out.len() >= m * n,
        "gemv: slice sizes"
    );
    let optr = SendPtr(out.as_mut_ptr());
    let rb_max = isa.weight_rows_per_block();
    let run = |j0: usize, j1: usize| {
        let mut j = j0;
        while j < j1 {
            let rb = if j1 - j >= rb_max { rb_max } else { 1 };
            let mut r = 0;
            while r < m {
                let g = (m - r).min(4);
                let mut acc = [[0f32; 4]; 4];
                dot_block(
                    isa,
                    &w[j * k..(j + rb) * k],
                    rb,
                    &x[r * k..(r + g) * k],
                    g,
                    k,
                    &mut acc,
                );
                for (wr, row) in acc.iter().take(rb).enumerate() {
                    for (xr, v) in row.iter().take(g).enumerate() {
                        // SAFETY: r+xr < m and j+wr < n; each j is written by exactly one task.
                        unsafe { *optr.get().add((r + xr) * n + j + wr) = *v };
                    }
                }
                r += g;
            }
            j += rb;
        }
    };
    if n * k < PARALLEL_MIN_WEIGHTS || rayon::current_num_threads() <= 1 {
        run(0, n);
    } else {
        use rayon::prelude::*;
        let tasks = n.div_ceil(ROWS_PER_TASK);
        (0..tasks).into_par_iter().for_each(|t| {
            let j0 = t * ROWS_PER_TASK;
            run(j0, (j0 + ROWS_PER_TASK).min(n));
        });
    }
}

/// The vector instructions the decode gemv runs with.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Isa {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    /// Weight rows one kernel call takes (they share each load of x); bounded by the vector
    /// registers: (rows x 4 accumulators) + 4 x vectors + 1 weight vector.
    fn weight_rows_per_block(self) -> usize {
        match self {
            Isa::Scalar => 1,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => 2,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => 4,
        }
    }

    /// Every instruction set this CPU runs (for tests).
    #[cfg(test)]
    fn available() -> Vec<Isa> {
        let mut all = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                all.push(Isa::Avx2);
            }
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("fma")
            {
                all.push(Isa::Avx512);
            }
        }
        all
    }

    /// Its name as logged and reported (`scalar`, `avx2`, `avx512`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => "avx512",
        }
    }

    /// The best this CPU has.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::sync::OnceLock;
            static ISA: OnceLock<Isa> = OnceLock::new();
            *ISA.get_or_init(|| {
                if is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("fma")
                {
                    Isa::Avx512
                } else if is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
                {
                    Isa::Avx2
                } else {
                    Isa::Scalar
                }
            })
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            Isa::Scalar
        }
    }
}

/// Dot products of `rb` consecutive weight rows with `g` (1..=4) consecutive rows of `x`
/// (both row stride `k`): `acc[weight row][x row]`.
#[inline]
fn dot_block<W: WeightElem>(
    isa: Isa,
    w: &[W],
    rb: usize,
    x: &[f32],
    g: usize,
    k: usize,
    acc: &mut [[f32; 4]; 4],
) {
    debug_assert!(w.len() >= rb * k && x.len() >= g * k && (1..=4).contains(&g));
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    macro_rules! dispatch {
        ($f:ident) => {
            // SAFETY: the ISA's features were checked in `Isa::detect`; w holds rb rows and x
            // holds g rows of k values.
            unsafe {
                match (rb, g) {
                    (1, 1) => x86::$f::<W, 1, 1>(wp, xp, k, acc),
                    (1, 2) => x86::$f::<W, 1, 2>(wp, xp, k, acc),
                    (1, 3) => x86::$f::<W, 1, 3>(wp, xp, k, acc),
                    (1, _) => x86::$f::<W, 1, 4>(wp, xp, k, acc),
                    (2, 1) => x86::$f::<W, 2, 1>(wp, xp, k, acc),
                    (2, 2) => x86::$f::<W, 2, 2>(wp, xp, k, acc),
                    (2, 3) => x86::$f::<W, 2, 3>(wp, xp, k, acc),
                    (2, _) => x86::$f::<W, 2, 4>(wp, xp, k, acc),
                    (_, 1) => x86::$f::<W, 4, 1>(wp, xp, k, acc),
                    (_, 2) => x86::$f::<W, 4, 2>(wp, xp, k, acc),
                    (_, 3) => x86::$f::<W, 4, 3>(wp, xp, k, acc),
                    (_, _) => x86::$f::<W, 4, 4>(wp, xp, k, acc),
                }
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => dispatch!(block_avx512),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => dispatch!(block_avx2),
        Isa::Scalar => {
            for (wr, row) in acc.iter_mut().take(rb).enumerate() {
                let wrow = &w[wr * k..(wr + 1) * k];
                for (xr, a) in row.iter_mut().take(g).enumerate() {
                    let xrow = &x[xr * k..(xr + 1) * k];
                    *a = wrow.iter().zip(xrow).map(|(w, x)| w.to_f32() * x).sum();
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Kind, WeightElem};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn load16<W: WeightElem>(p: *const W) -> __m512 {
        match W::KIND {
            Kind::F32 => _mm512_loadu_ps(p as *const f32),
            Kind::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
            Kind::BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p as *const __m256i),
            ))),
        }
    }

    /// RB weight rows against G rows of x, 16 columns per iteration: each x vector is loaded
    /// once for RB rows, each weight vector once for G rows; one accumulator per (row, x row),
    /// reduced at the end, scalar tail.
    #[target_feature(enable = "avx512f,avx512bw,fma")]
    pub(super) unsafe fn block_avx512<W: WeightElem, const RB: usize, const G: usize>(
        w: *const W,
        x: *const f32,
        k: usize,
        out: &mut [[f32; 4]; 4],
    ) {
        let mut acc = [[_mm512_setzero_ps(); G]; RB];
        let mut i = 0;
        while i + 16 <= k {
            let mut xs = [_mm512_setzero_ps(); G];
            for (g, xv) in xs.iter_mut().enumerate() {
                *xv = _mm512_loadu_ps(x.add(g * k + i));
            }
            for (r, accr) in acc.iter_mut().enumerate() {
                let wv = load16(w.add(r * k + i));
                for (a, xv) in accr.iter_mut().zip(&xs) {
                    *a = _mm512_fmadd_ps(wv, *xv, *a);
                }
            }
            i += 16;
        }
        for (r, accr) in acc.iter().enumerate() {
            for (g, a) in accr.iter().enumerate() {
                let mut s = _mm512_reduce_add_ps(*a);
                for t in i..k {
                    s += (*w.add(r * k + t)).to_f32() * *x.add(g * k + t);
                }
                out[r][g] = s;
            }
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn load8<W: WeightElem>(p: *const W) -> __m256 {
        match W::KIND {
            Kind::F32 => _mm256_loadu_ps(p as *const f32),
            Kind::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
            Kind::BF16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(p as *const __m128i),
            ))),
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn hsum256(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }

    /// As `block_avx512` with 8-lane vectors.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn block_avx2<W: WeightElem, const RB: usize, const G: usize>(
        w: *const W,
        x: *const f32,
        k: usize,
        out: &mut [[f32; 4]; 4],
    ) {
        let mut acc = [[_mm256_setzero_ps(); G]; RB];
        let mut i = 0;
        while i + 8 <= k {
            let mut xs = [_mm256_setzero_ps(); G];
            for (g, xv) in xs.iter_mut().enumerate() {
                *xv = _mm256_loadu_ps(x.add(g * k + i));
            }
            for (r, accr) in acc.iter_mut().enumerate() {
                let wv = load8(w.add(r * k + i));
                for (a, xv) in accr.iter_mut().zip(&xs) {
                    *a = _mm256_fmadd_ps(wv, *xv, *a);
                }
            }
            i += 8;
        }
        for (r, accr) in acc.iter().enumerate() {
            for (g, a) in accr.iter().enumerate() {
                let mut s = hsum256(*a);
                for t in i..k {
                    s += (*w.add(r * k + t)).to_f32() * *x.add(g * k + t);
                }
                out[r][g] = s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f64> {
        let mut out = vec![0f64; m * n];
        for r in 0..m {
            for j in 0..n {
                out[r * n + j] = (0..k)
                    .map(|i| x[r * k + i] as f64 * w[j * k + i] as f64)
                    .sum::<f64>();
            }
        }
        out
    }

    use crate::kernels::test_data::data;

    #[test]
    fn matches_f64_reference_for_every_isa_dtype_and_row_count() {
        for isa in Isa::available() {
            check_isa(isa);
        }
    }

    fn check_isa(isa: Isa) {
        // k with a tail (not a multiple of 32), n over one parallel task.
        for &(m, k, n) in &[
            (1, 37, 5),
            (3, 64, 130),
            (5, 1000, 70),
            (8, 2051, 257),
            (16, 96, 1030),
        ] {
            let x = data(m * k, 1);
            let w = data(n * k, 2);
            let want = reference(&x, m, k, &w, n);
            let check = |got: &[f32], tol: f64, what: &str| {
                for (i, (g, r)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (*g as f64 - r).abs() <= tol * (1.0 + r.abs()),
                        "{isa:?} {what} m={m} k={k} n={n} at {i}: {g} vs {r}"
                    );
                }
            };
            let mut out = vec![0f32; m * n];
            gemv(isa, &x, m, k, &w, n, &mut out);
            check(&out, 5e-5, "f32");
            // Half-precision weights: compare with the reference on the rounded weights.
            let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
            let wr: Vec<f32> = wh.iter().map(|v| v.to_f32()).collect();
            let want_h = reference(&x, m, k, &wr, n);
            gemv(isa, &x, m, k, &wh, n, &mut out);
            for (g, r) in out.iter().zip(&want_h) {
                assert!(
                    (*g as f64 - r).abs() <= 5e-5 * (1.0 + r.abs()),
                    "{isa:?} f16 {g} vs {r}"
                );
            }
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wr: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
            let want_b = reference(&x, m, k, &wr, n);
            gemv(isa, &x, m, k, &wb, n, &mut out);
            for (g, r) in out.iter().zip(&want_b) {
                assert!(
                    (*g as f64 - r).abs() <= 5e-5 * (1.0 + r.abs()),
                    "{isa:?} bf16 {g} vs {r}"
                );
            }
        }
    }

    #[test]
    fn a_row_gets_the_same_bits_whatever_the_batch() {
        let (k, n) = (300, 40);
        let x = data(7 * k, 3);
        let w = data(n * k, 4);
        let mut all = vec![0f32; 7 * n];
        gemv(Isa::detect(), &x, 7, k, &w, n, &mut all);
        for r in 0..7 {
            let mut one = vec![0f32; n];
            gemv(Isa::detect(), &x[r * k..(r + 1) * k], 1, k, &w, n, &mut one);
            assert_eq!(&all[r * n..(r + 1) * n], &one[..], "row {r}");
        }
    }
}
