//! Which keys each query row attends to, and the blocked attention over candle ops (any
//! device). Scores are computed a block of query rows at a time, so no N x N matrix per head is
//! ever materialised.
//!
//! Reference: Qwen3VLVisionAttention (eager) with cu_seqlens from get_vision_attention_seqlens:
//! bidirectional attention restricted to each frame (h*w patches), scale hd^-0.5, softmax in f32.
use crate::error::Result;
use candle_core::Tensor;
use std::ops::Range;

/// Query rows `q` attend to key rows `k` (keys are never padding).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span {
    pub q: Range<usize>,
    pub k: Range<usize>,
}

/// The spans of a t x h x w grid run at `rows` >= t*h*w rows: one per frame (each frame
/// attends to itself), then, when padded, the padding rows attend to the last frame's keys
/// (they are computed and discarded; no real row ever sees a padding key).
pub fn spans_for(grid_thw: [usize; 3], rows: usize) -> Vec<Span> {
    let [t, h, w] = grid_thw;
    let frame = h * w;
    let mut spans: Vec<Span> = (0..t)
        .map(|i| Span {
            q: i * frame..(i + 1) * frame,
            k: i * frame..(i + 1) * frame,
        })
        .collect();
    let real = t * frame;
    if rows > real && real > 0 {
        spans.push(Span {
            q: real..rows,
            k: real - frame..real,
        });
    }
    spans
}

/// Budget for one block of scores, in f32 elements (heads * rows * keys): 16 Mi = 64 MiB.
pub const SCORE_BLOCK_ELEMS: usize = 16 << 20;

/// Query rows per block so that `heads * rows * keys <= budget` (at least 16, at most 1024).
pub fn query_block_rows(heads: usize, keys: usize, budget: usize) -> usize {
    let rows = budget / (heads * keys).max(1);
    (rows / 16 * 16).clamp(16, 1024)
}

/// softmax(q k^T * scale) v per span, for q, k, v of shape (H, N, hd) f32. Returns (H, N, hd).
pub fn attention_blocked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spans: &[Span],
    scale: f64,
) -> Result<Tensor> {
    let (heads, _n, _hd) = q.dims3()?;
    let mut outs = Vec::new();
    for span in spans {
        let kl = span.k.len();
        let ks = k.narrow(1, span.k.start, kl)?; // (H, kl, hd)
        let ks_t = ks.t()?; // (H, hd, kl)
        let vs = v.narrow(1, span.k.start, kl)?.contiguous()?; // (H, kl, hd)
        let block = query_block_rows(heads, kl, SCORE_BLOCK_ELEMS);
        let mut start = span.q.start;
        while start < span.q.end {
            let rows = block.min(span.q.end - start);
            let qb = q.narrow(1, start, rows)?.contiguous()?; // (H, rows, hd)
            let scores = (qb.matmul(&ks_t)? * scale)?; // (H, rows, kl)
            let probs = candle_nn::ops::softmax_last_dim(&scores)?;
            outs.push(probs.matmul(&vs)?); // (H, rows, hd)
            start += rows;
        }
    }
    Ok(Tensor::cat(&outs, 1)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_cover_rows_and_never_see_padding() {
        let s = spans_for([2, 2, 4], 20);
        assert_eq!(
            s,
            vec![
                Span { q: 0..8, k: 0..8 },
                Span { q: 8..16, k: 8..16 },
                Span {
                    q: 16..20,
                    k: 8..16
                }
            ]
        );
        assert_eq!(spans_for([1, 2, 2], 4), vec![Span { q: 0..4, k: 0..4 }]);
    }

    #[test]
    fn block_rows_are_bounded() {
        assert_eq!(query_block_rows(16, 16384, SCORE_BLOCK_ELEMS), 64);
        assert_eq!(query_block_rows(2, 10, SCORE_BLOCK_ELEMS), 1024);
    }
}
