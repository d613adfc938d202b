//! The CPU bucket engine: the ViT written on preallocated f32 slices with direct gemm calls,
//! fused bias / activation / LayerNorm passes and blocked attention, so that a run at a bucket
//! touches only the buffers sized for that bucket at load (plus its small per-run tables and the
//! outputs). Same math as `vlm_model::vision::VisionModel::forward`, which is its oracle. With a bf16 model on an AVX512-BF16 CPU the products (linears, q·kᵀ, p·v) run on
//! [`crate::kernels::bf16_gemm`]; activations, norms and softmax stay f32. With AMX tiles and a
//! bucket of whole 32-row panels, attention runs fused instead ([`crate::kernels::attention_amx`]).
use crate::kernels::bf16_gemm::to_bf16;
use crate::kernels::cpu_view::CpuF32;
use crate::kernels::packed::NR;
use crate::kernels::vit_ops::{
    add_bias, bias_gelu_erf, bias_gelu_tanh, gemm_f32, layer_norm_row, online_softmax_tile, Mat,
};
use crate::kernels::{Aligned, AlignedU16, PackedB, SendPtr};
use crate::ops::{CpuKernels, CpuWeight};
use crate::options::CpuOptions;
use candle_core::Tensor;
use rayon::prelude::*;
use std::cell::RefCell;
use vlm_compute::VisionConfig;
use vlm_model::vision::{spans_for, Span};
use vlm_model::{ModelError, Result};

type VisionModel = vlm_model::vision::VisionModel<CpuKernels>;
type VisionBlock = vlm_model::vision::VisionBlock<CpuKernels>;
type Linear = vlm_model::vision::Linear<CpuKernels>;
type LayerNorm = vlm_model::vision::LayerNorm;
type PatchMerger = vlm_model::vision::PatchMerger<CpuKernels>;

/// The buffers of one bucket, allocated once.
#[derive(Debug)]
pub struct Workspace {
    rows: usize,
    /// (rows, D): the residual stream.
    x: Vec<f32>,
    /// (rows, D): LayerNorm outputs, then the attention output.
    h: Vec<f32>,
    /// (rows, max(I, 3D)): qkv, then the MLP hidden, then the merger hidden.
    big: Vec<f32>,
    /// (H, rows, hd) each: q (roped, scaled), k (roped), v. K and V are packed in place for
    /// the AMX tiles, so they start on cache lines (see `kernels::aligned`).
    q: Vec<f32>,
    k: Aligned<f32>,
    v: Aligned<f32>,
}

impl Workspace {
    /// Allocates (and pre-faults) the buffers of a bucket of `rows`; their size is
    /// [`crate::sizing::vit_bucket_bytes`]'s `held`.
    pub fn new(cfg: &VisionConfig, rows: usize) -> Workspace {
        let d = cfg.hidden_size;
        Workspace {
            rows,
            x: vlm_model::resident::zeros_resident_f32(rows * d),
            h: vlm_model::resident::zeros_resident_f32(rows * d),
            big: vlm_model::resident::zeros_resident_f32(rows * big_width(cfg)),
            q: vlm_model::resident::zeros_resident_f32(rows * d),
            k: Aligned::zeroed_resident(rows * d),
            v: Aligned::zeroed_resident(rows * d),
        }
    }
}

fn big_width(cfg: &VisionConfig) -> usize {
    crate::sizing::VitDims::of(cfg).big_width() as usize
}

/// dst (rows, out) [+]= x (rows, in) . W^T for a Linear's weight (out, in); no bias.
fn matmul_wt(
    x: &[f32],
    rows: usize,
    lin: &Linear,
    dst: &mut [f32],
    accumulate: bool,
) -> Result<()> {
    if let CpuWeight::Packed(p) = lin.weight() {
        let (out, in_dim) = (p.n(), p.k());
        if x.len() < rows * in_dim || dst.len() < rows * out {
            return Err(ModelError::weights(format!(
                "linear ({out}, {in_dim}): buffers too small for {rows} rows"
            )));
        }
        // SAFETY: extents checked above; dst does not alias x.
        unsafe {
            crate::kernels::bf16_gemm::gemm(
                rows,
                in_dim,
                x.as_ptr(),
                in_dim,
                p.view(),
                dst.as_mut_ptr(),
                out,
                accumulate,
                true,
            )
        };
        return Ok(());
    }
    let CpuWeight::Dense(w) = lin.weight() else {
        return Err(ModelError::weights(
            "linear weight is neither dense nor packed",
        ));
    };
    let w = CpuF32::new(w, "linear weight")?;
    let w = w.slice();
    let out = lin.out_dim();
    let in_dim = w.len() / out.max(1);
    if x.len() < rows * in_dim || dst.len() < rows * out || w.len() != out * in_dim {
        return Err(ModelError::weights(format!(
            "linear ({out}, {in_dim}): buffers too small for {rows} rows"
        )));
    }
    // SAFETY: extents checked above; dst does not alias x or w.
    unsafe {
        gemm_f32(
            rows,
            out,
            in_dim,
            dst.as_mut_ptr(),
            out,
            accumulate,
            Mat {
                ptr: x.as_ptr(),
                row_stride: in_dim,
            },
            w.as_ptr(),
            1,
            in_dim,
            rayon::current_num_threads(),
        );
    }
    Ok(())
}

