//! Attention of one decode token per row over the paged KV cache, on the cache's memory
//! directly: per (row, kv head), the g query heads of the group score every cached key of the
//! row's blocks, softmax, and sum the values. One rayon task per (row, kv head); no tensors
//! are built per block (the candle form of `attention.rs` costs a dozen small ops per row,
//! block and layer, which dominated decode steps at batch 8).
//!
//! Same math as `vlm_model::text::paged_attention::attend` with n = 1: softmax(q·kᵀ · scale) v over cache indices
//! [0, ctx], f32 (the AVX-512 `exp` of `cpu::softmax`, ~2e-7 relative); a bf16 cache's keys
//! and values are widened exactly. Keys and values are read in runs of consecutive positions
//! inside a block, four rows per pass, once for the g query heads of the kv head
//! (`cpu::vec::CacheElem`).
use super::softmax::softmax_scaled;
use super::vec::CacheElem;
use rayon::prelude::*;
use vlm_model::text::CacheGeometry;

thread_local! {
    /// One task's scores, (g, ctx + 1): reused, not allocated per row, head and layer.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// q: (n, heads, hd); rows[r] = Some((ctx, table)) attends to cache indices 0..=ctx of the
/// sequence with block table `table`; `None` rows are padding (their output is zero).
/// out: (n, heads * hd).
#[allow(clippy::too_many_arguments)]
pub fn decode_attention<T: CacheElem>(
    k_cache: &[T],
    v_cache: &[T],
    geo: CacheGeometry,
    heads: usize,
    q: &[f32],
    rows: &[Option<(usize, &[u32])>],
    scale: f32,
    out: &mut [f32],
) {
    let (kv_heads, hd) = (geo.kv_heads, geo.head_dim);
    let g = heads / kv_heads;
    // out as (n * kv_heads) chunks of (g, hd): chunk r * kv_heads + kvh.
    out.par_chunks_mut(g * hd).enumerate().for_each(|(idx, o)| {
        let (r, kvh) = (idx / kv_heads, idx % kv_heads);
        o.fill(0.0);
        let Some((ctx, table)) = rows[r] else {
            return;
        };
        let total = ctx + 1;
        let qs = &q[(r * heads + kvh * g) * hd..(r * heads + (kvh + 1) * g) * hd];
        // Runs of consecutive cache indices inside one block: contiguous (run, hd) memory.
        let runs = || {
            let mut t = 0;
            std::iter::from_fn(move || {
                (t < total).then(|| {
                    let run = (geo.block_len - t % geo.block_len).min(total - t);
                    let at = geo.offset(table, kvh, t);
                    t += run;
                    (t - run, run, at)
                })
            })
        };
        SCORES.with(|p| {
            let mut p = p.borrow_mut();
            p.clear();
            p.resize(g * total, 0.0);
            // Scores of the g query heads side by side, (g, total): each run of keys is
            // read and widened once for the g heads.
            for (t, run, at) in runs() {
                T::dots(qs, hd, &k_cache[at..at + run * hd], &mut p[t..], total);
            }
            for row in p.chunks_exact_mut(total) {
                softmax_scaled(row, scale);
            }
            for (t, run, at) in runs() {
                T::weighted_sum(&p[t..], total, &v_cache[at..at + run * hd], o, hd);
            }
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::e4m3;
    use crate::kernels::vec::Widen;
    use float8::F8E4M3;

    /// An FP8 cache's keys and values are widened exactly: decode attention over it gives the
    /// bits it gives over the f32 cache of the same values (two rows of other lengths, one
    /// padding row, two kv heads of two query heads).
    #[test]
    fn an_fp8_cache_attends_as_the_f32_cache_of_its_values() {
        let (kv_heads, heads, hd, block_len) = (2, 4, 32, 16);
        let geo = CacheGeometry {
            kv_heads,
            head_dim: hd,
            block_len,
        };
        let blocks = 6;
        let len = blocks * kv_heads * block_len * hd;
        let mut seed = 11u32;
        let mut next = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        let k8: Vec<F8E4M3> = (0..len)
            .map(|i| F8E4M3::from_bits(e4m3::encode(next() * (1 << (i % 9)) as f32)))
            .collect();
        let v8: Vec<F8E4M3> = (0..len)
            .map(|_| F8E4M3::from_bits(e4m3::encode(8.0 * next())))
            .collect();
        let (k32, v32): (Vec<f32>, Vec<f32>) = (
            k8.iter().map(|c| c.f32()).collect(),
            v8.iter().map(|c| c.f32()).collect(),
        );
        let q: Vec<f32> = (0..3 * heads * hd).map(|_| next()).collect();
        let (t0, t1) = ([4u32, 0, 2], [1u32, 5]);
        let rows = [Some((40, &t0[..])), None, Some((17, &t1[..]))];
        let scale = 1.0 / (hd as f32).sqrt() / 16.0;
        let mut out8 = vec![0f32; q.len()];
        let mut out32 = vec![0f32; q.len()];
        decode_attention(&k8, &v8, geo, heads, &q, &rows, scale, &mut out8);
        decode_attention(&k32, &v32, geo, heads, &q, &rows, scale, &mut out32);
        assert_eq!(out8, out32);
        assert!(out8[..heads * hd].iter().any(|&x| x != 0.0));
    }
}
