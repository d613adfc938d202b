//! f32 kernels on slices for the CPU bucket path: exp, GELU (tanh and erf forms), LayerNorm,
//! softmax, and a gemm wrapper. Elementwise loops are branch-free so that LLVM vectorises them;
//! on x86-64 they are compiled again with AVX-512 and with AVX2+FMA and picked at run time.
//!
//! Accuracy: `exp` ~2e-7 relative (Cephes expf polynomial), `erf` ~1.5e-7 absolute
//! (Abramowitz-Stegun 7.1.26); far inside the 1e-5 the bucketed path is held to.

/// exp(x) for x in [-87.3, 88.7] (clamped outside), Cephes' expf polynomial.
#[inline(always)]
pub fn exp_approx(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.3, 88.7);
    let fx = (x * LOG2E + 0.5).floor();
    let r = x - fx * C1 - fx * C2;
    let r2 = r * r;
    let mut y = 1.987_569_1e-4f32;
    y = y * r + 1.398_199_9e-3;
    y = y * r + 8.333_452e-3;
    y = y * r + 4.166_579_6e-2;
    y = y * r + 1.666_666_5e-1;
    y = y * r + 0.5;
    let y = y * r2 + r + 1.0;
    // 2^fx through the exponent bits; fx is in [-126, 128] after the clamp.
    let scale = f32::from_bits((((fx as i32).wrapping_add(127)).clamp(1, 254) as u32) << 23);
    y * scale
}

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

macro_rules! multiversion {
    ($(#[$m:meta])* pub fn $name:ident($($arg:ident: $ty:ty),*) $body:block) => {
        $(#[$m])*
        pub fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
                unsafe fn fast512($($arg: $ty),*) $body
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512dq")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                {
                    // SAFETY: the features were detected on this CPU.
                    return unsafe { fast512($($arg),*) };
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn fast($($arg: $ty),*) $body
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    // SAFETY: the features were detected on this CPU.
                    return unsafe { fast($($arg),*) };
                }
            }
            fn portable($($arg: $ty),*) $body
            portable($($arg),*)
        }
    };
}

multiversion! {
    /// x[i] = gelu_tanh(x[i] + bias[i % bias.len()]).
    pub fn bias_gelu_tanh(x: &mut [f32], bias: &[f32]) {
        for row in x.chunks_exact_mut(bias.len()) {
            for (v, b) in row.iter_mut().zip(bias) {
                *v = gelu_tanh(*v + *b);
            }
        }
    }
}

multiversion! {
    /// x[i] = gelu_erf(x[i] + bias[i % bias.len()]).
    pub fn bias_gelu_erf(x: &mut [f32], bias: &[f32]) {
        for row in x.chunks_exact_mut(bias.len()) {
            for (v, b) in row.iter_mut().zip(bias) {
                *v = gelu_erf(*v + *b);
            }
        }
    }
}

multiversion! {
    /// In place over one row of scores: softmax(x). (The engine uses the tiled form below.)
    #[allow(dead_code)]
    pub fn softmax_row(x: &mut [f32]) {
        let mut m = [f32::NEG_INFINITY; 8];
        let mut chunks = x.chunks_exact(8);
        for c in &mut chunks {
            for i in 0..8 {
                m[i] = m[i].max(c[i]);
            }
        }
        let mut max = m.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        for &v in chunks.remainder() {
            max = max.max(v);
        }
        let mut s = [0f32; 8];
        let mut chunks = x.chunks_exact_mut(8);
        for c in &mut chunks {
            for i in 0..8 {
                c[i] = exp_approx(c[i] - max);
                s[i] += c[i];
            }
        }
        let mut sum: f32 = s.iter().sum();
        for v in chunks.into_remainder() {
            *v = exp_approx(*v - max);
            sum += *v;
        }
        let inv = 1.0 / sum;
        for v in x.iter_mut() {
            *v *= inv;
        }
    }
}

multiversion! {
    /// One key tile of an online softmax row (flash-attention style): with the row's running max
    /// `m` and sum `l` over earlier tiles, replaces `x` by exp(x - m_new), updates `m` and `l`,
    /// and sets `corr` = exp(m_old - m_new), the factor earlier partial outputs must be scaled
    /// by. Start a row with m = -inf, l = 0 (corr is then 0).
    pub fn online_softmax_tile_auto(x: &mut [f32], m: &mut f32, l: &mut f32, corr: &mut f32) {
        let mut mx = [f32::NEG_INFINITY; 8];
        let mut chunks = x.chunks_exact(8);
        for c in &mut chunks {
            for i in 0..8 {
                mx[i] = mx[i].max(c[i]);
            }
        }
        let mut tile_max = mx.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        for &v in chunks.remainder() {
            tile_max = tile_max.max(v);
        }
        let m_new = m.max(tile_max);
        let mut s = [0f32; 8];
        let mut chunks = x.chunks_exact_mut(8);
        for c in &mut chunks {
            for i in 0..8 {
                c[i] = exp_approx(c[i] - m_new);
                s[i] += c[i];
            }
        }
        let mut sum: f32 = s.iter().sum();
        for v in chunks.into_remainder() {
            *v = exp_approx(*v - m_new);
            sum += *v;
        }
        *corr = if *m == f32::NEG_INFINITY { 0.0 } else { exp_approx(*m - m_new) };
        *l = *l * *corr + sum;
        *m = m_new;
    }
}

