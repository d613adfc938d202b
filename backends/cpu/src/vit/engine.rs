//! The CPU bucket engine: the ViT written on preallocated f32 slices with direct gemm calls,
//! fused bias / activation / LayerNorm passes and blocked attention, so that a run at a bucket
//! touches only the buffers sized for that bucket at load (plus its small per-run tables and the
//! outputs). Same math as `vlm_model::vision::VisionModel::forward`, which is its oracle. With a bf16 model on an AVX512-BF16 CPU the products (linears, q·kᵀ, p·v) run on
//! [`crate::kernels::bf16_gemm`]; activations, norms and softmax stay f32. With AMX tiles and a
//! bucket of whole 32-row panels, attention runs fused instead ([`crate::kernels::attention_amx`]).
use crate::kernels::cpu_view::CpuF32;
use crate::kernels::vit_ops::{
    add_bias, bias_gelu_erf, bias_gelu_tanh, gemm_f32, layer_norm_row, Mat,
};
use crate::kernels::{Aligned, PackedB};
use crate::ops::{CpuKernels, CpuWeight};
use crate::options::CpuOptions;
use candle_core::Tensor;
use rayon::prelude::*;
use vlm_compute::VisionConfig;
use vlm_model::vision::spans_for;
use vlm_model::{ModelError, Result};

mod attention;
mod rope;

use attention::*;
use rope::*;

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
    use crate::kernels::packed::{pack_column, pack_inner_row, NR};

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
