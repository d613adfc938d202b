//! Rotary position embedding of q and k, split per head (packed for the bf16 products).
use crate::kernels::bf16_gemm::to_bf16;
use crate::kernels::packed::NR;
use crate::kernels::{PackedB, SendPtr};
use rayon::prelude::*;

/// out = rope(src + b) * mult over one head row (rotate-half form, cos/sin of the row's
/// position; reference `apply_rotary_pos_emb_vision`).
#[inline]
pub(super) fn rope_row(src: &[f32], b: &[f32], c: &[f32], s: &[f32], mult: f32, out: &mut [f32]) {
    let half = src.len() / 2;
    for j in 0..half {
        let (x1, x2) = (src[j] + b[j], src[j + half] + b[j + half]);
        out[j] = (x1 * c[j] - x2 * s[j]) * mult;
        out[j + half] = (x2 * c[j] + x1 * s[j]) * mult;
    }
}

/// The rotary tables of a run, (rows, hd/2) each, and the scale q is multiplied by.
pub(super) struct RopeTables<'a> {
    pub(super) cos: &'a [f32],
    pub(super) sin: &'a [f32],
    pub(super) scale: f32,
}

/// Rows of one [`rope_split`] task: a packed K panel's worth, so that each task writes whole
/// panels of K and whole pairs of V rows of its own.
pub(super) const ROPE_ROWS: usize = crate::kernels::packed::NR;

/// qkv (rows, 3D) + bias -> q (H, rows, hd) roped and scaled, k roped and v, per head: f32, or
/// packed for the bf16 kernel in each head's slot when `packed` (see [`head_kv`]). Parallel over
/// blocks of rows, each row read once front to back (a pass per head read every row's 12 KB at
/// 256-byte pieces, ~7% of a 1024-patch run spent waiting on those lines).
#[allow(clippy::too_many_arguments)]
pub(super) fn rope_split(
    qkv: &[f32],
    bias: &[f32],
    t: &RopeTables<'_>,
    q: &mut [f32],
    k: &mut [f32],
    v: &mut [f32],
    heads: usize,
    hd: usize,
    packed: bool,
) {
    let d = heads * hd;
    let rows = q.len() / d;
    let half = hd / 2;
    let (qp, kp, vp) = (
        SendPtr(q.as_mut_ptr()),
        SendPtr(k.as_mut_ptr()),
        SendPtr(v.as_mut_ptr()),
    );
    (0..rows.div_ceil(ROPE_ROWS))
        .into_par_iter()
        .for_each(|blk| {
            let (mut krow, mut vrow) = (vec![0f32; hd], vec![0f32; hd]);
            let (r0, r1) = (blk * ROPE_ROWS, ((blk + 1) * ROPE_ROWS).min(rows));
            // bf16 K and V of the block's rows (every head), rounded by the vector conversion,
            // packed per head once the block is done (see `pack_block`).
            let (mut kbits, mut vbits) = if packed {
                (vec![0u16; (r1 - r0) * d], vec![0u16; (r1 - r0) * d])
            } else {
                (Vec::new(), Vec::new())
            };
            for r in r0..r1 {
                let row = &qkv[r * 3 * d..(r + 1) * 3 * d];
                let (c, s) = (
                    &t.cos[r * half..(r + 1) * half],
                    &t.sin[r * half..(r + 1) * half],
                );
                for head in 0..heads {
                    let (qo, ko, vo) = (head * hd, d + head * hd, 2 * d + head * hd);
                    let at = head * rows * hd + r * hd;
                    // SAFETY (all writes below): q, k and v hold (H, rows, hd); this task
                    // writes rows r0..r1 of every head alone.
                    let q_out = unsafe { std::slice::from_raw_parts_mut(qp.get().add(at), hd) };
                    rope_row(&row[qo..qo + hd], &bias[qo..qo + hd], c, s, t.scale, q_out);
                    rope_row(&row[ko..ko + hd], &bias[ko..ko + hd], c, s, 1.0, &mut krow);
                    for ((o, &sv), &bv) in vrow
                        .iter_mut()
                        .zip(&row[vo..vo + hd])
                        .zip(&bias[vo..vo + hd])
                    {
                        *o = sv + bv;
                    }
                    if packed {
                        let at = (r - r0) * d + head * hd;
                        to_bf16(&krow, &mut kbits[at..at + hd]);
                        to_bf16(&vrow, &mut vbits[at..at + hd]);
                    } else {
                        unsafe {
                            std::slice::from_raw_parts_mut(kp.get().add(at), hd)
                                .copy_from_slice(&krow);
                            std::slice::from_raw_parts_mut(vp.get().add(at), hd)
                                .copy_from_slice(&vrow);
                        }
                    }
                }
            }
            if packed {
                for head in 0..heads {
                    // SAFETY: the head's slot holds 2 * rows * hd u16 (see `head_kv`); this
                    // task writes the K panel of rows r0..r1 and the V pairs of those rows.
                    unsafe {
                        let slot = head * 2 * rows * hd;
                        let k16 = (kp.get() as *mut u16).add(slot);
                        let v16 = (vp.get() as *mut u16).add(slot);
                        pack_block(&kbits, &vbits, d, head * hd, hd, r0, r1, rows, k16, v16);
                    }
                }
            }
        });
}

