//! Attention of one decode token per row over the paged KV cache, on the cache's memory
//! directly: per (row, kv head), the g query heads of the group score every cached key of the
//! row's blocks, softmax, and sum the values. One rayon task per (row, kv head); no tensors
//! are built per block (the candle form of `attention.rs` costs a dozen small ops per row,
//! block and layer, which dominated decode steps at batch 8).
//!
//! Same math as `vlm_model::text::paged_attention::attend` with n = 1: softmax(q·kᵀ · scale) v over cache indices
//! [0, ctx], f32 (the AVX-512 `exp` of `cpu::softmax`, ~2e-7 relative); a bf16 cache's keys
//! and values are widened exactly. Keys and values are read in runs of consecutive positions
//! inside a block, four rows per pass (`cpu::vec::CacheElem`).
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
            for (t, run, at) in runs() {
                let keys = &k_cache[at..at + run * hd];
                for j in 0..g {
                    let qj = &qs[j * hd..(j + 1) * hd];
                    T::dots(qj, keys, &mut p[j * total + t..j * total + t + run]);
                }
            }
            for row in p.chunks_exact_mut(total) {
                softmax_scaled(row, scale);
            }
            for (t, run, at) in runs() {
                let values = &v_cache[at..at + run * hd];
                for j in 0..g {
                    let pj = &p[j * total + t..j * total + t + run];
                    T::weighted_sum(pj, values, &mut o[j * hd..(j + 1) * hd]);
                }
            }
        });
    });
}
