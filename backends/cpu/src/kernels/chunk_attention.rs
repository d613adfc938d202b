//! Causal attention of a prefill chunk over the paged KV cache with the bf16 kernel (models
//! whose weights are bf16, on a CPU with AVX512-BF16). Per kv head: the head's cached keys and
//! values 0..start+n are packed once, then for each of its g query heads and each tile of query
//! rows, scores = q·kᵀ (bf16 products, f32 sums), causal mask, softmax in f32, out = p·v.
//!
//! Same math as `vlm_model::text::paged_attention::attend` (reference `eager_attention_forward` with the causal mask),
//! at the reference's bf16 precision; candle's f32 form ran at ~35 GFLOP/s here, this at the
//! kernel's rate.
use crate::kernels::aligned::AlignedU16;
use crate::kernels::bf16_gemm::{gemm, BView};
use crate::kernels::packed::{pack_column, pack_inner_row, PackElem, PackedB};
use crate::kernels::softmax::softmax_scaled;
use rayon::prelude::*;
use std::cell::RefCell;
use vlm_model::text::CacheGeometry;

/// Query rows per score tile.
const Q_TILE: usize = 128;

thread_local! {
    /// Packed K, packed V (64-byte aligned for the tiles, see `aligned`), scores.
    static SCRATCH: RefCell<(AlignedU16, AlignedU16, Vec<f32>)> =
        const { RefCell::new((AlignedU16::new(), AlignedU16::new(), Vec::new())) };
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
