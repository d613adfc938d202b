//! One attention task on AMX tiles, fused flash-attention style: for a block of query rows of
//! one head and a range of keys, `out = softmax(q · kᵀ) · v` with q·kᵀ and p·v on the tiles
//! (bf16 operands, f32 sums) and the online softmax in f32 between them.
//!
//! Why fused: through [`super::bf16_gemm`], the scores of a 256 x 512 tile go to L2 and come
//! back twice (softmax, then p as the left operand of p·v), and each 32x32 block of q·kᵀ
//! (only hd / 32 tile steps deep) pays the GEMM's per-panel costs. Here the query block is
//! taken 32 rows at a time against a chunk of keys: the 32 x `chunk` scores and their bf16
//! probabilities stay in L1/L2 next to the core, the chunk's K and V stay in L2 while every 32-row group of the
//! block passes over them, and the p·v partial sums are folded into the running output with
//! the softmax correction in one pass.
//!
//! Same math as the unfused path (`vision::engine::attention_bf16`): q rounded to bf16, scores
//! in f32, p = exp(s - m) rounded to bf16 (the sum `l` over the f32 values), output / l at
//! the end.
use super::aligned::AlignedU16;
use super::amx::{TILE_PAIRS, TILE_ROWS};
use super::bf16_gemm::BView;
use super::packed::NR;
use std::cell::RefCell;
use std::ops::Range;

/// Query rows per tile group (two 16-row tiles).
const GROUP: usize = 2 * TILE_ROWS;
/// Keys per chunk: a group's 32 x 512 f32 scores (66 KiB) and bf16 p (34 KiB) stay in L1/L2
/// (256 keys fit L1 but measured slower: twice the per-row softmax reductions; 384 and 1024
/// no better).
const CHUNK: usize = 512;
/// Row strides (in elements) of the scores and p buffers: one cache line past the row, so that
/// the rows a tile stores or loads do not share an L1 set.
const LS: usize = CHUNK + 16;
const LP: usize = CHUNK + 32;

/// Whether [`attend`] takes a head of width `hd` over a bucket of `rows` keys: AMX allowed
/// (`amx`, the backend's option) and granted, whole 32-wide tile steps in the head, and whole
/// 32-key panels in the bucket (so that chunks rounded out to panels stay inside the packed K
/// and V).
pub fn supported(amx: bool, rows: usize, hd: usize) -> bool {
    amx && super::amx::available()
        && hd > 0
        && hd.is_multiple_of(2 * TILE_PAIRS)
        && hd.is_multiple_of(NR)
        && rows.is_multiple_of(NR)
}