/// Rows r0..r1 (one K panel: r0 a multiple of `NR`, at most `NR` rows) of one head into its
/// packed K ((keys, hd) as B of q·kᵀ) and V ((hd, keys) as B of p·v), from `kbits` and `vbits`
/// (the block's rows of every head, row stride `d`, this head's values from `col`). Both
/// packings are written front to back, a whole panel row at a time (writing each row of the
/// block as it came scattered its values over every head's panels: ~half of the split's time).
/// The layout is `packed`'s ([`crate::kernels::packed::pack_column`] for K,
/// [`crate::kernels::packed::pack_inner_row`] for V), written here a pair row at a time: the
/// same block through those two, a value at a time, took 0.053-0.075 s at 1024 patches against
/// 0.044-0.051 (`cargo bench -p vlm-backends --bench vision -- --modes bf16 --profile`).
///
/// # Safety
/// `k16` and `v16` must be valid for packings of (rows, hd) and (hd, rows), and no one else may
/// write the K panel of rows r0..r1 or the V pairs of those rows.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pack_block(
    kbits: &[u16],
    vbits: &[u16],
    d: usize,
    col: usize,
    hd: usize,
    r0: usize,
    r1: usize,
    rows: usize,
    k16: *mut u16,
    v16: *mut u16,
) {
    let n = r1 - r0;
    fn row(bits: &[u16], r: usize, d: usize, col: usize, hd: usize) -> &[u16] {
        &bits[r * d + col..r * d + col + hd]
    }
    // K: panel r0 / NR; its pair row i holds, for each key c, the values 2i and 2i + 1.
    let panel = unsafe { k16.add((r0 / NR) * PackedB::len_for(NR, hd)) };
    for i in 0..hd.div_ceil(2) {
        let out = unsafe { std::slice::from_raw_parts_mut(panel.add(i * 2 * NR), 2 * n) };
        for (c, pair) in out.chunks_exact_mut(2).enumerate() {
            let key = row(kbits, c, d, col, hd);
            pair[0] = key[2 * i];
            pair[1] = if 2 * i + 1 < hd { key[2 * i + 1] } else { 0 };
        }
    }
    // V: inner index = key; keys 2p and 2p + 1 interleave in pair row p of each panel.
    let panel_len = PackedB::len_for(NR, rows);
    for p in (r0 / 2)..r1.div_ceil(2) {
        let (a, b) = (2 * p - r0, 2 * p + 1 - r0);
        for j0 in (0..hd).step_by(NR) {
            let w = NR.min(hd - j0);
            let out = unsafe {
                std::slice::from_raw_parts_mut(v16.add((j0 / NR) * panel_len + p * 2 * NR), 2 * w)
            };
            let first = &row(vbits, a, d, col, hd)[j0..j0 + w];
            if b < n {
                let second = &row(vbits, b, d, col, hd)[j0..j0 + w];
                for ((o, &x), &y) in out.chunks_exact_mut(2).zip(first).zip(second) {
                    o[0] = x;
                    o[1] = y;
                }
            } else {
                for (o, &x) in out.chunks_exact_mut(2).zip(first) {
                    o[0] = x;
                }
            }
        }
    }
}
