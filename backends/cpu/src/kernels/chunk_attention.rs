//! Causal attention of a prefill chunk over the paged KV cache with the bf16 kernel (models
//! whose weights are bf16, on a CPU with AVX512-BF16). Per kv head: the head's cached keys and
//! values 0..start+n are packed once, then for each of its g query heads and each tile of query
//! rows, scores = q·kᵀ (bf16 products, f32 sums), causal mask, softmax in f32, out = p·v.
//!
//! Same math as `vlm_model::text::paged_attention::attend` (reference `eager_attention_forward` with the causal mask),
//! at the reference's bf16 precision; candle's f32 form ran at ~35 GFLOP/s here, this at the
//! kernel's rate.
//!
//! From [`TILED_FROM`] keys on (long contexts) a query tile's keys are taken [`K_TILE`] at a
//! time with an online softmax (flash attention's form, as the ViT's bf16 attention does): the
//! scores of a whole row of 16K keys (8 MiB per 128-row tile, written, read by the softmax and
//! read again by p·v) no longer leave the caches; each key tile's probabilities are written as
//! bf16 for p·v, and earlier tiles' sums are rescaled on p·v's stores.
use crate::kernels::aligned::AlignedU16;
use crate::kernels::bf16_gemm::{gemm, gemm_bf16_a, gemm_bf16_a_rescale, to_bf16, BView};
use crate::kernels::packed::{pack_column, pack_inner_row, PackElem, PackedB, NR};
use crate::kernels::softmax::{online_softmax_tile_bf16, softmax_scaled};
use rayon::prelude::*;
use std::cell::RefCell;
use vlm_model::text::CacheGeometry;

/// Query rows per score tile.
const Q_TILE: usize = 128;

/// Keys (cached + the chunk's) from which a query tile's keys are taken [`K_TILE`] at a time.
pub const TILED_FROM: usize = 2048;

/// Keys per tile of the tiled form: a multiple of the packed panels' width; 128 x 512 f32
/// scores and their bf16 probabilities stay in L2.
const K_TILE: usize = 512;
const _: () = assert!(K_TILE.is_multiple_of(NR));

thread_local! {
    /// Packed K, packed V (64-byte aligned for the tiles, see `aligned`), scores.
    static SCRATCH: RefCell<(AlignedU16, AlignedU16, Vec<f32>)> =
        const { RefCell::new((AlignedU16::new(), AlignedU16::new(), Vec::new())) };
    /// The tiled form's bf16 probabilities and q rows, and its softmax state (m, l, corr).
    static TILED: RefCell<(AlignedU16, Vec<f32>)> =
        const { RefCell::new((AlignedU16::new(), Vec::new())) };
}

