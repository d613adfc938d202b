//! f32 kernels on slices for the CPU bucket path: GELU (tanh and erf forms), LayerNorm, bias,
//! and a gemm wrapper. Elementwise loops are branch-free so that LLVM vectorises them;
//! on x86-64 they are compiled again with AVX-512 and with AVX2+FMA and picked at run time.
//!
//! `exp_approx` and the online softmax live in `crate::kernels::softmax` (the decoder uses them
//! too) and are re-exported here.
//!
//! Accuracy: `exp` ~2e-7 relative (Cephes expf polynomial), `erf` ~1.5e-7 absolute
//! (Abramowitz-Stegun 7.1.26); far inside the 1e-5 the bucketed path is held to.

pub use crate::kernels::softmax::{exp_approx, online_softmax_tile};
use multiversion::multiversion;

/// `gelu_pytorch_tanh`: 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), written as
/// the identical x * sigmoid(2u), which is stable at both tails.
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    const K: f32 = 0.797_884_6; // sqrt(2/pi)
    let u = K * (x + 0.044_715 * x * x * x);
    x / (1.0 + exp_approx(-2.0 * u))
}

/// erf(z), Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7).
#[inline(always)]
pub fn erf_approx(z: f32) -> f32 {
    let a = z.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = t
        * (0.254_829_6
            + t * (-0.284_496_74 + t * (1.421_413_7 + t * (-1.453_152_1 + t * 1.061_405_4))));
    let e = 1.0 - poly * exp_approx(-a * a);
    e.copysign(z)
}

/// `nn.GELU()` (exact, erf form): 0.5 x (1 + erf(x / sqrt 2)).
#[inline(always)]
pub fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + erf_approx(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// x[i] = gelu_tanh(x[i] + bias[i % bias.len()]).
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512dq+avx512vl+avx2+fma",
    "x86_64+avx2+fma"
))]
pub fn bias_gelu_tanh(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v = gelu_tanh(*v + *b);
        }
    }
}

/// x[i] = gelu_erf(x[i] + bias[i % bias.len()]).
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512dq+avx512vl+avx2+fma",
    "x86_64+avx2+fma"
))]
pub fn bias_gelu_erf(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v = gelu_erf(*v + *b);
        }
    }
}

/// out = LayerNorm(x) * w + b over one row (two-pass mean and variance in f32, eps inside the
/// square root, as torch's layer_norm).
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512dq+avx512vl+avx2+fma",
    "x86_64+avx2+fma"
))]
pub fn layer_norm_row(x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len() as f32;
    let mut s = [0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            s[i] += c[i];
        }
    }
    let mut sum: f32 = s.iter().sum();
    sum += chunks.remainder().iter().sum::<f32>();
    let mean = sum / n;
    let mut s = [0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            let d = c[i] - mean;
            s[i] += d * d;
        }
    }
    let mut var: f32 = s.iter().sum();
    var += chunks
        .remainder()
        .iter()
        .map(|v| (v - mean) * (v - mean))
        .sum::<f32>();
    let rstd = 1.0 / (var / n + eps).sqrt();
    for (((o, &v), &wi), &bi) in out.iter_mut().zip(x).zip(w).zip(b) {
        *o = (v - mean) * rstd * wi + bi;
    }
}

/// x[i] += bias[i % bias.len()].
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512dq+avx512vl+avx2+fma",
    "x86_64+avx2+fma"
))]
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += *b;
        }
    }
}

/// Row-major matrix view: `ptr[r * row_stride + c]`.
#[derive(Clone, Copy)]
pub struct Mat {
    pub ptr: *const f32,
    pub row_stride: usize,
}