/// The block's fc1 and fc2 packed for the bf16 register tile, when its MLP can run fused
/// ([`fused_mlp`]); not on AMX tiles, whose sums go through C.
fn fusable_mlp(block: &VisionBlock) -> Option<(&PackedB, &PackedB)> {
    match (block.mlp.linear_fc1.weight(), block.mlp.linear_fc2.weight()) {
        (CpuWeight::Packed(w1), CpuWeight::Packed(w2)) if !w1.amx() => Some((w1, w2)),
        _ => None,
    }
}

/// x += gelu_tanh(h W1ᵀ + b1) W2ᵀ on the bf16 kernel, fc1's bias and GELU on its register tile
/// and its output written as bf16 into `big` (fc2's left operand as that product reads it: the
/// same bits as fc1, a GELU pass and fc2's own conversion, without the f32 (rows, inter) values
/// written and read twice).
fn fused_mlp(
    h: &[f32],
    rows: usize,
    (w1, b1): (&PackedB, &[f32]),
    w2: &PackedB,
    big: &mut [f32],
    x: &mut [f32],
) -> Result<()> {
    let (inter, d) = (w1.n(), w1.k());
    // Rows a cache line longer than the row, so that a tile's rows do not share L1 sets.
    let ld = inter.next_multiple_of(2) + 32;
    let mid_slots = (rows * ld).div_ceil(2);
    if h.len() < rows * d
        || x.len() < rows * d
        || big.len() < mid_slots
        || b1.len() != inter
        || (w2.n(), w2.k()) != (d, inter)
    {
        return Err(ModelError::weights(format!(
            "vision MLP ({d} -> {inter} -> {}): buffers, bias or fc2 do not fit {rows} rows",
            w2.n()
        )));
    }
    // SAFETY: the f32 slots hold rows x ld u16 values; nothing else holds `big` meanwhile.
    let mid =
        unsafe { std::slice::from_raw_parts_mut(big.as_mut_ptr() as *mut u16, 2 * mid_slots) };
    // SAFETY: extents checked above; the buffers do not alias.
    unsafe {
        crate::kernels::bf16_gemm::gemm_bias_gelu_bf16(
            rows,
            d,
            h.as_ptr(),
            d,
            w1.view(),
            b1.as_ptr(),
            mid.as_mut_ptr(),
            ld,
            true,
        );
        crate::kernels::bf16_gemm::gemm_bf16_a(
            rows,
            mid.as_ptr(),
            ld,
            w2.view(),
            x.as_mut_ptr(),
            d,
            true,
            true,
        );
    }
    Ok(())
}

/// Rows processed per rayon task in the elementwise passes.
const PAR_ROWS: usize = 16;

/// x[r] += bias for every row, in parallel.
fn par_add_bias(x: &mut [f32], bias: &Tensor) -> Result<()> {
    let b = CpuF32::new(bias, "bias")?;
    let b = b.slice();
    x.par_chunks_mut(b.len() * PAR_ROWS)
        .for_each(|c| add_bias(c, b));
    Ok(())
}

