//! Softmax pieces shared by the ViT engine's attention and the decoder's bf16 prefill attention:
//! Cephes' expf polynomial and a flash-attention style online softmax tile, with an AVX-512
//! form picked at run time; and the decoder MLP's SiLU·up on the same vector exp.
//!
//! Accuracy: `exp_approx` ~2e-7 relative; the AVX-512 tile's exp2 form ~2e-7 per value plus a
//! factor common to a row (~1e-7 x |max|, from rounding max·log2(e) once) that cancels in the
//! normalised probabilities; its bf16-output form 7.5e-5 per value before the bf16 rounding.

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
    // 2^fx through the exponent bits; fx is a whole number in [-126, 128] after the clamp. It
    // is read as an integer by adding 1.5 * 2^23, which puts it in the low mantissa bits: the
    // same value as `fx as i32`, but `as` (saturating, NaN to 0) stays scalar in vectorised
    // loops, 16 conversions and branches per AVX-512 vector (`bias_gelu_tanh` on Zen 5: 1.05
    // ns per element with `as`, 0.38 with this; a NaN x still gives NaN).
    let fx_int = (fx + 12_582_912.0).to_bits() as i32 - 0x4B40_0000;
    let scale = f32::from_bits((fx_int.wrapping_add(127).clamp(1, 254) as u32) << 23);
    y * scale
}

/// One key tile of an online softmax row (flash-attention style): with the row's running max
/// `m` and sum `l` over earlier tiles, replaces `x` by exp(x - m_new), updates `m` and `l`,
/// and sets `corr` = exp(m_old - m_new), the factor earlier partial outputs must be scaled
/// by. Start a row with m = -inf, l = 0 (corr is then 0).
pub fn online_softmax_tile_auto(x: &mut [f32], m: &mut f32, l: &mut f32, corr: &mut f32) {
    online_softmax_tile_body(x, m, l, corr)
}

/// [`online_softmax_tile_auto`] compiled for AVX2 + FMA: the same operations (Rust contracts no
/// mul + add into an FMA, and `floor` is exact in `vroundps`), so the same bits, in 8 lanes.
/// Compiled for the baseline x86-64 instead, `floor` has no instruction and each exp is scalar:
/// on a Zen 3 without AVX-512 the ViT's attention at 4096 patches was 63% of the bucket's run.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn online_softmax_tile_avx2(x: &mut [f32], m: &mut f32, l: &mut f32, corr: &mut f32) {
    online_softmax_tile_body(x, m, l, corr)
}

#[inline(always)]
fn online_softmax_tile_body(x: &mut [f32], m: &mut f32, l: &mut f32, corr: &mut f32) {
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
    *corr = if *m == f32::NEG_INFINITY {
        0.0
    } else {
        exp_approx(*m - m_new)
    };
    *l = *l * *corr + sum;
    *m = m_new;
}