/// dst (m x n, row stride `dst_rs`) = [dst +] lhs (m x k) . rhs where rhs is given by
/// `rhs_ptr`, `rhs_rs` (stride between its k rows) and `rhs_cs` (stride between its n columns).
///
/// # Safety
/// All pointers must be valid for the extents the strides describe, and `dst` must not alias
/// the inputs.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_f32(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    accumulate: bool,
    lhs: Mat,
    rhs_ptr: *const f32,
    rhs_rs: usize,
    rhs_cs: usize,
    threads: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_rs as isize,
        accumulate,
        lhs.ptr,
        1,
        lhs.row_stride as isize,
        rhs_ptr,
        rhs_cs as isize,
        rhs_rs as isize,
        if accumulate { 1.0 } else { 0.0 },
        1.0,
        false,
        false,
        false,
        parallelism,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate() {
        let mut worst = 0f32;
        let mut x = -80.0f32;
        while x < 80.0 {
            let rel = ((exp_approx(x) as f64 - (x as f64).exp()) / (x as f64).exp()).abs() as f32;
            worst = worst.max(rel);
            x += 0.0137;
        }
        assert!(worst < 5e-7, "exp rel err {worst}");
        assert!(exp_approx(-1000.0) < 1e-37);
    }

    #[test]
    fn gelus_match_reference_formulas() {
        for i in -2000..2000 {
            let x = i as f64 * 0.005;
            let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            let tanh_ref = 0.5 * x * (1.0 + u.tanh());
            assert!(
                (gelu_tanh(x as f32) as f64 - tanh_ref).abs() < 2e-6,
                "tanh gelu at {x}"
            );
            // erf via a high-precision series check at a few points is enough: A&S bound.
            let erf_ref = libm_erf(x / std::f64::consts::SQRT_2);
            let g = 0.5 * x * (1.0 + erf_ref);
            assert!(
                (gelu_erf(x as f32) as f64 - g).abs() < 2e-6,
                "erf gelu at {x}"
            );
        }
    }

    /// erf by its Maclaurin series (|z| <= 2) or continued fraction tail, f64.
    fn libm_erf(z: f64) -> f64 {
        let a = z.abs();
        let r = if a < 3.0 {
            let mut sum = 0.0f64;
            let mut term = a;
            let mut n = 0;
            while term.abs() > 1e-17 * sum.abs().max(1e-300) || n < 5 {
                sum += term / (2 * n + 1) as f64;
                n += 1;
                term *= -a * a / n as f64;
                if n > 200 {
                    break;
                }
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        } else {
            // erfc continued fraction (Lentz), enough for a >= 3.
            let mut f = a;
            for k in (1..60).rev() {
                f = a + (k as f64 / 2.0) / f;
            }
            1.0 - (-a * a).exp() / (f * std::f64::consts::PI.sqrt())
        };
        r.copysign(z)
    }

    fn softmax_f64(x: &[f32]) -> Vec<f64> {
        let max = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let e: Vec<f64> = x.iter().map(|&v| (v as f64 - max).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|v| v / s).collect()
    }

    #[test]
    fn online_softmax_equals_softmax() {
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin() * 7.0).collect();
        let full = softmax_f64(&x);
        // Tiles of 300: accumulate sum p * value with rescaling, as the attention does.
        let vals: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.11).cos()).collect();
        let want: f32 = full.iter().zip(&vals).map(|(p, v)| *p as f32 * v).sum();
        let (mut m, mut l, mut acc) = (f32::NEG_INFINITY, 0f32, 0f32);
        for (xs, vs) in x.chunks(300).zip(vals.chunks(300)) {
            let mut t = xs.to_vec();
            let mut corr = 0.0;
            online_softmax_tile(&mut t, &mut m, &mut l, &mut corr);
            acc = acc * corr + t.iter().zip(vs).map(|(p, v)| p * v).sum::<f32>();
        }
        assert!((acc / l - want).abs() < 1e-5, "{} vs {want}", acc / l);
    }

    #[test]
    fn softmax_and_layer_norm() {
        let mut x: Vec<f32> = (0..37).map(|i| (i as f32 * 0.7).sin() * 5.0).collect();
        let want = softmax_f64(&x);
        let (mut m, mut l, mut corr) = (f32::NEG_INFINITY, 0f32, 0f32);
        online_softmax_tile(&mut x, &mut m, &mut l, &mut corr);
        for (a, b) in x.iter().zip(&want) {
            assert!((*a as f64 / l as f64 - b).abs() < 1e-6);
        }
        let v: Vec<f32> = (0..19).map(|i| i as f32 * 0.3 - 2.0).collect();
        let w = vec![2.0f32; 19];
        let b = vec![0.5f32; 19];
        let mut out = vec![0f32; 19];
        layer_norm_row(&v, &w, &b, 1e-6, &mut out);
        let mean: f32 = out.iter().sum::<f32>() / 19.0;
        assert!((mean - 0.5).abs() < 1e-5);
    }
}