/// Per-thread buffers: q block as bf16, running output, softmax state (m, l per row; corr per
/// group row), one group's scores, p and p·v partial sums.
#[derive(Default)]
struct Scratch {
    /// 64-byte aligned (q and p are tile-loaded, see `aligned`).
    q: AlignedU16,
    o: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    corr: Vec<f32>,
    s: Vec<f32>,
    p: AlignedU16,
    pv: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// `out[r] = softmax(q[r] · kᵀ over keys) · v` for the `bq` query rows of `q` (f32, `hd` per
/// row, already scaled), written as `bq` rows of `hd` at row stride `ldo`. `k` is the head's
/// packed K (n = bucket rows, k = hd), `v` its packed V (n = hd, k = bucket rows); `keys` a
/// range inside the bucket.
///
/// # Safety
/// [`supported`]`(k.n(), hd)` must hold; `out` must be valid for writes of `bq` rows of `hd`
/// f32 at stride `ldo`, touched by no one else meanwhile.
#[allow(clippy::too_many_arguments)]
pub unsafe fn attend(
    q: &[f32],
    bq: usize,
    hd: usize,
    k: BView<'_>,
    v: BView<'_>,
    keys: Range<usize>,
    out: *mut f32,
    ldo: usize,
) {
    assert!(q.len() >= bq * hd && keys.end <= k.n() && !keys.is_empty());
    let rows_p = bq.next_multiple_of(GROUP);
    let groups = rows_p / GROUP;
    let (qk_steps, v_panels) = (hd / (2 * TILE_PAIRS), hd / NR);
    // Keys rounded out to whole panels; columns outside `keys` are masked.
    let (ext0, ext1) = (keys.start / NR * NR, keys.end.next_multiple_of(NR));
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        let s = &mut *s;
        fit_aligned(&mut s.q, rows_p * hd);
        fit(&mut s.o, rows_p * hd);
        fit(&mut s.m, rows_p);
        fit(&mut s.l, rows_p);
        fit(&mut s.corr, GROUP);
        fit(&mut s.s, GROUP * LS);
        fit_aligned(&mut s.p, GROUP * LP);
        fit(&mut s.pv, GROUP * hd);
        for r in 0..rows_p {
            let dst = &mut s.q[r * hd..(r + 1) * hd];
            if r < bq {
                super::bf16_gemm::to_bf16(&q[r * hd..(r + 1) * hd], dst);
            } else {
                dst.fill(0);
            }
        }
        s.m[..rows_p].fill(f32::NEG_INFINITY);
        s.l[..rows_p].fill(0.0);
        // SAFETY: `supported` held (tiles granted); every tile read lies inside q (rows_p rows),
        // the K panels ext0..ext1 and V pairs ext0..ext1 (inside the bucket), s and p.
        unsafe { super::amx::configure() };
        let mut t0 = ext0;
        while t0 < ext1 {
            let w = CHUNK.min(ext1 - t0);
            let (lo, hi) = (keys.start.saturating_sub(t0), (keys.end - t0).min(w));
            let first = t0 == ext0;
            for g in 0..groups {
                let qg = s.q[g * GROUP * hd..].as_ptr();
                // SAFETY: see above.
                if hd == 64 {
                    // The ViT's head width (1024 / 16): q stays in four tiles.
                    unsafe {
                        super::amx::qk_32_hd64(
                            qg,
                            hd,
                            k.panel(t0 / NR),
                            k.panel_stride(),
                            w / NR,
                            s.s.as_mut_ptr(),
                            LS,
                        )
                    };
                } else {
                    for p in 0..w / NR {
                        unsafe {
                            super::amx::tiles_32(
                                qk_steps,
                                qg,
                                hd,
                                k.panel(t0 / NR + p),
                                s.s[p * NR..].as_mut_ptr(),
                                LS,
                                super::amx::BPrefetch::NONE,
                            )
                        };
                    }
                }
                let (m, l) = (
                    &mut s.m[g * GROUP..(g + 1) * GROUP],
                    &mut s.l[g * GROUP..(g + 1) * GROUP],
                );
                for i in 0..GROUP {
                    let row = &mut s.s[i * LS..i * LS + w];
                    row[..lo].fill(f32::NEG_INFINITY);
                    row[hi..].fill(f32::NEG_INFINITY);
                    let p = &mut s.p[i * LP..i * LP + w];
                    super::softmax::online_softmax_tile_bf16(
                        row,
                        p,
                        &mut m[i],
                        &mut l[i],
                        &mut s.corr[i],
                    );
                    p[..lo].fill(0);
                    p[hi..].fill(0);
                }
                for vp in 0..v_panels {
                    unsafe {
                        super::amx::tiles_32(
                            w / (2 * TILE_PAIRS),
                            s.p.as_ptr(),
                            LP,
                            v.panel(vp).add(t0 * NR),
                            s.pv[vp * NR..].as_mut_ptr(),
                            hd,
                            super::amx::BPrefetch::NONE,
                        )
                    };
                }
                let o = &mut s.o[g * GROUP * hd..(g + 1) * GROUP * hd];
                for (i, (orow, pv)) in o
                    .chunks_exact_mut(hd)
                    .zip(s.pv.chunks_exact(hd))
                    .enumerate()
                {
                    if first {
                        orow.copy_from_slice(pv);
                    } else {
                        super::vec::scale_add(orow, s.corr[i], pv);
                    }
                }
            }
            t0 += w;
        }
        for r in 0..bq {
            let inv = 1.0 / s.l[r];
            // SAFETY: the caller's contract on `out`.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.add(r * ldo), hd) };
            for (d, &o) in dst.iter_mut().zip(&s.o[r * hd..(r + 1) * hd]) {
                *d = o * inv;
            }
        }
    });
}

