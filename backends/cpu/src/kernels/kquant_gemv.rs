//! The decode gemv of Q4_K, Q6_K and Q8_0 weights (1..=4 activation rows) on AVX512-VNNI,
//! reading the file's compact blocks as they are (no repacked copy). Q8_0 has a kernel of its
//! own ([`q8_0`]); for the k-quants, per 64 weight bytes one
//! `vpmaddubsw` (unsigned 4- or 6-bit weights x signed Q8_K activations, pairs to int16) and
//! one `vpdpwssd` (x the sub-block scales, pairs to int32, accumulated), one int32 -> f32
//! convert and one FMA per superblock. The activations are quantized once per product
//! ([`super::q8k_act`]) in the order the weight values come out of a 64-byte load.
//!
//! The integer sum of each superblock is exactly that of ggml's `ggml_vec_dot_q4_K_q8_K` /
//! `ggml_vec_dot_q6_K_q8_K` (candle's `k_quants` `vec_dot_q4k_q8k` / `vec_dot_q6k_q8k`): Q4_K
//! `d * sum(sc * q * a) - dmin * sum(m * bsum)`, Q6_K `d * sum(sc * (q - 32) * a)` with the
//! `- 32` taken through the activation sums; only the f32 sums over superblocks run in
//! another order.
//!
//! Why `vpmaddubsw` + `vpdpwssd` rather than `vpdpbusd`: a Q4_K / Q6_K scale changes every 32
//! / 16 values, so `vpdpbusd`'s int32 lanes would need a `vpmulld` by the scale and an add per
//! register (3 instructions per 64 weights); the pair products fit int16 (15 x 127 x 2, 63 x
//! 127 x 2), so multiplying them by the int16 scales and accumulating is one `vpdpwssd` (2
//! instructions per 64 weights).
use super::q8k_act::{Order, Q8KBlock, Q8KRows, QK_K};

/// Bytes of a Q4_K superblock: d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 of nibbles.
pub const Q4K_BYTES: usize = 144;
/// Bytes of a Q6_K superblock: 128 low nibbles, 64 of high bit pairs, 16 i8 scales, d (f16).
pub const Q6K_BYTES: usize = 210;

mod q8_0;

/// The weight types this kernel takes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum KQuant {
    Q4K,
    Q6K,
    /// 32 values a block (not a k-quant, but paired with the same Q8_K activations).
    Q8_0,
}

impl KQuant {
    /// Bytes of weight per 256 values (one superblock; eight Q8_0 blocks).
    pub fn block_bytes(self) -> usize {
        match self {
            KQuant::Q4K => Q4K_BYTES,
            KQuant::Q6K => Q6K_BYTES,
            KQuant::Q8_0 => 8 * q8_0::BLOCK_BYTES,
        }
    }

    /// The order the activations are quantized in for this type.
    pub fn order(self) -> Order {
        match self {
            KQuant::Q4K => Order::Q4K,
            KQuant::Q6K | KQuant::Q8_0 => Order::Natural,
        }
    }
}