/// out[r] = LayerNorm(x[r]) over rows of `dim`, optionally adding `bias` to x first (in place).
fn par_layer_norm(
    x: &mut [f32],
    pre_bias: Option<&Tensor>,
    ln: &LayerNorm,
    out: &mut [f32],
) -> Result<()> {
    let w = CpuF32::new(ln.weight(), "norm weight")?;
    let b = CpuF32::new(ln.bias(), "norm bias")?;
    let pre = pre_bias.map(|t| CpuF32::new(t, "bias")).transpose()?;
    let (w, b) = (w.slice(), b.slice());
    let pre = pre.as_ref().map(|p| p.slice());
    let dim = w.len();
    let eps = ln.eps() as f32;
    x.par_chunks_mut(dim * PAR_ROWS)
        .zip(out.par_chunks_mut(dim * PAR_ROWS))
        .for_each(|(xc, oc)| {
            for (xr, or) in xc.chunks_exact_mut(dim).zip(oc.chunks_exact_mut(dim)) {
                if let Some(p) = pre {
                    add_bias(xr, p);
                }
                layer_norm_row(xr, w, b, eps, or);
            }
        });
    Ok(())
}

/// A merger on the first `tokens` merged rows of the residual stream.
fn merger(
    m: &PatchMerger,
    x: &mut [f32],
    h: &mut [f32],
    big: &mut [f32],
    tokens: usize,
) -> Result<Vec<f32>> {
    let md = m.merged_dim;
    let (x, h, big) = (
        &mut x[..tokens * md],
        &mut h[..tokens * md],
        &mut big[..tokens * md],
    );
    // norm over D per patch, or over 4D per merged token: either way rows are contiguous.
    par_layer_norm(x, None, &m.norm, h)?;
    matmul_wt(h, tokens, &m.linear_fc1, big, false)?; // (T, 4D)
    let b1 = CpuF32::new(m.linear_fc1.bias(), "bias")?;
    let b1 = b1.slice();
    big.par_chunks_mut(md * PAR_ROWS)
        .for_each(|c| bias_gelu_erf(c, b1));
    let out_dim = m.linear_fc2.out_dim();
    let mut out = vec![0f32; tokens * out_dim];
    matmul_wt(big, tokens, &m.linear_fc2, &mut out, false)?; // (T, out)
    par_add_bias(&mut out, m.linear_fc2.bias())?;
    Ok(out)
}

/// Wall time per phase of one run, logged when the backend's `kernels.profile` is on.
#[derive(Default)]
struct Profile {
    on: bool,
    last: Option<std::time::Instant>,
    phases: Vec<(&'static str, f64)>,
}

impl Profile {
    fn new(on: bool) -> Self {
        Profile {
            on,
            last: on.then(std::time::Instant::now),
            phases: Vec::new(),
        }
    }
    fn mark(&mut self, name: &'static str) {
        if let Some(t) = self.last {
            let dt = t.elapsed().as_secs_f64();
            match self.phases.iter_mut().find(|(n, _)| *n == name) {
                Some((_, v)) => *v += dt,
                None => self.phases.push((name, dt)),
            }
            self.last = Some(std::time::Instant::now());
        }
    }
    fn report(&self, rows: usize) {
        if self.on {
            let total: f64 = self.phases.iter().map(|(_, v)| v).sum();
            let parts: Vec<String> = self
                .phases
                .iter()
                .map(|(n, v)| format!("{n} {v:.3}s ({:.0}%)", 100.0 * v / total))
                .collect();
            tracing::info!(
                rows,
                total_seconds = total,
                "vit engine rows {rows}: total {total:.3}s: {}",
                parts.join(", ")
            );
        }
    }
}

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
fn attention(
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
fn attention_tasks(
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
fn with_softmax_scratch(
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
fn inverses(x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = 1.0 / v;
    }
}

/// Keys and values of one layer, (H, rows, hd) f32, or per head packed for the bf16 kernel
/// (K as B of q·kᵀ: n = rows, k = hd; V as B of p·v: n = hd, k = rows), each head in its
/// own `2 * rows * hd` u16 slot of the f32 buffers (see [`pack_head_kv`]).
#[derive(Clone, Copy)]
enum KeysValues<'a> {
    F32 { k: &'a [f32], v: &'a [f32] },
    Packed { k: &'a [u16], v: &'a [u16] },
}

/// A f32 buffer's bytes as u16 (the packed K/V reuse the f32 buffers' memory).
fn as_u16(x: &[f32]) -> &[u16] {
    // SAFETY: u16 has a smaller alignment than f32 and every bit pattern is valid.
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u16, 2 * x.len()) }
}

/// Whether `rows` x `hd` packed K and V fit a head's f32 slot (they do from 32 rows on).
fn packed_kv_fits(rows: usize, hd: usize) -> bool {
    PackedB::len_for(rows, hd) <= 2 * rows * hd && PackedB::len_for(hd, rows) <= 2 * rows * hd
}