/// [`online_softmax_tile_auto`], with AVX-512 intrinsics where the CPU has them (the
/// compiler's vectorisation of the portable form runs ~4 cycles a score; this ~1).
pub fn online_softmax_tile(x: &mut [f32], m: &mut f32, l: &mut f32, corr: &mut f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the feature was detected on this CPU.
        return unsafe { avx512::online_softmax_tile(x, m, l, corr) };
    }
    online_softmax_tile_auto(x, m, l, corr)
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// [`super::exp_approx`] on 16 lanes (same clamp and polynomial; 2^fx by `vscalefps`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn exp16(x: __m512) -> __m512 {
        let x = _mm512_min_ps(
            _mm512_max_ps(x, _mm512_set1_ps(-87.3)),
            _mm512_set1_ps(88.7),
        );
        let fx =
            _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(_mm512_fmadd_ps(
                x,
                _mm512_set1_ps(std::f32::consts::LOG2_E),
                _mm512_set1_ps(0.5),
            ));
        let r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.121_944_4e-4), r);
        let r2 = _mm512_mul_ps(r, r);
        let mut y = _mm512_set1_ps(1.987_569_1e-4);
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.398_199_9e-3));
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.333_452e-3));
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.166_579_6e-2));
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.666_666_5e-1));
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5));
        let y = _mm512_add_ps(_mm512_fmadd_ps(y, r2, r), _mm512_set1_ps(1.0));
        _mm512_scalef_ps(y, fx)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn online_softmax_tile(
        x: &mut [f32],
        m: &mut f32,
        l: &mut f32,
        corr: &mut f32,
    ) {
        let n = x.len();
        let p = x.as_mut_ptr();
        let tail: __mmask16 = ((1u32 << (n % 16)) - 1) as u16;
        let full = n / 16 * 16;
        let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i < full {
            mx = _mm512_max_ps(mx, _mm512_loadu_ps(p.add(i)));
            i += 16;
        }
        if tail != 0 {
            let v = _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), tail, p.add(full));
            mx = _mm512_max_ps(mx, v);
        }
        let m_new = m.max(_mm512_reduce_max_ps(mx));
        let mv = _mm512_set1_ps(m_new);
        let mut sum = _mm512_setzero_ps();
        let mut i = 0;
        while i < full {
            let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p.add(i)), mv));
            _mm512_storeu_ps(p.add(i), e);
            sum = _mm512_add_ps(sum, e);
            i += 16;
        }
        if tail != 0 {
            let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, p.add(full)), mv));
            _mm512_mask_storeu_ps(p.add(full), tail, e);
            sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
        }
        *corr = if *m == f32::NEG_INFINITY {
            0.0
        } else {
            super::exp_approx(*m - m_new)
        };
        *l = *l * *corr + _mm512_reduce_add_ps(sum);
        *m = m_new;
    }
}

multiversion! {
    /// out = LayerNorm(x) * w + b over one row (two-pass mean and variance in f32, eps inside the
    /// square root, as torch's layer_norm).
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
        var += chunks.remainder().iter().map(|v| (v - mean) * (v - mean)).sum::<f32>();
        let rstd = 1.0 / (var / n + eps).sqrt();
        for (((o, &v), &wi), &bi) in out.iter_mut().zip(x).zip(w).zip(b) {
            *o = (v - mean) * rstd * wi + bi;
        }
    }
}

multiversion! {
    /// x[i] += bias[i % bias.len()].
    pub fn add_bias(x: &mut [f32], bias: &[f32]) {
        for row in x.chunks_exact_mut(bias.len()) {
            for (v, b) in row.iter_mut().zip(bias) {
                *v += *b;
            }
        }
    }
}

/// A raw pointer that may cross threads; users guarantee disjoint writes.
#[derive(Clone, Copy)]
pub struct SendPtr(pub *mut f32);
// SAFETY: only used to hand disjoint output regions to rayon tasks.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so closures capture the whole `SendPtr`).
    pub fn get(self) -> *mut f32 {
        self.0
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

    #[test]
    fn online_softmax_equals_softmax() {
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin() * 7.0).collect();
        let mut full = x.clone();
        softmax_row(&mut full);
        // Tiles of 300: accumulate sum p * value with rescaling, as the attention does.
        let vals: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.11).cos()).collect();
        let want: f32 = full.iter().zip(&vals).map(|(p, v)| p * v).sum();
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
        let e: Vec<f64> = x.iter().map(|&v| (v as f64).exp()).collect();
        let s: f64 = e.iter().sum();
        softmax_row(&mut x);
        for (a, b) in x.iter().zip(&e) {
            assert!((*a as f64 - b / s).abs() < 1e-6);
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