/// [`online_softmax_tile_auto`], with AVX-512 intrinsics where the CPU has them (measured on
/// the 2B ViT at 4096 patches: the attention phase went from 9.5 s to 5.3 s with this form).
pub fn online_softmax_tile(x: &mut [f32], m: &mut f32, l: &mut f32, corr: &mut f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512dq")
    {
        // SAFETY: the features were detected on this CPU.
        return unsafe { avx512::online_softmax_tile(x, m, l, corr) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the features were detected on this CPU.
        return unsafe { online_softmax_tile_avx2(x, m, l, corr) };
    }
    online_softmax_tile_auto(x, m, l, corr)
}

/// [`online_softmax_tile`] that also writes exp(x - m_new) rounded to bf16 (to nearest even,
/// as the bf16 kernel rounds its left operand) into `out`, for a p·v product that then needs no
/// conversion pass; `l` sums the f32 values as before. `x` is scratch afterwards. The AVX-512
/// form takes a shorter exp than the f32 tile (7.5e-5 relative, under the bf16 rounding that
/// follows; see `avx512::exp2_16_for_bf16`): a value may round to the neighbouring bf16.
pub fn online_softmax_tile_bf16(
    x: &mut [f32],
    out: &mut [u16],
    m: &mut f32,
    l: &mut f32,
    corr: &mut f32,
) {
    assert!(out.len() >= x.len(), "online_softmax_tile_bf16: out");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512bf16")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
    {
        // SAFETY: the features were detected on this CPU (avx512bf16 implies avx512f).
        return unsafe { avx512::online_softmax_tile_bf16(x, out, m, l, corr) };
    }
    online_softmax_tile(x, m, l, corr);
    for (o, &v) in out.iter_mut().zip(x.iter()) {
        *o = super::packed::bf16_bits(v);
    }
}

/// row = softmax(row * scale) in place, f32 ([`exp_approx`]: ~2e-7 relative).
pub fn softmax_scaled(row: &mut [f32], scale: f32) {
    if scale != 1.0 {
        row.iter_mut().for_each(|x| *x *= scale);
    }
    let (mut m, mut l, mut corr) = (f32::NEG_INFINITY, 0.0, 0.0);
    online_softmax_tile(row, &mut m, &mut l, &mut corr);
    let inv = 1.0 / l;
    row.iter_mut().for_each(|x| *x *= inv);
}

/// out = silu(gate) · up = gate / (1 + exp(-gate)) · up, `Qwen3VLTextMLP`'s
/// `act_fn(gate_proj(x)) * up_proj(x)` on one row; the AVX-512 exp2 form where the CPU has it
/// (within 1e-6 + |gate|·1e-7 relative of libm's expf form, as its test checks; the |gate| term
/// only matters where silu is ~0. libm's expf took 5% of a 2B prefill as a scalar call).
pub fn silu_mul_row(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() >= out.len() && up.len() >= out.len(),
        "silu_mul_row"
    );
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512dq")
    {
        // SAFETY: the features were detected on this CPU; the lengths were checked.
        return unsafe { avx512::silu_mul_row(gate, up, out) };
    }
    silu_mul_row_portable(gate, up, out)
}