/// q: (n, heads, hd) of cache indices start..start+n of the sequence with block table `table`
/// (whose K/V, these n included, are cached; f32 values are rounded to bf16 as they are packed,
/// bf16 ones copied). out: (n, heads * hd). `amx`: the products on AMX tiles.
#[allow(clippy::too_many_arguments)]
pub fn chunk_attention<T: PackElem>(
    k_cache: &[T],
    v_cache: &[T],
    geo: CacheGeometry,
    heads: usize,
    q: &[f32],
    start: usize,
    table: &[u32],
    scale: f32,
    amx: bool,
    out: &mut [f32],
) {
    let (kv_heads, hd) = (geo.kv_heads, geo.head_dim);
    let g = heads / kv_heads;
    let n = q.len() / (heads * hd);
    let total = start + n;
    let ld = heads * hd;
    let out_addr = out.as_mut_ptr() as usize;
    (0..kv_heads).into_par_iter().for_each(|kvh| {
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            let (kp, vp, scores) = &mut *s;
            let (klen, vlen) = (PackedB::len_for(total, hd), PackedB::len_for(hd, total));
            kp.resize(0);
            kp.resize(klen);
            vp.resize(0);
            vp.resize(vlen);
            for t in 0..total {
                let at = geo.offset(table, kvh, t);
                pack_column(kp, hd, t, &k_cache[at..at + hd]);
                pack_inner_row(vp, total, t, &v_cache[at..at + hd]);
            }
            let (kview, vview) = (
                BView::new(kp, total, hd).with_amx(amx),
                BView::new(vp, hd, total).with_amx(amx),
            );
            if total >= TILED_FROM {
                for j in 0..g {
                    let h = kvh * g + j;
                    let mut r0 = 0;
                    while r0 < n {
                        let rows = Q_TILE.min(n - r0);
                        let qh = &q[r0 * ld + h * hd..];
                        // SAFETY: out rows r0.. of head h (columns h*hd..+hd) belong to this
                        // task alone.
                        let o = unsafe { (out_addr as *mut f32).add(r0 * ld + h * hd) };
                        let tile = QueryTile {
                            rows,
                            first_seen: start + r0 + 1,
                            scale,
                        };
                        unsafe { tiled_rows(tile, qh, ld, hd, kview, vview, scores, o) };
                        r0 += rows;
                    }
                }
                return;
            }
            for j in 0..g {
                let h = kvh * g + j;
                let mut r0 = 0;
                while r0 < n {
                    let rows = Q_TILE.min(n - r0);
                    // Keys the last row of the tile sees; earlier rows see fewer (masked).
                    let keys = start + r0 + rows;
                    scores.resize(rows * keys, 0.0);
                    // SAFETY: q rows r0.. of head h have stride ld; scores is (rows, keys); out
                    // rows r0.. of head h (columns h*hd..+hd) belong to this task alone.
                    unsafe {
                        gemm(
                            rows,
                            hd,
                            q[r0 * ld + h * hd..].as_ptr(),
                            ld,
                            kview.cols(0, keys),
                            scores.as_mut_ptr(),
                            keys,
                            false,
                            false,
                        );
                    }
                    for (i, row) in scores.chunks_exact_mut(keys).enumerate() {
                        let seen = start + r0 + i + 1;
                        softmax_scaled(&mut row[..seen], scale);
                        row[seen..].fill(0.0);
                    }
                    unsafe {
                        gemm(
                            rows,
                            keys,
                            scores.as_ptr(),
                            keys,
                            vview.inner(0, keys),
                            (out_addr as *mut f32).add(r0 * ld + h * hd),
                            ld,
                            false,
                            false,
                        );
                    }
                    r0 += rows;
                }
            }
        });
    });
}

/// One tile of query rows: `rows` rows, row i seeing keys 0..first_seen + i.
#[derive(Clone, Copy)]
struct QueryTile {
    rows: usize,
    first_seen: usize,
    scale: f32,
}

