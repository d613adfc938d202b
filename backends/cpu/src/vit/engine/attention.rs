//! The ViT's attention: blocked f32 with an online softmax, bf16 products on packed K/V, or
//! AMX tiles fused.
use crate::kernels::packed::NR;
use crate::kernels::vit_ops::{gemm_f32, online_softmax_tile, Mat};
use crate::kernels::{AlignedU16, PackedB, SendPtr};
use crate::options::CpuOptions;
use rayon::prelude::*;
use std::cell::RefCell;
use vlm_model::vision::Span;

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The bf16 path's probabilities, rounded as the softmax writes them (rows padded by one
    /// cache line, see `bf16_gemm::gemm_bf16_a`).
    static PROBS: RefCell<AlignedU16> = const { RefCell::new(AlignedU16::new()) };
}

/// Attention over the per-head q (roped, scaled), k (roped), v, each (H, rows, hd), into `out`
/// (rows, D): per span, per head, per tile of query rows, over tiles of keys with an online
/// softmax (reference math: softmax(q k^T * scale) v over the span's keys).
#[allow(clippy::too_many_arguments)]
pub(super) fn attention(
    ws_q: &[f32],
    kv: KeysValues<'_>,
    out: &mut [f32],
    rows: usize,
    heads: usize,
    hd: usize,
    spans: &[Span],
    opts: &CpuOptions,
) {
    let (ws_k, ws_v) = match kv {
        KeysValues::F32 { k, v } => (k, v),
        KeysValues::Packed { k, v } => {
            #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
            if crate::kernels::attention_amx::supported(opts.amx, rows, hd) {
                return attention_amx(ws_q, k, v, out, rows, heads, hd, spans, opts);
            }
            return attention_bf16(ws_q, k, v, out, rows, heads, hd, spans, opts);
        }
    };
    let d = heads * hd;
    let (q_tile, k_tile) = opts.attention_tiles;
    let tasks = attention_tasks(spans, heads, q_tile);
    let out_ptr = SendPtr(out.as_mut_ptr());
    tasks.into_par_iter().for_each(|(head, q0, q1, keys)| {
        let bq = q1 - q0;
        let base = head * rows * hd;
        with_softmax_scratch(bq, k_tile, |scores, m, l, corr| {
            // SAFETY (all raw accesses below): q, k, v hold (H, rows, hd) and the ranges lie
            // inside; each task writes only its own block (rows q0..q1, columns head*hd..+hd)
            // of `out`, which has row stride d.
            let o = unsafe { out_ptr.get().add(q0 * d + head * hd) };
            let mut k0 = keys.start;
            let mut first = true;
            while k0 < keys.end {
                let kl = k_tile.min(keys.end - k0);
                let tile = &mut scores[..bq * kl];
                unsafe {
                    // tile (bq, kl) = q (bq, hd) . k^T (hd, kl)
                    gemm_f32(
                        bq,
                        kl,
                        hd,
                        tile.as_mut_ptr(),
                        kl,
                        false,
                        Mat {
                            ptr: ws_q.as_ptr().add(base + q0 * hd),
                            row_stride: hd,
                        },
                        ws_k.as_ptr().add(base + k0 * hd),
                        1,
                        hd,
                        1,
                    );
                }
                for (i, row) in tile.chunks_exact_mut(kl).enumerate() {
                    online_softmax_tile(row, &mut m[i], &mut l[i], &mut corr[i]);
                }
                if !first {
                    // SAFETY: this task's output block, bq rows of hd at stride d.
                    unsafe { scale_rows(o, d, hd, &corr[..bq]) };
                }
                unsafe {
                    // out (bq, hd) [+]= p (bq, kl) . v (kl, hd)
                    gemm_f32(
                        bq,
                        hd,
                        kl,
                        o,
                        d,
                        !first,
                        Mat {
                            ptr: tile.as_ptr(),
                            row_stride: kl,
                        },
                        ws_v.as_ptr().add(base + k0 * hd),
                        hd,
                        1,
                        1,
                    );
                }
                first = false;
                k0 += kl;
            }
            inverses(&l[..bq], &mut corr[..bq]);
            // SAFETY: this task's output block, bq rows of hd at stride d.
            unsafe { scale_rows(o, d, hd, &corr[..bq]) };
        });
    });
}

/// One attention task per (span, head, tile of `q_tile` query rows): (head, q0, q1, keys).
pub(super) fn attention_tasks(
    spans: &[Span],
    heads: usize,
    q_tile: usize,
) -> Vec<(usize, usize, usize, std::ops::Range<usize>)> {
    let mut tasks = Vec::new();
    for span in spans {
        for head in 0..heads {
            let mut q0 = span.q.start;
            while q0 < span.q.end {
                let q1 = (q0 + q_tile).min(span.q.end);
                tasks.push((head, q0, q1, span.k.clone()));
                q0 = q1;
            }
        }
    }
    tasks
}