fn fit<T: Default + Clone>(v: &mut Vec<T>, len: usize) {
    if v.len() < len {
        v.resize(len, T::default());
    }
}

fn fit_aligned(v: &mut AlignedU16, len: usize) {
    if v.len() < len {
        v.resize(len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::packed::{pack_column, pack_inner_row, PackedB};

    /// A deterministic pseudo-random value in [-1, 1).
    fn rnd(i: usize, salt: usize) -> f32 {
        let x = (i.wrapping_mul(2654435761) ^ salt.wrapping_mul(40503)) % 10007;
        x as f32 / 5003.5 - 1.0
    }

    fn bf16(x: f32) -> f32 {
        f32::from_bits((crate::kernels::packed::bf16_bits(x) as u32) << 16)
    }

    /// Packs (rows, hd) K and V the way the ViT engine does.
    fn pack(k: &[f32], v: &[f32], rows: usize, hd: usize) -> (Vec<u16>, Vec<u16>) {
        let mut k16 = vec![0u16; PackedB::len_for(rows, hd)];
        let mut v16 = vec![0u16; PackedB::len_for(hd, rows)];
        for r in 0..rows {
            pack_column(&mut k16, hd, r, &k[r * hd..(r + 1) * hd]);
            pack_inner_row(&mut v16, rows, r, &v[r * hd..(r + 1) * hd]);
        }
        (k16, v16)
    }

    #[test]
    fn fused_attention_matches_softmax_of_bf16_products() {
        if !supported(true, 64, 64) {
            vlm_test_support::skip!("no AMX-BF16 on this CPU (the fused AMX attention)");
            return;
        }
        // hd 64 runs the resident-q kernel, hd 32 the generic tiles.
        for (rows, hd) in [(320usize, 64usize), (320, 32)] {
            let q: Vec<f32> = (0..rows * hd).map(|i| rnd(i, 1) * 0.4).collect();
            let k: Vec<f32> = (0..rows * hd).map(|i| rnd(i, 2)).collect();
            let v: Vec<f32> = (0..rows * hd).map(|i| rnd(i, 3)).collect();
            let (k16, v16) = pack(&k, &v, rows, hd);
            let (kv, vv) = (
                BView::new(&k16, rows, hd).with_amx(true),
                BView::new(&v16, hd, rows).with_amx(true),
            );
            // Query blocks and key ranges off the 32-row grid, within one chunk and across two.
            for (q0, bq, keys) in [
                (0, 40, 0..44),
                (37, 19, 21..300),
                (100, 64, 3..320),
                (5, 300, 0..320),
            ] {
                let mut out = vec![f32::NAN; bq * hd];
                unsafe {
                    attend(
                        &q[q0 * hd..(q0 + bq) * hd],
                        bq,
                        hd,
                        kv,
                        vv,
                        keys.clone(),
                        out.as_mut_ptr(),
                        hd,
                    )
                };
                let mut worst = 0f32;
                for r in 0..bq {
                    let qr = &q[(q0 + r) * hd..(q0 + r + 1) * hd];
                    let s: Vec<f32> = keys
                        .clone()
                        .map(|j| (0..hd).map(|c| bf16(qr[c]) * bf16(k[j * hd + c])).sum())
                        .collect();
                    let mx = s.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                    let e: Vec<f32> = s.iter().map(|&x| (x - mx).exp()).collect();
                    let l: f32 = e.iter().sum();
                    for c in 0..hd {
                        let want: f32 = keys
                            .clone()
                            .zip(&e)
                            .map(|(j, &p)| bf16(p) * bf16(v[j * hd + c]))
                            .sum::<f32>()
                            / l;
                        worst = worst.max((out[r * hd + c] - want).abs());
                    }
                }
                assert!(
                    worst < 2e-3,
                    "hd {hd} q0 {q0} bq {bq} keys {keys:?}: max abs diff {worst}"
                );
            }
        }
    }
}