/// The tiled form for one query tile of one head: q rows at stride `ldq`, the head's packed
/// keys and values; the output rows at `o` (stride `ldq`, `hd` values each) are written.
/// `scores` is this thread's scratch.
///
/// # Safety
/// `o` must be valid for `t.rows` rows of `hd` values at stride `ldq`, and no one else may
/// touch them; `kview` and `vview` must hold every key the tile's last row sees.
#[allow(clippy::too_many_arguments)]
unsafe fn tiled_rows(
    t: QueryTile,
    q: &[f32],
    ldq: usize,
    hd: usize,
    kview: BView<'_>,
    vview: BView<'_>,
    scores: &mut Vec<f32>,
    o: *mut f32,
) {
    let keys = t.first_seen + t.rows - 1;
    // Probabilities rows padded by a cache line (the product reads A in pairs past w).
    let ps = K_TILE + 32;
    let lq = hd.next_multiple_of(2);
    TILED.with(|cell| {
        let mut cell = cell.borrow_mut();
        let (buf, stats) = &mut *cell;
        let q16_at = (t.rows * ps).next_multiple_of(32);
        if buf.len() < q16_at + t.rows * lq {
            buf.resize(q16_at + t.rows * lq);
        }
        let (probs, q16) = buf.split_at_mut(q16_at);
        // q rounded to bf16 once (every key tile's q·kᵀ reads it), as `gemm` rounds f32 A.
        for i in 0..t.rows {
            to_bf16(&q[i * ldq..i * ldq + hd], &mut q16[i * lq..(i + 1) * lq]);
        }
        stats.clear();
        stats.resize(3 * t.rows, 0.0);
        let (m, rest) = stats.split_at_mut(t.rows);
        let (l, corr) = rest.split_at_mut(t.rows);
        m.fill(f32::NEG_INFINITY);
        scores.resize(t.rows * K_TILE, 0.0);
        let mut t0 = 0;
        while t0 < keys {
            let w = K_TILE.min(keys - t0);
            let tile = &mut scores[..t.rows * w];
            // SAFETY: q16 holds t.rows rows of lq; tile is (t.rows, w).
            unsafe {
                gemm_bf16_a(
                    t.rows,
                    q16.as_ptr(),
                    lq,
                    kview.cols(t0, w),
                    tile.as_mut_ptr(),
                    w,
                    false,
                    false,
                )
            };
            for (i, row) in tile.chunks_exact_mut(w).enumerate() {
                // Keys past the row's own position are masked (causal).
                let seen = (t.first_seen + i).saturating_sub(t0).min(w);
                row[..seen].iter_mut().for_each(|x| *x *= t.scale);
                row[seen..].fill(f32::NEG_INFINITY);
                let p = &mut probs[i * ps..(i + 1) * ps];
                online_softmax_tile_bf16(row, &mut p[..w], &mut m[i], &mut l[i], &mut corr[i]);
                p[seen..].fill(0);
            }
            let pv = vview.inner(t0, w);
            // SAFETY: probs holds t.rows rows at stride ps (zero past each row's keys); the
            // caller's contract on `o`.
            unsafe {
                if t0 == 0 {
                    gemm_bf16_a(t.rows, probs.as_ptr(), ps, pv, o, ldq, false, false)
                } else {
                    gemm_bf16_a_rescale(
                        t.rows,
                        probs.as_ptr(),
                        ps,
                        pv,
                        o,
                        ldq,
                        corr.as_ptr(),
                        false,
                    )
                }
            };
            t0 += w;
        }
        for (i, &sum) in l.iter().enumerate() {
            let inv = 1.0 / sum;
            // SAFETY: the caller's contract on `o`.
            let row = unsafe { std::slice::from_raw_parts_mut(o.add(i * ldq), hd) };
            row.iter_mut().for_each(|v| *v *= inv);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bf16_gemm;

    /// A chunk of `n` rows at cache position `start`: two kv heads of two query heads, blocks
    /// of 128 in reverse order in the table, random k, v in +-0.5 and q in +-2.
    struct Case {
        geo: CacheGeometry,
        heads: usize,
        table: Vec<u32>,
        k: Vec<f32>,
        v: Vec<f32>,
        q: Vec<f32>,
    }

    fn case(start: usize, n: usize) -> Case {
        let (kv_heads, heads, hd, block_len) = (2, 4, 64, 128);
        let blocks = (start + n).div_ceil(block_len);
        let geo = CacheGeometry {
            kv_heads,
            head_dim: hd,
            block_len,
        };
        let cache_len = blocks * kv_heads * block_len * hd;
        let mut seed = 7u32;
        let mut next = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        Case {
            geo,
            heads,
            table: (0..blocks as u32).rev().collect(),
            k: (0..cache_len).map(|_| next()).collect(),
            v: (0..cache_len).map(|_| next()).collect(),
            q: (0..n * heads * hd).map(|_| 4.0 * next()).collect(),
        }
    }

    /// Worst |out - f32 reference| of [`case`]`(start, n)`; `amx`: the products on AMX tiles.
    fn worst_error(start: usize, n: usize, amx: bool) -> f32 {
        let Case {
            geo,
            heads,
            table,
            k,
            v,
            q,
        } = case(start, n);
        let (kv_heads, hd) = (geo.kv_heads, geo.head_dim);
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = vec![0f32; n * heads * hd];
        chunk_attention(&k, &v, geo, heads, &q, start, &table, scale, amx, &mut out);
        let mut worst = 0f32;
        for r in 0..n {
            for h in 0..heads {
                let kvh = h / (heads / kv_heads);
                let qr = &q[(r * heads + h) * hd..(r * heads + h + 1) * hd];
                let seen = start + r + 1;
                let at = |t| geo.offset(&table, kvh, t);
                let mut p: Vec<f32> = (0..seen)
                    .map(|t| {
                        qr.iter()
                            .zip(&k[at(t)..at(t) + hd])
                            .map(|(a, b)| a * b)
                            .sum::<f32>()
                    })
                    .map(|x| x * scale)
                    .collect();
                let mx = p.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                p.iter_mut().for_each(|x| *x = (*x - mx).exp());
                let sum: f32 = p.iter().sum();
                for d in 0..hd {
                    let want = (0..seen).map(|t| p[t] * v[at(t) + d]).sum::<f32>() / sum;
                    let got = out[r * heads * hd + h * hd + d];
                    worst = worst.max((got - want).abs());
                }
            }
        }
        worst
    }

    /// The tiled form (from TILED_FROM keys on) is as close to f32 math as the one-pass form:
    /// a chunk of 300 rows at position 2000 crosses several key tiles, with a partial last one
    /// and query tiles that straddle key tiles; the one-pass form runs one at position 1000.
    #[test]
    fn the_tiled_form_is_as_close_to_f32_as_the_one_pass_form() {
        if !bf16_gemm::available() {
            vlm_test_support::skip!("this CPU has no AVX512-BF16 (the bf16 kernel)");
            return;
        }
        const { assert!(1000 + 300 < TILED_FROM && 2000 + 300 >= TILED_FROM && 2300 % K_TILE != 0) };
        // On AMX too where the CPU has it (the tiles' 32-row groups of a 128-row query tile
        // each rescale their own rows).
        let paths: &[bool] = if crate::kernels::amx::available() {
            &[false, true]
        } else {
            &[false]
        };
        for &amx in paths {
            let one_pass = worst_error(1000, 300, amx);
            let tiled = worst_error(2000, 300, amx);
            // bf16 inputs (q, k, v, p: 2^-9 relative each) over values of magnitude <= 0.5.
            assert!(
                one_pass < 1e-2,
                "amx {amx}: one-pass form: worst {one_pass}"
            );
            assert!(tiled < 1e-2, "amx {amx}: tiled form: worst {tiled}");
            assert!(
                tiled < 2.0 * one_pass + 1e-3,
                "amx {amx}: tiled {tiled} vs one-pass {one_pass}"
            );
        }
    }

    /// An FP8 cache is packed as the bf16 cache of the same values (every E4M3 value is a
    /// bf16 one): the same output bits, in the one-pass and the tiled form.
    #[test]
    fn an_fp8_cache_attends_as_the_bf16_cache_of_its_values() {
        use crate::kernels::e4m3;
        use float8::F8E4M3;
        if !bf16_gemm::available() {
            vlm_test_support::skip!("this CPU has no AVX512-BF16 (the bf16 kernel)");
            return;
        }
        for (start, n) in [(100, 60), (2000, 300)] {
            let c = case(start, n);
            // Spread the values over the format's range, subnormals to hundreds.
            let codes = |x: &[f32]| -> Vec<F8E4M3> {
                let e = |(i, v): (usize, &f32)| e4m3::encode(v * (1 << (i % 10)) as f32);
                x.iter().enumerate().map(e).map(F8E4M3::from_bits).collect()
            };
            let (k8, v8) = (codes(&c.k), codes(&c.v));
            let wide = |x: &[F8E4M3]| -> Vec<half::bf16> {
                let b = |c: &F8E4M3| half::bf16::from_bits(e4m3::BF16_BITS[c.to_bits() as usize]);
                x.iter().map(b).collect()
            };
            let (k16, v16) = (wide(&k8), wide(&v8));
            let scale = 1.0 / (c.geo.head_dim as f32).sqrt() / 64.0;
            let mut outs = [vec![0f32; c.q.len()], vec![0f32; c.q.len()]];
            let (a, b) = outs.split_at_mut(1);
            let (q, t, g, h) = (&c.q, &c.table, c.geo, c.heads);
            chunk_attention(&k8, &v8, g, h, q, start, t, scale, false, &mut a[0]);
            chunk_attention(&k16, &v16, g, h, q, start, t, scale, false, &mut b[0]);
            assert_eq!(outs[0], outs[1], "chunk at {start}");
            assert!(outs[0].iter().all(|x| x.is_finite()));
        }
    }
}