/// Runs `f` on this thread's scores tile (bq x k_tile) and the online-softmax state of bq
/// rows: running max (set to -inf), running sum (set to 0) and the correction factors.
pub(super) fn with_softmax_scratch(
    bq: usize,
    k_tile: usize,
    f: impl FnOnce(&mut [f32], &mut [f32], &mut [f32], &mut [f32]),
) {
    SCORES.with(|s| {
        let mut s = s.borrow_mut();
        let need = bq * k_tile + 3 * bq;
        if s.len() < need {
            s.resize(need, 0.0);
        }
        let (scores, stats) = s.split_at_mut(bq * k_tile);
        let (m, rest) = stats.split_at_mut(bq);
        let (l, corr) = rest.split_at_mut(bq);
        m[..bq].fill(f32::NEG_INFINITY);
        l[..bq].fill(0.0);
        f(scores, &mut m[..bq], &mut l[..bq], &mut corr[..bq])
    })
}

/// Row i of the block at `o` (rows of `hd` values at stride `d`) *= factors[i], on AVX-512
/// where the CPU has it (the attention's closures are built for the baseline target: 4 lanes).
///
/// # Safety
/// `o` must be valid for `factors.len()` rows, and no one else may touch them.
unsafe fn scale_rows(o: *mut f32, d: usize, hd: usize, factors: &[f32]) {
    #[inline(always)]
    unsafe fn body(o: *mut f32, d: usize, hd: usize, factors: &[f32]) {
        for (i, &c) in factors.iter().enumerate() {
            let row = unsafe { std::slice::from_raw_parts_mut(o.add(i * d), hd) };
            row.iter_mut().for_each(|v| *v *= c);
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        unsafe fn wide(o: *mut f32, d: usize, hd: usize, factors: &[f32]) {
            unsafe { body(o, d, hd, factors) }
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the feature was detected; the caller's contract on `o`.
            return unsafe { wide(o, d, hd, factors) };
        }
    }
    unsafe { body(o, d, hd, factors) }
}

/// out[i] = 1 / x[i] (the softmax rows' final normalisation factors).
pub(super) fn inverses(x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = 1.0 / v;
    }
}

/// Keys and values of one layer, (H, rows, hd) f32, or per head packed for the bf16 kernel
/// (K as B of q·kᵀ: n = rows, k = hd; V as B of p·v: n = hd, k = rows), each head in its
/// own `2 * rows * hd` u16 slot of the f32 buffers (see [`pack_head_kv`]).
#[derive(Clone, Copy)]
pub(super) enum KeysValues<'a> {
    F32 { k: &'a [f32], v: &'a [f32] },
    Packed { k: &'a [u16], v: &'a [u16] },
}

/// A f32 buffer's bytes as u16 (the packed K/V reuse the f32 buffers' memory).
pub(super) fn as_u16(x: &[f32]) -> &[u16] {
    // SAFETY: u16 has a smaller alignment than f32 and every bit pattern is valid.
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u16, 2 * x.len()) }
}

/// Whether `rows` x `hd` packed K and V fit a head's f32 slot (they do from 32 rows on).
pub(super) fn packed_kv_fits(rows: usize, hd: usize) -> bool {
    PackedB::len_for(rows, hd) <= 2 * rows * hd && PackedB::len_for(hd, rows) <= 2 * rows * hd
}

/// Head `head`'s packed K (n = rows keys, k = hd) and V (n = hd, k = rows) in its slot.
pub(super) fn head_kv<'a>(
    k16: &'a [u16],
    v16: &'a [u16],
    head: usize,
    rows: usize,
    hd: usize,
    amx: bool,
) -> (crate::kernels::BView<'a>, crate::kernels::BView<'a>) {
    use crate::kernels::BView;
    let slot = head * 2 * rows * hd..(head + 1) * 2 * rows * hd;
    (
        BView::new(&k16[slot.clone()], rows, hd).with_amx(amx),
        BView::new(&v16[slot], hd, rows).with_amx(amx),
    )
}