/// Head `head`'s packed K (n = rows keys, k = hd) and V (n = hd, k = rows) in its slot.
fn head_kv<'a>(
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
fn attention_bf16(
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
fn attention_amx(
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

/// out = rope(src + b) * mult over one head row (rotate-half form, cos/sin of the row's
/// position; reference `apply_rotary_pos_emb_vision`).
#[inline]
fn rope_row(src: &[f32], b: &[f32], c: &[f32], s: &[f32], mult: f32, out: &mut [f32]) {
    let half = src.len() / 2;
    for j in 0..half {
        let (x1, x2) = (src[j] + b[j], src[j + half] + b[j + half]);
        out[j] = (x1 * c[j] - x2 * s[j]) * mult;
        out[j + half] = (x2 * c[j] + x1 * s[j]) * mult;
    }
}

/// The rotary tables of a run, (rows, hd/2) each, and the scale q is multiplied by.
struct RopeTables<'a> {
    cos: &'a [f32],
    sin: &'a [f32],
    scale: f32,
}

/// Rows of one [`rope_split`] task: a packed K panel's worth, so that each task writes whole
/// panels of K and whole pairs of V rows of its own.
const ROPE_ROWS: usize = crate::kernels::packed::NR;

/// qkv (rows, 3D) + bias -> q (H, rows, hd) roped and scaled, k roped and v, per head: f32, or
/// packed for the bf16 kernel in each head's slot when `packed` (see [`head_kv`]). Parallel over
/// blocks of rows, each row read once front to back (a pass per head read every row's 12 KB at
/// 256-byte pieces, ~7% of a 1024-patch run spent waiting on those lines).
#[allow(clippy::too_many_arguments)]
fn rope_split(
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
unsafe fn pack_block(
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

/// Runs `model` on `pv` ((t*h*w) real rows of C*T*P*P values, row-major) padded to
/// `ws.rows`, with the kernels `opts` chose. Returns the merged embeddings and the deepstack
/// features of the real tokens only, row-major.
pub fn run(
    model: &VisionModel,
    ws: &mut Workspace,
    pv: &[f32],
    grid_thw: [usize; 3],
    opts: &CpuOptions,
) -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
    let cfg = model.config();
    let (d, heads, hd) = (cfg.hidden_size, cfg.num_heads, cfg.head_dim());
    let rows = ws.rows;
    let n: usize = grid_thw.iter().product();
    if n > rows {
        return Err(ModelError::invalid(format!(
            "{n} patches do not fit the {rows}-row workspace"
        )));
    }
    let Workspace {
        x, h, big, q, k, v, ..
    } = ws;
    let mut prof = Profile::new(opts.profile);

    // 1. patch embed: x[..n] = pv @ W^T; padding rows are zero pixels, so only the bias.
    matmul_wt(pv, n, &model.patch_embed.proj, x, false)?;
    x[n * d..].fill(0.0);
    par_add_bias(x, model.patch_embed.proj.bias())?;
    prof.mark("patch_embed");

    // 2. + interpolated position embedding (4 taps per real row).
    let (idx, wts) = model.pos_embed.taps(grid_thw, rows);
    let table = CpuF32::new(model.pos_embed.table(), "pos_embed")?;
    let table = table.slice();
    x.par_chunks_mut(d).enumerate().take(n).for_each(|(r, xr)| {
        for t in 0..4 {
            let (i, w) = (idx[r * 4 + t] as usize, wts[r * 4 + t]);
            for (o, &e) in xr.iter_mut().zip(&table[i * d..(i + 1) * d]) {
                *o += e * w;
            }
        }
    });

    // 3. rope tables (rows, hd/2) and spans.
    let (cos, sin) = model.rope.tables(grid_thw, rows);
    let spans = spans_for(grid_thw, rows);
    let scale = (hd as f32).powf(-0.5);
    // bf16 model on an AVX512-BF16 CPU: attention in bf16 too, K and V packed in place.
    let packed_kv = model
        .blocks
        .first()
        .is_some_and(|b| b.attn.qkv.weight().packed().is_some())
        && packed_kv_fits(rows, hd);
    prof.mark("tables");

    let tokens = n / cfg.merge_unit();
    let mut deepstack = Vec::with_capacity(model.deepstack_merger_list.len());
    for (i, block) in model.blocks.iter().enumerate() {
        // 4a. h = norm1(x); qkv = h @ Wqkv^T
        par_layer_norm(x, None, &block.norm1, h)?;
        prof.mark("norm");
        let qkv = &mut big[..rows * 3 * d];
        matmul_wt(h, rows, &block.attn.qkv, qkv, false)?;
        prof.mark("qkv");
        // 4b. + bias, rope on q and k (q also scaled), split per head: (H, rows, hd)
        let qkv_bias = CpuF32::new(block.attn.qkv.bias(), "qkv bias")?;
        let tables = RopeTables {
            cos: &cos,
            sin: &sin,
            scale,
        };
        rope_split(
            qkv,
            qkv_bias.slice(),
            &tables,
            q,
            k,
            v,
            heads,
            hd,
            packed_kv,
        );
        drop(qkv_bias);
        prof.mark("rope_split");
        // 4c. attention -> h (rows, D)
        let kv = if packed_kv {
            KeysValues::Packed {
                k: as_u16(k),
                v: as_u16(v),
            }
        } else {
            KeysValues::F32 { k, v }
        };
        attention(q, kv, h, rows, heads, hd, &spans, opts);
        prof.mark("attention");
        // 4d. x += h @ Wproj^T (+ bias, fused into norm2); h = norm2(x)
        matmul_wt(h, rows, &block.attn.proj, x, true)?;
        prof.mark("proj");
        par_layer_norm(x, Some(block.attn.proj.bias()), &block.norm2, h)?;
        prof.mark("norm");
        // 4e. MLP: big = gelu_tanh(h @ W1^T + b1); x += big @ W2^T + b2
        let inter = block.mlp.linear_fc1.out_dim();
        let b1 = CpuF32::new(block.mlp.linear_fc1.bias(), "bias")?;
        let b1 = b1.slice();
        if let Some((w1, w2)) = fusable_mlp(block) {
            fused_mlp(h, rows, (w1, b1), w2, big, x)?;
            prof.mark("mlp");
        } else {
            let mid = &mut big[..rows * inter];
            matmul_wt(h, rows, &block.mlp.linear_fc1, mid, false)?;
            prof.mark("fc1");
            mid.par_chunks_mut(inter * PAR_ROWS)
                .for_each(|c| bias_gelu_tanh(c, b1));
            prof.mark("gelu");
            matmul_wt(mid, rows, &block.mlp.linear_fc2, x, true)?;
            prof.mark("fc2");
        }
        par_add_bias(x, block.mlp.linear_fc2.bias())?;
        prof.mark("bias");
        // 4f. deepstack tap (real tokens only)
        if let Some(j) = cfg.deepstack_visual_indexes.iter().position(|&t| t == i) {
            deepstack.push(merger(&model.deepstack_merger_list[j], x, h, big, tokens)?);
            prof.mark("mergers");
        }
    }
    // 5. merger on the real tokens.
    let merged = merger(&model.merger, x, h, big, tokens)?;
    prof.mark("mergers");
    prof.report(rows);
    Ok((merged, deepstack))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::packed::{pack_column, pack_inner_row};

    #[test]
    fn pack_block_writes_the_packed_layout() {
        // Two heads, rows neither a whole panel nor even: every block through `pack_block`
        // against each key through the layout's own one-value-at-a-time writers.
        let (heads, hd, rows) = (2, 64, 45);
        let d = heads * hd;
        let bits = |r: usize, j: usize, s: usize| ((r * 131 + j * 7 + s) % 65521) as u16 + 1;
        let len = PackedB::len_for(rows, hd).max(PackedB::len_for(hd, rows));
        for head in 0..heads {
            let (mut k_got, mut v_got) = (vec![0u16; len], vec![0u16; len]);
            let (mut k_want, mut v_want) = (vec![0u16; len], vec![0u16; len]);
            for r0 in (0..rows).step_by(NR) {
                let r1 = (r0 + NR).min(rows);
                let block = |s| -> Vec<u16> {
                    (r0..r1)
                        .flat_map(|r| (0..d).map(move |j| bits(r, j, s)))
                        .collect()
                };
                let (kb, vb) = (block(0), block(1));
                let (k, v) = (k_got.as_mut_ptr(), v_got.as_mut_ptr());
                unsafe { pack_block(&kb, &vb, d, head * hd, hd, r0, r1, rows, k, v) };
                for r in r0..r1 {
                    let at = (r - r0) * d + head * hd;
                    pack_column(&mut k_want, hd, r, &kb[at..at + hd]);
                    pack_inner_row(&mut v_want, rows, r, &vb[at..at + hd]);
                }
            }
            assert_eq!(k_got, k_want, "K of head {head}");
            assert_eq!(v_got, v_want, "V of head {head}");
        }
    }
}
