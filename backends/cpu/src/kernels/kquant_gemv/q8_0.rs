//! The Q8_0 decode gemv: 32 int8 values and an f16 scale a block (34 bytes, read as stored),
//! against Q8_K activation rows in natural order, the pairing of candle's repacked x86 tiles
//! (`repack_x86::kernels::q8_0_tile2`), so decode and prefill products share the scheme and
//! each block's integer sum equals theirs. Per block and activation row: the weights, xor 0x80,
//! are unsigned for `vpdpbusd` (`(w + 128) · a`), whose accumulator starts at the block's
//! `-128 · sum(a)` (in one lane) so the lanes sum to `w · a`; then one int32 -> f32 convert and
//! one FMA by `d_w · d_a`. The activation sums per block come from Q8_K's sums of 16.
use super::{Q8KBlock, Q8KRows, QK_K};

/// Bytes of a Q8_0 block: d (f16), then 32 int8 values.
pub const BLOCK_BYTES: usize = 34;
/// Values per block.
const QK: usize = 32;

/// `out[r * ldo + j] = x_r · w_j` for `rows` Q8_0 weight rows at `w` (each `act.k / 32`
/// blocks) and every activation row `r < act.m` (1..=4).
///
/// # Safety
/// As [`super::gemv`]: the features are there, `act` is in natural order, `w` holds the rows,
/// `out` is ours to write at `r * ldo + j`.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn gemv(w: *const u8, rows: usize, act: &Q8KRows, out: *mut f32, ldo: usize) {
    let a: [&[Q8KBlock]; 4] = std::array::from_fn(|r| act.row(r.min(act.m - 1)));
    let kb = act.k / QK_K;
    match act.m {
        1 => x86::q8_0::<1>(w, rows, kb, &a, out, ldo),
        2 => x86::q8_0::<2>(w, rows, kb, &a, out, ldo),
        3 => x86::q8_0::<3>(w, rows, kb, &a, out, ldo),
        _ => x86::q8_0::<4>(w, rows, kb, &a, out, ldo),
    }
}

#[cfg(target_arch = "x86_64")]
// The G accumulators are indexed in step with the G activation rows.
#[allow(clippy::needless_range_loop)]
mod x86 {
    use super::super::x86::hsum8;
    use super::{Q8KBlock, BLOCK_BYTES, QK, QK_K};

    /// Superblocks of k a chunk (2048 values).
    const CHUNK: usize = 8;
    /// Bytes of activations (int8) kept whole in L1 (a third of Zen 4/5's 32/48 KB).
    const ACT_L1: usize = 16 * 1024;
    use std::arch::x86_64::*;

    /// G activation rows against `rows` Q8_0 weight rows of `kb` superblocks (8 blocks each).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn q8_0<const G: usize>(
        w: *const u8,
        rows: usize,
        kb: usize,
        a: &[&[Q8KBlock]; 4],
        out: *mut f32,
        ldo: usize,
    ) {
        let flip = _mm256_set1_epi8(-128);
        // Where the G activation rows outgrow a third of L1, the k axis goes in chunks of
        // CHUNK superblocks, every weight row taken per chunk, so that the chunk of activations
        // stays in L1 while the weight streams past it. Measured on Zen 5 (the bench, k = 6144):
        // 4 rows whole 14 GB/s, chunked 21; but 1 row chunked fell from 46 to 24 GB/s (the
        // strided weight reads defeat the prefetcher), so small activations go whole.
        let chunk = if G * kb * QK_K > ACT_L1 { CHUNK } else { kb };
        for s0 in (0..kb).step_by(chunk) {
            let s1 = (s0 + chunk).min(kb);
            for j in 0..rows {
                let row = w.add(j * kb * 8 * BLOCK_BYTES);
                // Two accumulators a row (even and odd blocks), so that the FMAs of one row
                // do not wait on each other.
                let mut acc = [[_mm256_setzero_ps(); 2]; G];
                for s in s0..s1 {
                    // The 8 blocks' corrections, -128 * (their sums of 32), from Q8_K's sums
                    // of 16: one `vpmaddwd` a superblock and activation row.
                    let corr: [__m256i; G] = std::array::from_fn(|g| {
                        let bs =
                            _mm256_load_si256(a[g].get_unchecked(s).bsums.as_ptr() as *const _);
                        _mm256_madd_epi16(bs, _mm256_set1_epi16(-128))
                    });
                    for pair in 0..4 {
                        for h in 0..2 {
                            let b = 2 * pair + h;
                            let blk = row.add((8 * s + b) * BLOCK_BYTES);
                            let dw = _mm256_cvtph_ps(_mm_set1_epi16(std::ptr::read_unaligned(
                                blk as *const i16,
                            )));
                            let wu = _mm256_xor_si256(
                                _mm256_loadu_si256(blk.add(2) as *const __m256i),
                                flip,
                            );
                            for g in 0..G {
                                let x = a[g].get_unchecked(s);
                                // Block b's correction alone, in lane b.
                                let c0 = _mm256_maskz_mov_epi32(1u8 << b, corr[g]);
                                let xq =
                                    _mm256_load_si256(x.qs.as_ptr().add(QK * b) as *const __m256i);
                                let sumi = _mm256_dpbusd_epi32(c0, wu, xq);
                                let f = _mm256_mul_ps(dw, _mm256_set1_ps(x.d));
                                acc[g][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), f, acc[g][h]);
                            }
                        }
                    }
                }
                for g in 0..G {
                    let o = out.add(g * ldo + j);
                    let part = hsum8(_mm256_add_ps(acc[g][0], acc[g][1]));
                    *o = if s0 == 0 { part } else { *o + part };
                }
            }
        }
    }
}