/// Whether this CPU runs the kernel (AVX512F, BW, VL and VNNI; F16C).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[r * ldo + j] = x_r · w_j` for the `rows` weight rows in `w` (each `act.k / 256`
/// superblocks of `ty`) and every activation row `r < act.m` (<= 4).
///
/// # Safety
/// [`available`] is true; `act` was quantized in `ty`'s order; `out` is valid for writes at
/// `r * ldo + j` for `r < act.m`, `j < rows`, and no one else touches those elements meanwhile.
pub unsafe fn gemv(ty: KQuant, w: &[u8], rows: usize, act: &Q8KRows, out: *mut f32, ldo: usize) {
    let kb = act.k / QK_K;
    assert!(
        (1..=4).contains(&act.m) && w.len() >= rows * kb * ty.block_bytes(),
        "kquant gemv: {} activation rows, {} weight bytes for {rows}x{}",
        act.m,
        w.len(),
        act.k
    );
    #[cfg(target_arch = "x86_64")]
    {
        let a: [&[Q8KBlock]; 4] = std::array::from_fn(|r| act.row(r.min(act.m - 1)));
        macro_rules! run {
            ($f:ident) => {
                match act.m {
                    1 => x86::$f::<1>(w.as_ptr(), rows, kb, &a, out, ldo),
                    2 => x86::$f::<2>(w.as_ptr(), rows, kb, &a, out, ldo),
                    3 => x86::$f::<3>(w.as_ptr(), rows, kb, &a, out, ldo),
                    _ => x86::$f::<4>(w.as_ptr(), rows, kb, &a, out, ldo),
                }
            };
        }
        match ty {
            KQuant::Q4K => run!(q4k),
            KQuant::Q6K => run!(q6k),
            KQuant::Q8_0 => q8_0::gemv(w.as_ptr(), rows, act, out, ldo),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (w, out, ldo);
        unreachable!("kquant gemv without AVX512-VNNI")
    }
}

#[cfg(target_arch = "x86_64")]
// The G accumulators are indexed in step with the G activation rows.
#[allow(clippy::needless_range_loop)]
mod x86 {
    use super::{Q8KBlock, Q4K_BYTES, Q6K_BYTES};
    use std::arch::x86_64::*;

    /// The f16 at `p` (d of a Q6_K block) as f32.
    #[inline(always)]
    unsafe fn f16_at(p: *const u8) -> f32 {
        let h = std::ptr::read_unaligned(p as *const u16);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
    }

    /// Q4_K's 12 bytes of 6-bit scales and mins at `p` as 16 bytes `[sc0..sc7, m0..m7]`:
    /// ggml's `utmp` unpack (`ggml_vec_dot_q4_K_q8_K`) on the dwords u0, u1, u2 in one
    /// register, `[u0 & K1, (u2 & K2) | ((u0 >> 6) & K3) << 4, u1 & K1, ((u2 >> 4) & K2) |
    /// ((u1 >> 6) & K3) << 4]`. Reads 16 bytes (the last 4 are the block's first nibbles).
    #[inline(always)]
    unsafe fn q4k_scales_mins(p: *const u8) -> __m128i {
        let v = _mm_loadu_si128(p as *const __m128i);
        let a = _mm_shuffle_epi32::<0b10_01_10_00>(v); // [u0, u2, u1, u2]
        let b = _mm_shuffle_epi32::<0b01_01_00_00>(v); // [u0, u0, u1, u1]
        let a = _mm_and_si128(
            _mm_srlv_epi32(a, _mm_set_epi32(4, 0, 0, 0)),
            _mm_set_epi32(0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f),
        );
        // ((u >> 6) & 3) << 4 per byte is (u >> 2) & 0x30, wanted in dwords 1 and 3 only.
        let hi = _mm_set_epi32(0x30303030, 0, 0x30303030, 0);
        // vpternlog 0xF8: A | (B & C).
        _mm_ternarylogic_epi32::<0xf8>(a, _mm_srli_epi32::<2>(b), hi)
    }

    /// `vpshufb` controls that widen bytes of a 16-byte group (broadcast to every 128-bit lane)
    /// to words: word `w` of the result is byte `pick(w)` zero-extended (`hi: false`), or that
    /// byte in the high half, for an arithmetic shift to sign-extend it (`hi: true`).
    const fn widen(pick: [u8; 32], hi: bool) -> [u8; 64] {
        let mut c = [0x80u8; 64];
        let mut w = 0;
        while w < 32 {
            c[2 * w + hi as usize] = pick[w];
            w += 1;
        }
        c
    }
    /// Q4_K: `[sc0..sc7, m0..m7]`; the scales of the four registers of a superblock (low
    /// nibbles of bytes 0..64: sub-blocks 0 and 2, 16 words each; high: 1 and 3; then 4, 6
    /// and 5, 7).
    const fn q4k_pick(a: u8, b: u8) -> [u8; 32] {
        let mut p = [0u8; 32];
        let mut w = 0;
        while w < 32 {
            p[w] = if w < 16 { a } else { b };
            w += 1;
        }
        p
    }
    const Q4K_SC: [[u8; 64]; 4] = [
        widen(q4k_pick(0, 2), false),
        widen(q4k_pick(1, 3), false),
        widen(q4k_pick(4, 6), false),
        widen(q4k_pick(5, 7), false),
    ];
    /// `[m0, m0, m1, m1, ..]` (16 words): against the 16 activation sums, `vpmaddwd` gives
    /// `m_j * bsum32_j`.
    const Q4K_MINS: [u8; 64] = widen(
        [
            8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15, 8, 8, 9, 9, 10, 10, 11, 11,
            12, 12, 13, 13, 14, 14, 15, 15,
        ],
        false,
    );
    /// Q6_K: its 16 i8 scales for the four registers of a superblock (16 values = 8 words
    /// each), in the high bytes.
    const fn q6k_pick(r: u8) -> [u8; 32] {
        let mut p = [0u8; 32];
        let mut w = 0;
        while w < 32 {
            p[w] = 4 * r + (w as u8) / 8;
            w += 1;
        }
        p
    }
    const Q6K_SC: [[u8; 64]; 4] = [
        widen(q6k_pick(0), true),
        widen(q6k_pick(1), true),
        widen(q6k_pick(2), true),
        widen(q6k_pick(3), true),
    ];

    #[inline(always)]
    unsafe fn ctl(c: &[u8; 64]) -> __m512i {
        _mm512_loadu_si512(c.as_ptr() as *const _)
    }

    #[inline(always)]
    unsafe fn act(a: &Q8KBlock, i: usize) -> __m512i {
        _mm512_load_si512(a.qs.as_ptr().add(64 * i) as *const _)
    }

    #[inline(always)]
    pub(super) unsafe fn hsum8(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// G activation rows against `rows` Q4_K weight rows of `kb` superblocks from `w`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn q4k<const G: usize>(
        w: *const u8,
        rows: usize,
        kb: usize,
        a: &[&[Q8KBlock]; 4],
        out: *mut f32,
        ldo: usize,
    ) {
        let nib = _mm512_set1_epi8(0x0f);
        let sc_ctl = [
            ctl(&Q4K_SC[0]),
            ctl(&Q4K_SC[1]),
            ctl(&Q4K_SC[2]),
            ctl(&Q4K_SC[3]),
        ];
        let min_ctl = _mm512_castsi512_si256(ctl(&Q4K_MINS));
        for j in 0..rows {
            let row = w.add(j * kb * Q4K_BYTES);
            let mut acc = [_mm512_setzero_ps(); G];
            let mut acc_m = [_mm256_setzero_ps(); G];
            for b in 0..kb {
                let blk = row.add(b * Q4K_BYTES);
                // [d, dmin, ..] as f32.
                let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(
                    blk as *const i32,
                )));
                let sm = q4k_scales_mins(blk.add(4));
                let smz = _mm512_broadcast_i32x4(sm);
                let sc = [
                    _mm512_shuffle_epi8(smz, sc_ctl[0]),
                    _mm512_shuffle_epi8(smz, sc_ctl[1]),
                    _mm512_shuffle_epi8(smz, sc_ctl[2]),
                    _mm512_shuffle_epi8(smz, sc_ctl[3]),
                ];
                let mins = _mm256_shuffle_epi8(_mm512_castsi512_si256(smz), min_ctl);
                let q0 = _mm512_loadu_si512(blk.add(16) as *const _);
                let q1 = _mm512_loadu_si512(blk.add(80) as *const _);
                let wv = [
                    _mm512_and_si512(q0, nib),
                    _mm512_and_si512(_mm512_srli_epi16::<4>(q0), nib),
                    _mm512_and_si512(q1, nib),
                    _mm512_and_si512(_mm512_srli_epi16::<4>(q1), nib),
                ];
                for g in 0..G {
                    let x = &a[g][b];
                    let p0 = _mm512_madd_epi16(sc[0], _mm512_maddubs_epi16(wv[0], act(x, 0)));
                    let p0 = _mm512_dpwssd_epi32(p0, sc[1], _mm512_maddubs_epi16(wv[1], act(x, 1)));
                    let p1 = _mm512_madd_epi16(sc[2], _mm512_maddubs_epi16(wv[2], act(x, 2)));
                    let p1 = _mm512_dpwssd_epi32(p1, sc[3], _mm512_maddubs_epi16(wv[3], act(x, 3)));
                    let sumi = _mm512_add_epi32(p0, p1);
                    // [d * x.d, dmin * x.d, ..]
                    let f = _mm_mul_ps(dm, _mm_set1_ps(x.d));
                    acc[g] =
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_broadcastss_ps(f), acc[g]);
                    let bs = _mm256_load_si256(x.bsums.as_ptr() as *const _);
                    let mn = _mm256_madd_epi16(mins, bs);
                    acc_m[g] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(mn),
                        _mm256_broadcastss_ps(_mm_movehdup_ps(f)),
                        acc_m[g],
                    );
                }
            }
            for g in 0..G {
                *out.add(g * ldo + j) = _mm512_reduce_add_ps(acc[g]) - hsum8(acc_m[g]);
            }
        }
    }

    /// G activation rows against `rows` Q6_K weight rows of `kb` superblocks from `w`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn q6k<const G: usize>(
        w: *const u8,
        rows: usize,
        kb: usize,
        a: &[&[Q8KBlock]; 4],
        out: *mut f32,
        ldo: usize,
    ) {
        let nib = _mm512_set1_epi8(0x0f);
        let hi2 = _mm512_set1_epi8(0x30);
        // The high bit pairs of values 0..32 / 32..64 of a half sit at bits 0-1 / 2-3 of the
        // qh bytes, of values 64..96 / 96..128 at bits 4-5 / 6-7: moved to bits 4-5 by a
        // shift per 256-bit half of the register (neighbouring bytes' bits are masked off).
        let shl_lo = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4);
        let shr_hi = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
        let sc_ctl = [
            ctl(&Q6K_SC[0]),
            ctl(&Q6K_SC[1]),
            ctl(&Q6K_SC[2]),
            ctl(&Q6K_SC[3]),
        ];
        for j in 0..rows {
            let row = w.add(j * kb * Q6K_BYTES);
            let mut acc = [_mm512_setzero_ps(); G];
            for b in 0..kb {
                let blk = row.add(b * Q6K_BYTES);
                let d = f16_at(blk.add(208));
                let s8 = _mm_loadu_si128(blk.add(192) as *const _);
                let s16 = _mm256_cvtepi8_epi16(s8);
                let s8z = _mm512_broadcast_i32x4(s8);
                let sc = [
                    _mm512_srai_epi16::<8>(_mm512_shuffle_epi8(s8z, sc_ctl[0])),
                    _mm512_srai_epi16::<8>(_mm512_shuffle_epi8(s8z, sc_ctl[1])),
                    _mm512_srai_epi16::<8>(_mm512_shuffle_epi8(s8z, sc_ctl[2])),
                    _mm512_srai_epi16::<8>(_mm512_shuffle_epi8(s8z, sc_ctl[3])),
                ];
                let qh = _mm512_loadu_si512(blk.add(128) as *const _);
                let l0 = _mm512_loadu_si512(blk as *const _);
                let l1 = _mm512_loadu_si512(blk.add(64) as *const _);
                let h0 = _mm512_shuffle_i64x2::<0x44>(qh, qh);
                let h1 = _mm512_shuffle_i64x2::<0xee>(qh, qh);
                // (l & 0x0f) | h: vpternlog 0xEA is (A & B) | C.
                let wv = [
                    _mm512_ternarylogic_epi32::<0xea>(
                        l0,
                        nib,
                        _mm512_and_si512(_mm512_sllv_epi64(h0, shl_lo), hi2),
                    ),
                    _mm512_ternarylogic_epi32::<0xea>(
                        _mm512_srli_epi16::<4>(l0),
                        nib,
                        _mm512_and_si512(_mm512_srlv_epi64(h0, shr_hi), hi2),
                    ),
                    _mm512_ternarylogic_epi32::<0xea>(
                        l1,
                        nib,
                        _mm512_and_si512(_mm512_sllv_epi64(h1, shl_lo), hi2),
                    ),
                    _mm512_ternarylogic_epi32::<0xea>(
                        _mm512_srli_epi16::<4>(l1),
                        nib,
                        _mm512_and_si512(_mm512_srlv_epi64(h1, shr_hi), hi2),
                    ),
                ];
                for g in 0..G {
                    let x = &a[g][b];
                    let p0 = _mm512_madd_epi16(sc[0], _mm512_maddubs_epi16(wv[0], act(x, 0)));
                    let p0 = _mm512_dpwssd_epi32(p0, sc[1], _mm512_maddubs_epi16(wv[1], act(x, 1)));
                    let p1 = _mm512_madd_epi16(sc[2], _mm512_maddubs_epi16(wv[2], act(x, 2)));
                    let p1 = _mm512_dpwssd_epi32(p1, sc[3], _mm512_maddubs_epi16(wv[3], act(x, 3)));
                    // sum(sc * 32 * bsum): the values are stored + 32.
                    let bs = _mm256_load_si256(x.bsums.as_ptr() as *const _);
                    let off = _mm256_slli_epi32::<5>(_mm256_madd_epi16(s16, bs));
                    let sumi =
                        _mm512_sub_epi32(_mm512_add_epi32(p0, p1), _mm512_zextsi256_si512(off));
                    acc[g] =
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_set1_ps(d * x.d), acc[g]);
                }
            }
            for g in 0..G {
                *out.add(g * ldo + j) = _mm512_reduce_add_ps(acc[g]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::k_quants::{self as kq, BlockQ8K, GgmlType};
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{Device, Module, Tensor};

    use crate::kernels::test_data::data;

    /// `bytes` (a QTensor's own storage: aligned, whole blocks) as blocks of `T`.
    fn blocks<T>(bytes: &[u8]) -> &[T] {
        assert_eq!(bytes.as_ptr() as usize % std::mem::align_of::<T>(), 0);
        // SAFETY: aligned (checked), whole blocks of a plain-data repr(C) type.
        unsafe {
            std::slice::from_raw_parts(
                bytes.as_ptr() as *const T,
                bytes.len() / std::mem::size_of::<T>(),
            )
        }
    }

    /// Our product against (a) the dequantized weight times the Q8_K-rounded activations in
    /// f64 and (b) candle's product of the same scheme (`k_quants::matmul`; for Q8_0 its
    /// repacked tiles) (both: f32 summation order only, 1e-5 of the sum of |terms|), and (c) the dequantized weight times the unrounded activations, within
    /// the Q8_K rounding bound (each activation moves by at most half a step, amax / 254 of
    /// its 256-value block).
    fn check(ty: KQuant, m: usize, n: usize, k: usize) {
        let mut x = data(m * k, 7 + m as u32);
        x[k / 3] = 9.0; // an outlier: one block with a coarse step
        let wt = Tensor::from_vec(data(n * k, 3), (n, k), &Device::Cpu).unwrap();
        let dtype = match ty {
            KQuant::Q4K => GgmlDType::Q4K,
            KQuant::Q6K => GgmlDType::Q6K,
            KQuant::Q8_0 => GgmlDType::Q8_0,
        };
        let q = QTensor::quantize(&wt, dtype).unwrap();
        let bytes = q.data().unwrap();
        let wd = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let act = Q8KRows::quantize(&x, m, k, ty.order());
        let mut got = vec![f32::NAN; m * n];
        // SAFETY: features checked by the caller; got is (m, n).
        unsafe { gemv(ty, &bytes, n, &act, got.as_mut_ptr(), n) };
        let mkn = (m, k, n);
        let mut out = vec![0f32; m * n];
        let theirs: Option<Vec<f32>> = match ty {
            KQuant::Q4K => {
                kq::matmul::<kq::BlockQ4K>(mkn, &x, blocks(&bytes), &mut out).unwrap();
                Some(out)
            }
            KQuant::Q6K => {
                kq::matmul::<kq::BlockQ6K>(mkn, &x, blocks(&bytes), &mut out).unwrap();
                Some(out)
            }
            // candle's Q8_0 product of the same scheme (Q8_K rows) is its repacked tiles,
            // which it takes for 16-row multiples; otherwise it pairs Q8_0 rows (a scale per
            // 32 values), another rounding, so only the f64 references below apply.
            KQuant::Q8_0 if n.is_multiple_of(16) => {
                let t = QMatMul::from_qtensor(QTensor::quantize(&wt, dtype).unwrap()).unwrap();
                let xt = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu).unwrap();
                let y = t.forward(&xt).unwrap().flatten_all().unwrap();
                Some(y.to_vec1().unwrap())
            }
            KQuant::Q8_0 => None,
        };
        let mut xb = vec![BlockQ8K::zeros(); m * k / QK_K];
        BlockQ8K::from_float(&x, &mut xb);
        let mut xq = vec![0f32; m * k];
        BlockQ8K::to_float(&xb, &mut xq);
        for r in 0..m {
            for j in 0..n {
                let (xr, xqr, w) = (
                    &x[r * k..(r + 1) * k],
                    &xq[r * k..(r + 1) * k],
                    &wd[j * k..(j + 1) * k],
                );
                let want_q: f64 = xqr.iter().zip(w).map(|(a, b)| *a as f64 * *b as f64).sum();
                let mag: f64 = xqr
                    .iter()
                    .zip(w)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                let want: f64 = xr.iter().zip(w).map(|(a, b)| *a as f64 * *b as f64).sum();
                let rounding: f64 = xr
                    .chunks_exact(QK_K)
                    .zip(w.chunks_exact(QK_K))
                    .map(|(xs, ws)| {
                        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
                        ws.iter().map(|v| v.abs() as f64).sum::<f64>() * amax / 254.0
                    })
                    .sum();
                let g = got[r * n + j] as f64;
                let at = format!("{ty:?} m={m} n={n} k={k} row {r} col {j}");
                assert!((g - want_q).abs() <= 1e-5 * mag, "{at}: {g} vs {want_q}");
                if let Some(theirs) = &theirs {
                    let t = theirs[r * n + j] as f64;
                    assert!((g - t).abs() <= 1e-5 * mag, "{at}: {g} vs candle {t}");
                }
                assert!(
                    (g - want).abs() <= rounding * 1.001 + 1e-5 * mag,
                    "{at}: {g} vs unrounded {want} (bound {rounding})"
                );
            }
        }
    }

    #[test]
    fn matches_the_dequantized_product_and_candles_for_1_to_4_rows() {
        if !available() {
            eprintln!("skipped: no AVX512-VNNI");
            return;
        }
        for ty in [KQuant::Q4K, KQuant::Q6K, KQuant::Q8_0] {
            for (m, n, k) in [
                (1, 1, 256),
                (2, 7, 512),
                (3, 33, 768),
                (4, 64, 2048),
                (1, 5, 6144),
                (4, 48, 2048),
            ] {
                check(ty, m, n, k);
            }
        }
    }
}
