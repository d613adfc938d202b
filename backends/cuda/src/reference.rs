//! The decode kernel's algorithm on the host, step for step (per split: an online softmax over
//! every `DECODE_WARPS`-th token per warp, warps merged, then the splits combined), so that its
//! indexing through the block tables and its split arithmetic are checked on the CPU against
//! plain softmax attention. The GPU check (`tests/gpu_parity.rs`) compares the kernel itself to
//! the generic path and the golden outputs.
use crate::layout::DecodeLayout;
use crate::select::{DecodeLaunch, DECODE_WARPS};

/// The cache geometry: K and V each (blocks, kv_heads, block_len, head_dim), f32 here.
#[derive(Debug, Clone, Copy)]
pub struct Geometry {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_len: usize,
}

/// out (rows, heads, head_dim) for q (rows, heads, head_dim), as `paged_decode` then
/// `paged_decode_combine` compute it.
pub fn paged_decode(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    layout: &DecodeLayout,
    launch: &DecodeLaunch,
    g: Geometry,
    scale: f32,
) -> Vec<f32> {
    let rows = layout.ctx_lens.len();
    let hd = g.head_dim;
    let splits = launch.splits();
    let mut out = vec![0f32; rows * g.heads * hd];
    for b in 0..rows {
        let ctx = layout.ctx_lens[b] as usize;
        let tbl = &layout.tables[b * layout.max_blocks..(b + 1) * layout.max_blocks];
        for h in 0..g.heads {
            let kvh = h / (g.heads / g.kv_heads);
            let qh = &q[(b * g.heads + h) * hd..][..hd];
            // (acc, m, l) per split.
            let mut parts = Vec::with_capacity(splits);
            for s in 0..splits {
                let t0 = s * launch.split_len as usize;
                let t1 = ctx.min(t0 + launch.split_len as usize);
                let mut warps = Vec::new();
                for w in 0..DECODE_WARPS as usize {
                    let (mut m, mut l, mut acc) = (f32::NEG_INFINITY, 0f32, vec![0f32; hd]);
                    let mut t = t0 + w;
                    while t < t1 {
                        let base = ((tbl[t / g.block_len] as usize * g.kv_heads + kvh)
                            * g.block_len
                            + t % g.block_len)
                            * hd;
                        let dot: f32 = (0..hd).map(|d| qh[d] * scale * k[base + d]).sum();
                        let m_new = m.max(dot);
                        let corr = (m - m_new).exp();
                        let p = (dot - m_new).exp();
                        l = l * corr + p;
                        for d in 0..hd {
                            acc[d] = acc[d] * corr + p * v[base + d];
                        }
                        m = m_new;
                        t += DECODE_WARPS as usize;
                    }
                    warps.push((acc, m, l));
                }
                parts.push(merge(&warps, hd));
            }
            let (acc, _, l) = merge(&parts, hd);
            for d in 0..hd {
                out[(b * g.heads + h) * hd + d] = if l > 0.0 { acc[d] / l } else { 0.0 };
            }
        }
    }
    out
}

/// Partials rescaled to their common max and summed (a partial with no token has m = -inf).
fn merge(parts: &[(Vec<f32>, f32, f32)], hd: usize) -> (Vec<f32>, f32, f32) {
    let m = parts.iter().map(|p| p.1).fold(f32::NEG_INFINITY, f32::max);
    let (mut acc, mut l) = (vec![0f32; hd], 0f32);
    for (pa, pm, pl) in parts {
        let c = if *pm == f32::NEG_INFINITY {
            0.0
        } else {
            (pm - m).exp()
        };
        l += pl * c;
        for d in 0..hd {
            acc[d] += pa[d] * c;
        }
    }
    (acc, m, l)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::decode_layout;
    use crate::select::decode_launch;

    /// Deterministic values in [-1, 1).
    fn fill(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// softmax(q·kᵀ·scale)·v over a contiguous copy of each row's tokens.
    fn plain(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        rows: &[Option<(usize, &[u32])>],
        g: Geometry,
        scale: f32,
    ) -> Vec<f32> {
        let hd = g.head_dim;
        let mut out = vec![0f32; rows.len() * g.heads * hd];
        for (b, row) in rows.iter().enumerate() {
            let Some((ctx, tbl)) = row else { continue };
            for h in 0..g.heads {
                let kvh = h / (g.heads / g.kv_heads);
                let at = |t: usize| {
                    ((tbl[t / g.block_len] as usize * g.kv_heads + kvh) * g.block_len
                        + t % g.block_len)
                        * hd
                };
                let qh = &q[(b * g.heads + h) * hd..][..hd];
                let scores: Vec<f32> = (0..=*ctx)
                    .map(|t| (0..hd).map(|d| qh[d] * k[at(t) + d]).sum::<f32>() * scale)
                    .collect();
                let mx = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = scores.iter().map(|s| (s - mx).exp()).collect();
                let z: f32 = e.iter().sum();
                for d in 0..hd {
                    out[(b * g.heads + h) * hd + d] =
                        (0..=*ctx).map(|t| e[t] * v[at(t) + d]).sum::<f32>() / z;
                }
            }
        }
        out
    }

    #[test]
    fn split_decode_through_block_tables_matches_plain_attention() {
        let g = Geometry {
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            block_len: 8,
        };
        let blocks = 12;
        let dummy = blocks as u32 - 1;
        let per_block = g.kv_heads * g.block_len * g.head_dim;
        let (k, v) = (fill(blocks * per_block, 1), fill(blocks * per_block, 2));
        // Scattered, non-monotonic tables; one padding row; contexts across block edges.
        let t0 = [4u32, 0, 9, 2, 7, 5, 1, 3];
        let t1 = [8u32];
        let t2 = [6u32, 10];
        let rows = [
            Some((60, &t0[..])),
            Some((3, &t1[..])),
            None,
            Some((8, &t2[..])),
        ];
        let q = fill(rows.len() * g.heads * g.head_dim, 3);
        let scale = 1.0 / (g.head_dim as f32).sqrt();
        let layout = decode_layout(&rows, g.block_len, dummy).unwrap();
        let want = plain(&q, &k, &v, &rows, g, scale);
        // No split, and splits of every size down to one token.
        for sms in [1, 8, 64, 1000] {
            let launch = decode_launch(g.heads, rows.len(), layout.max_ctx, sms).unwrap();
            for split_len in [launch.split_len, 1, 7] {
                let launch = DecodeLaunch {
                    split_len,
                    grid: (
                        launch.grid.0,
                        launch.grid.1,
                        (layout.max_ctx as u32).div_ceil(split_len),
                    ),
                    ..launch
                };
                let got = paged_decode(&q, &k, &v, &layout, &launch, g, scale);
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (a - b).abs() < 1e-5,
                        "{sms} SMs, split {split_len}: [{i}] {a} vs {b}"
                    );
                }
            }
        }
        // The padding row is zeros.
        let row2 = 2 * g.heads * g.head_dim;
        let launch = decode_launch(g.heads, rows.len(), layout.max_ctx, 64).unwrap();
        let got = paged_decode(&q, &k, &v, &layout, &launch, g, scale);
        assert!(got[row2..row2 + g.heads * g.head_dim]
            .iter()
            .all(|&x| x == 0.0));
    }
}