fn silu_mul_row_portable(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    /// 2^t on 16 lanes for t >= -126 (clamped there; -inf gives 2^-126): 2^(t - floor t) by a
    /// degree-5 polynomial on [0, 1) (Chebyshev-node fit, 1.8e-7 relative in f32), times
    /// 2^floor(t) by `vscalefps`. Eight vector ops where a natural-base exp takes fifteen: the
    /// scores' log2(e) factor rides on the max subtraction as one fused multiply-subtract.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    unsafe fn exp2_16(t: __m512) -> __m512 {
        let t = _mm512_max_ps(t, _mm512_set1_ps(-126.0));
        // imm 0x09: round toward -inf (01), precision exception suppressed (08).
        let f = _mm512_reduce_ps::<0x09>(t);
        let mut y = _mm512_set1_ps(1.893_754e-3);
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(8.949_591e-3));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.586_034e-2));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.401_418_2e-1));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.931_545e-1));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.999_999e-1));
        _mm512_scalef_ps(y, t)
    }

    /// 2^t on 16 lanes for a value that is rounded to bf16 next (the p of a p·v product): a
    /// degree-3 polynomial (Remez fit, 7.5e-5 relative: 26 times under bf16's half ulp, so
    /// ~1 in 50 values rounds to the neighbouring bf16) instead of degree 5, and no clamp:
    /// `vreduceps` of -inf is 0 and `vscalefps` by -inf gives 0, so a masked score (-inf)
    /// comes out 0, and a t below -126 an f32 denormal or 0 (nothing next to the row's 1).
    /// Three vector operations fewer than [`exp2_16`] on the softmax's ~13 per 16 scores.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    unsafe fn exp2_16_for_bf16(t: __m512) -> __m512 {
        // imm 0x09: round toward -inf (01), precision exception suppressed (08).
        let f = _mm512_reduce_ps::<0x09>(t);
        let mut y = _mm512_set1_ps(7.802_398e-2);
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.260_670_2e-1));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.958_341e-1));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.999_251e-1));
        _mm512_scalef_ps(y, t)
    }

    /// silu(g) * u on 16 lanes: the one sequence of operations behind [`super::silu_mul_row`]
    /// and the bf16 GEMM's fused SiLU epilogue, so that both give the same bits.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(crate) unsafe fn silu_mul_16(g: __m512, u: __m512) -> __m512 {
        // exp(-g) = 2^(-g·log2 e); +inf for g < -88 gives g / inf = -0, as libm does.
        let e = exp2_16(_mm512_mul_ps(g, _mm512_set1_ps(-std::f32::consts::LOG2_E)));
        let s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0), e));
        _mm512_mul_ps(s, u)
    }

    /// [`super::silu_mul_row`] on 16 lanes at a time (the tail masked).
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(super) unsafe fn silu_mul_row(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let n = out.len();
        let mut i = 0;
        while i < n {
            let left = n - i;
            let mask: __mmask16 = if left >= 16 {
                0xffff
            } else {
                ((1u32 << left) - 1) as u16
            };
            // SAFETY: lanes past `n` are masked off; the caller checked the lengths.
            unsafe {
                let g = _mm512_maskz_loadu_ps(mask, gate.as_ptr().add(i));
                let u = _mm512_maskz_loadu_ps(mask, up.as_ptr().add(i));
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(i), mask, silu_mul_16(g, u));
            }
            i += 16;
        }
    }

    #[target_feature(enable = "avx512f,avx512dq")]
    pub(super) unsafe fn online_softmax_tile(
        x: &mut [f32],
        m: &mut f32,
        l: &mut f32,
        corr: &mut f32,
    ) {
        tile_impl(x, None, m, l, corr)
    }

    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn online_softmax_tile_bf16(
        x: &mut [f32],
        out: &mut [u16],
        m: &mut f32,
        l: &mut f32,
        corr: &mut f32,
    ) {
        tile_impl(x, Some(out), m, l, corr)
    }

    /// Stores e = exp(x - m_new) into x, or (rounded) into `out` when given.
    #[inline(always)]
    unsafe fn store(p: *mut f32, bits: Option<*mut u16>, i: usize, e: __m512, mask: __mmask16) {
        match bits {
            None => _mm512_mask_storeu_ps(p.add(i), mask, e),
            Some(o) => {
                let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(e));
                _mm256_mask_storeu_epi16(o.add(i) as *mut i16, mask, h);
            }
        }
    }

    #[inline(always)]
    unsafe fn tile_impl(
        x: &mut [f32],
        out: Option<&mut [u16]>,
        m: &mut f32,
        l: &mut f32,
        corr: &mut f32,
    ) {
        let bits = out.map(|o| o.as_mut_ptr());
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
        // Rounded to bf16 next: the shorter exp (which has no clamp, so a row that is -inf
        // throughout, with no earlier tile, is set to 0 here rather than -inf - -inf).
        let exp2 = match bits {
            Some(o) if m_new == f32::NEG_INFINITY => {
                std::ptr::write_bytes(o, 0, n);
                (*corr, *l) = (0.0, 0.0);
                return;
            }
            Some(_) => exp2_16_for_bf16,
            None => exp2_16,
        };
        // exp(x - m) = 2^(x log2e - m log2e)
        let l2e = _mm512_set1_ps(std::f32::consts::LOG2_E);
        let m2 = _mm512_set1_ps(m_new * std::f32::consts::LOG2_E);
        let mut sum = _mm512_setzero_ps();
        let mut i = 0;
        while i < full {
            let e = exp2(_mm512_fmsub_ps(_mm512_loadu_ps(p.add(i)), l2e, m2));
            store(p, bits, i, e, 0xffff);
            sum = _mm512_add_ps(sum, e);
            i += 16;
        }
        if tail != 0 {
            let x = _mm512_maskz_loadu_ps(tail, p.add(full));
            let e = exp2(_mm512_fmsub_ps(x, l2e, m2));
            store(p, bits, full, e, tail);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vector_silu_matches_libm() {
        // Both tails (a row of 37), large and tiny gates (the exp's ends), zeros.
        let n = 37;
        let gate: Vec<f32> = (0..n)
            .map(|i| ((i * 41 % 97) as f32 - 48.0) * if i % 5 == 0 { 3.0 } else { 0.2 })
            .collect();
        let up: Vec<f32> = (0..n).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.5).collect();
        let mut got = vec![f32::NAN; n];
        let mut want = vec![0f32; n];
        silu_mul_row(&gate, &up, &mut got);
        silu_mul_row_portable(&gate, &up, &mut want);
        // Rounding -g·log2(e) costs ~|g|·6e-8 relative in exp(-g), which only shows where
        // exp(-g) dominates (g << 0, silu(g) ~ 0).
        for i in 0..n {
            let tol = (1e-6 + 1e-7 * gate[i].abs()) * want[i].abs() + 1e-30;
            assert!(
                (got[i] - want[i]).abs() <= tol,
                "{i}: gate {} -> {} vs {}",
                gate[i],
                got[i],
                want[i]
            );
        }
    }

    #[test]
    fn the_vector_exp_matches_the_scalar_one() {
        // The AVX-512 tile (exp2 form) against the portable one (Cephes expf), over a row with
        // a large max, masked entries and a running state from an earlier tile. The exp2 form
        // rounds m·log2(e) once per row: with |m| ~ 40 that is a ~3e-6 relative factor common
        // to the whole row's values (it cancels in p = e / l), hence the 1e-5 bound.
        let n = 203;
        let mut x: Vec<f32> = (0..n)
            .map(|i| ((i * 53 % 97) as f32 * 0.29).cos() * 40.0)
            .collect();
        x[7] = f32::NEG_INFINITY;
        let mut y = x.clone();
        let (mut m1, mut l1, mut c1) = (30.0, 3.0, 0.0);
        let (mut m2, mut l2, mut c2) = (30.0, 3.0, 0.0);
        online_softmax_tile(&mut x, &mut m1, &mut l1, &mut c1);
        online_softmax_tile_auto(&mut y, &mut m2, &mut l2, &mut c2);
        assert_eq!(m1, m2);
        assert!((l1 - l2).abs() <= 1e-5 * l2, "l {l1} vs {l2}");
        assert!((c1 - c2).abs() <= 1e-5 * c2, "corr {c1} vs {c2}");
        for (i, (a, b)) in x.iter().zip(&y).enumerate() {
            assert!((a - b).abs() <= 1e-5 * b + 1e-30, "{i}: {a} vs {b}");
        }
    }

    #[test]
    fn the_avx2_tile_is_the_portable_one_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        {
            if !(std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma"))
            {
                vlm_test_support::skip!("this CPU has no AVX2 + FMA");
                return;
            }
            // Lengths around the 8-lane step, a large max, masked entries, the exp's clamps,
            // and a running state from an earlier tile.
            for n in [1usize, 7, 8, 9, 203, 512] {
                let mut x: Vec<f32> = (0..n)
                    .map(|i| ((i * 53 % 97) as f32 * 0.29).cos() * 40.0)
                    .collect();
                x[n / 2] = f32::NEG_INFINITY;
                if n > 8 {
                    x[3] = -200.0;
                    x[5] = 95.0;
                }
                let mut y = x.clone();
                let (mut m1, mut l1, mut c1) = (30.0, 3.0, 0.0);
                let (mut m2, mut l2, mut c2) = (30.0, 3.0, 0.0);
                // SAFETY: the features were detected above.
                unsafe { online_softmax_tile_avx2(&mut x, &mut m1, &mut l1, &mut c1) };
                online_softmax_tile_auto(&mut y, &mut m2, &mut l2, &mut c2);
                assert_eq!(
                    (m1, l1.to_bits(), c1.to_bits()),
                    (m2, l2.to_bits(), c2.to_bits())
                );
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&x), bits(&y), "n {n}");
            }
        }
    }

    #[test]
    fn the_bf16_tile_is_the_f32_tile_rounded() {
        for n in [5usize, 16, 37, 512] {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 * 0.13).sin() * 6.0)
                .collect();
            let (mut a, mut b) = (x.clone(), x.clone());
            let (mut m1, mut l1, mut c1) = (0.5, 2.0, 0.0);
            let (mut m2, mut l2, mut c2) = (0.5, 2.0, 0.0);
            online_softmax_tile(&mut a, &mut m1, &mut l1, &mut c1);
            let mut bits = vec![0u16; n];
            online_softmax_tile_bf16(&mut b, &mut bits, &mut m2, &mut l2, &mut c2);
            // The bf16 form's shorter exp (7.5e-5 relative) may land a value on the
            // neighbouring bf16, never further; l and corr agree to that precision.
            assert_eq!(m1, m2, "n {n}");
            assert!((l1 - l2).abs() <= 1e-4 * l1, "n {n}: l {l1} vs {l2}");
            assert!((c1 - c2).abs() <= 1e-4 * c1, "n {n}: corr {c1} vs {c2}");
            for (i, (&got, &f)) in bits.iter().zip(&a).enumerate() {
                let want = crate::kernels::packed::bf16_bits(f);
                assert!(
                    got.abs_diff(want) <= 1,
                    "n {n} [{i}]: {got:#x} vs {want:#x}"
                );
                let v = f32::from_bits((got as u32) << 16);
                assert!(
                    (v - f).abs() <= f * (1.0 / 256.0 + 1e-4),
                    "n {n} [{i}]: {v} vs {f}"
                );
            }
        }
    }

    #[test]
    fn the_bf16_tile_zeroes_masked_scores_and_whole_masked_rows() {
        // -inf scores (masked keys) give p = 0 without the clamp; a tile masked throughout
        // with no earlier tile leaves the row empty (p = 0, l = 0) rather than NaN. (The
        // AVX-512 form's behaviour: elsewhere the f32 tile's exp clamps -inf to e^-87.3.)
        // The features of that form are the bf16 kernel's (false off x86-64).
        if !crate::kernels::bf16_gemm::available() {
            vlm_test_support::skip!("no AVX512-BF16 on this CPU");
            return;
        }
        let n = 40;
        let mut x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        for i in (0..n).step_by(3) {
            x[i] = f32::NEG_INFINITY;
        }
        let mut bits = vec![0xffffu16; n];
        let (mut m, mut l, mut c) = (f32::NEG_INFINITY, 0.0, 0.0);
        online_softmax_tile_bf16(&mut x.clone(), &mut bits, &mut m, &mut l, &mut c);
        assert!(m.is_finite() && l.is_finite() && l >= 1.0, "m {m} l {l}");
        for (i, &b) in bits.iter().enumerate() {
            let v = f32::from_bits((b as u32) << 16);
            assert!(v.is_finite() && (0.0..=1.0).contains(&v), "[{i}] {v}");
            assert_eq!(v == 0.0, i % 3 == 0, "[{i}] {v}");
        }
        let mut masked = vec![f32::NEG_INFINITY; n];
        let (mut m, mut l, mut c) = (f32::NEG_INFINITY, 0.0, 0.0);
        online_softmax_tile_bf16(&mut masked, &mut bits, &mut m, &mut l, &mut c);
        assert_eq!((m, l, c), (f32::NEG_INFINITY, 0.0, 0.0));
        assert!(bits.iter().all(|&b| b == 0), "{bits:?}");
    }
}