/// [`attention`] with bf16 q·kᵀ and p·v (f32 accumulation, online softmax in f32). Key tiles
/// are aligned to the packed panels; the columns of a tile outside the span's keys are masked.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_bf16(
    ws_q: &[f32],
    k16: &[u16],
    v16: &[u16],
    out: &mut [f32],
    rows: usize,
    heads: usize,
    hd: usize,
    spans: &[Span],
    opts: &CpuOptions,
) {
    use crate::kernels::bf16_gemm::{gemm_bf16_a, gemm_bf16_a_rescale};
    use crate::kernels::softmax::online_softmax_tile_bf16;
    let d = heads * hd;
    let (q_tile, k_tile) = opts.attention_tiles;
    let k_tile = (k_tile / NR).max(1) * NR;
    let tasks = attention_tasks(spans, heads, q_tile);
    let out_ptr = SendPtr(out.as_mut_ptr());
    tasks.into_par_iter().for_each(|(head, q0, q1, keys)| {
        let bq = q1 - q0;
        let (kview, vview) = head_kv(k16, v16, head, rows, hd, opts.amx);
        let q = &ws_q[head * rows * hd + q0 * hd..];
        let ps = k_tile + 32;
        with_softmax_scratch(bq, k_tile, |scores, m, l, corr| {
            PROBS.with(|probs| {
                let mut probs = probs.borrow_mut();
                // The task's q rounded to bf16 once, after its probabilities (every key tile's
                // q·kᵀ reads it; rounding it per tile cost ~half the ViT's A conversions).
                let (q16_at, ldq) = ((bq * ps).next_multiple_of(32), hd.next_multiple_of(2));
                if probs.len() < q16_at + bq * ldq {
                    probs.resize(q16_at + bq * ldq);
                }
                let (probs, q16) = probs.split_at_mut(q16_at);
                for (src, dst) in q.chunks(hd).take(bq).zip(q16.chunks_mut(ldq)) {
                    crate::kernels::bf16_gemm::to_bf16(src, dst);
                }
                // SAFETY (raw accesses below): each task writes only its own block (rows q0..q1,
                // columns head*hd..+hd) of `out`, which has row stride d; q holds bq rows of hd.
                let o = unsafe { out_ptr.get().add(q0 * d + head * hd) };
                let (ext_start, ext_end) = (
                    keys.start / NR * NR,
                    keys.end.next_multiple_of(NR).min(rows),
                );
                let mut t0 = ext_start;
                let mut first = true;
                while t0 < ext_end {
                    let w = k_tile.min(ext_end - t0);
                    let tile = &mut scores[..bq * w];
                    unsafe {
                        gemm_bf16_a(
                            bq,
                            q16.as_ptr(),
                            ldq,
                            kview.cols(t0, w),
                            tile.as_mut_ptr(),
                            w,
                            false,
                            false,
                        )
                    };
                    let lo = keys.start.saturating_sub(t0).min(w);
                    let hi = (keys.end - t0).min(w);
                    // The softmax writes p already rounded to bf16 (what the p·v product would
                    // round it to), so that product reads it as it is: no conversion pass.
                    for (i, row) in tile.chunks_exact_mut(w).enumerate() {
                        row[..lo].fill(f32::NEG_INFINITY);
                        row[hi..].fill(f32::NEG_INFINITY);
                        let p = &mut probs[i * ps..i * ps + w];
                        online_softmax_tile_bf16(row, p, &mut m[i], &mut l[i], &mut corr[i]);
                        p[..lo].fill(0);
                        p[hi..].fill(0);
                    }
                    // o = p·v on the first key tile; after it o * corr + p·v, the rescale done
                    // by the tile's stores (a pass of its own over o, whose rows are a 4 KiB
                    // stride apart, was ~1% of the ViT).
                    let pv = vview.inner(t0, w);
                    unsafe {
                        if first {
                            gemm_bf16_a(bq, probs.as_ptr(), ps, pv, o, d, false, false)
                        } else {
                            gemm_bf16_a_rescale(
                                bq,
                                probs.as_ptr(),
                                ps,
                                pv,
                                o,
                                d,
                                corr.as_ptr(),
                                false,
                            )
                        }
                    };
                    first = false;
                    t0 += w;
                }
                inverses(&l[..bq], &mut corr[..bq]);
                // SAFETY: this task's output block, bq rows of hd at stride d.
                unsafe { scale_rows(o, d, hd, &corr[..bq]) };
            })
        });
    });
}

/// [`attention_bf16`] fused on AMX tiles ([`crate::kernels::attention_amx`]), one task per (span,
/// head, block of query rows).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_amx(
    ws_q: &[f32],
    k16: &[u16],
    v16: &[u16],
    out: &mut [f32],
    rows: usize,
    heads: usize,
    hd: usize,
    spans: &[Span],
    opts: &CpuOptions,
) {
    let d = heads * hd;
    let (q_tile, _) = opts.attention_tiles;
    let out_ptr = SendPtr(out.as_mut_ptr());
    let tasks = attention_tasks(spans, heads, q_tile);
    tasks.into_par_iter().for_each(|(head, q0, q1, keys)| {
        let (kview, vview) = head_kv(k16, v16, head, rows, hd, opts.amx);
        let q = &ws_q[head * rows * hd + q0 * hd..head * rows * hd + q1 * hd];
        // SAFETY: `supported` held; each task writes only its own block of `out` (rows
        // q0..q1, columns head*hd..+hd; row stride d).
        unsafe {
            crate::kernels::attention_amx::attend(
                q,
                q1 - q0,
                hd,
                kview,
                vview,
                keys,
                out_ptr.get().add(q0 * d + head * hd),
                d,
            )
        };
    });
}
