//! [`CpuKernels`]: the CPU backend's kernels for the one Qwen3-VL forward of `vlm-model`. Every
//! kernel choice of the CPU path is made here, from [`CpuOptions`]:
//!
//! * a bf16 weight with `bf16_dot` is packed for [`crate::kernels::bf16_gemm`] and every row
//!   count (decode and prefill) goes through it (AMX tiles with `amx`): activations rounded to
//!   bf16 on entry, f32 accumulation — the reference's bf16 math;
//! * otherwise a few rows (decode, <= [`SMALL_ROWS`]) go through the gemv, which streams the
//!   weight once in its storage dtype with f32 activations; many rows through candle's f32
//!   matmul for f32 weights, and the widening tiles for half-precision ones;
//! * a block-quantized (GGUF) weight stays in its blocks ([`QuantizedWeight`]): decode rows of
//!   Q4_K / Q6_K on our VNNI gemv where the CPU has it, the rest on candle's products; q/k/v
//!   and gate/up fused into one weight of the parts' row slices;
//! * an int8 weight of a W8A8 checkpoint stays int8 ([`Int8Weight`]): each product quantizes
//!   its activation rows to int8 (one scale per row) and sums on VNNI where the CPU has it;
//! * a 4-bit (W4A16) or FP8 weight stays in its codes ([`Int4Weight`], [`Fp8Weight`]): decode
//!   rows expand them in registers, prefill rows a run of panels at a time into the bf16
//!   GEMM's layout;
//! * attention: decode rows on the cache's memory ([`crate::kernels::decode_attention`]); a
//!   prefill chunk of a bf16 model on the bf16 kernel ([`crate::kernels::chunk_attention`]),
//!   of an f32 model in candle's ops (exact f32, `vlm_model::text::paged_attention`).
use crate::kernels::candle_op::{SmallRowsMatmul, WideningMatmul};
use crate::kernels::chunk_attention::chunk_attention;
use crate::kernels::cpu_view::CpuF32;
use crate::kernels::decode_attention::decode_attention;
use crate::kernels::dequant_gemm::{Fp8Weight, Int4Weight};
use crate::kernels::int8_gemm::Int8Weight;
use crate::kernels::quantized::QuantizedWeight;
use crate::kernels::{matmul_packed, PackedB};
use crate::kv_raw::{with_layer, write_chunk_rows, write_decode_rows, KvLayer};
use crate::options::CpuOptions;
use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor};
use std::sync::Arc;
use vlm_model::text::{paged_attention, AttnCall, AttnRows, CacheGeometry, PagedKvCache};
use vlm_model::{Kernels, Result};

/// Rows up to which a dense weight is streamed with the decode gemv.
pub const SMALL_ROWS: usize = 16;
/// Values from which rope runs its rows in parallel.
const ROPE_PARALLEL_MIN: usize = 1 << 15;
/// Values from which [`CpuKernels::add`] splits over the pool, and its chunk.
const ADD_PARALLEL_MIN: usize = 1 << 16;
const ADD_CHUNK: usize = 1 << 14;

/// The CPU backend's kernels and the options they were chosen with.
#[derive(Debug, Clone)]
pub struct CpuKernels {
    opts: CpuOptions,
    device: Device,
}

impl CpuKernels {
    pub fn new(opts: CpuOptions) -> CpuKernels {
        CpuKernels {
            opts,
            device: Device::Cpu,
        }
    }
    pub fn options(&self) -> &CpuOptions {
        &self.opts
    }
    /// Our SIMD kernels for quantized weights may run (`kernels.simd` is not `off`).
    fn simd(&self) -> bool {
        self.opts.gemv != crate::kernels::gemv::Isa::Scalar
    }

    /// x (rows, k) f32 through `f` (the product of a weight of `dims` on contiguous f32 rows),
    /// as a (rows, n) tensor; `what` names the weight's kind in the error.
    fn rows_matmul(
        &self,
        x: &Tensor,
        (n, k): (usize, usize),
        what: &str,
        f: impl FnOnce(&[f32]) -> Vec<f32>,
    ) -> Result<Tensor> {
        let rows = x.dim(0)?;
        if x.dims() != [rows, k] || x.dtype() != DType::F32 {
            return Err(vlm_model::ModelError::invalid(format!(
                "{what} matmul: x is {:?} {:?}, the weight {n}x{k} takes f32 rows of {k}",
                x.dtype(),
                x.dims()
            )));
        }
        // Borrowed, not copied: `Linear` hands contiguous f32 rows.
        let x = x.contiguous()?;
        let xs = CpuF32::new(&x, "quantized matmul input")?;
        Ok(Tensor::from_vec(f(xs.slice()), (rows, n), &self.device)?)
    }

    /// Rows `ids` of a weight with rows of `k`, each written by `row`.
    fn rows_f32(&self, ids: &[u32], k: usize, row: impl Fn(usize, &mut [f32])) -> Result<Tensor> {
        let mut out = vec![0f32; ids.len() * k];
        for (o, &id) in out.chunks_exact_mut(k).zip(ids) {
            row(id as usize, o);
        }
        Ok(Tensor::from_vec(out, (ids.len(), k), &self.device)?)
    }
}

/// How a CPU linear weight is held.
#[derive(Debug, Clone)]
pub enum CpuWeight {
    /// bf16, packed for the bf16 GEMM (B = Wᵀ: n = out_dim, k = in_dim).
    Packed(Arc<PackedB>),
    /// (out_dim, in_dim) in the storage dtype (f32, f16 or bf16).
    Dense(Tensor),
    /// Block-quantized (GGUF Q8_0, Q4_K, Q6_K, ...), never expanded to floats
    /// ([`QuantizedWeight`]).
    Quantized(Arc<QuantizedWeight>),
    /// int8 with per-output-row scales (a W8A8 checkpoint's), activations quantized per row
    /// in each product ([`Int8Weight`]).
    Int8(Arc<Int8Weight>),
    /// 4-bit with a scale per output row and group (a W4A16 checkpoint's), expanded in
    /// registers in each product ([`Int4Weight`]).
    Int4(Arc<Int4Weight>),
    /// FP8 e4m3 with block scales (an FP8 checkpoint's), expanded in registers in each
    /// product ([`Fp8Weight`]).
    Fp8(Arc<Fp8Weight>),
}

impl CpuWeight {
    pub fn packed(&self) -> Option<&Arc<PackedB>> {
        match self {
            CpuWeight::Packed(p) => Some(p),
            _ => None,
        }
    }
    pub fn dense(&self) -> Option<&Tensor> {
        match self {
            CpuWeight::Dense(t) => Some(t),
            _ => None,
        }
    }
}

impl Kernels for CpuKernels {
    type Weight = CpuWeight;

    fn name(&self) -> &'static str {
        "cpu"
    }
    fn device(&self) -> &Device {
        &self.device
    }

    fn weight(&self, w: Tensor) -> Result<CpuWeight> {
        if self.opts.bf16_dot && w.dtype() == DType::BF16 {
            if let Some(p) = PackedB::from_bf16_tensor(&w)? {
                return Ok(CpuWeight::Packed(Arc::new(p.with_amx(self.opts.amx))));
            }
        }
        Ok(CpuWeight::Dense(w))
    }

    fn quantized_weight(&self, w: Arc<QTensor>) -> Result<CpuWeight> {
        let parts = 2 * rayon::current_num_threads();
        Ok(CpuWeight::Quantized(Arc::new(
            QuantizedWeight::new(&w, parts)?.with_own_gemv(self.simd()),
        )))
    }

    fn int8_weight(&self, w: vlm_model::w8a8::Int8Linear) -> Result<CpuWeight> {
        Ok(CpuWeight::Int8(Arc::new(
            Int8Weight::new(w.n, w.k, &w.values, &w.scales)
                .with_simd(self.simd())
                .with_amx(self.opts.amx),
        )))
    }

    fn int4_weight(&self, w: vlm_model::w4a16::Int4Linear) -> Result<CpuWeight> {
        // Stored + 8, the codec's codes.
        let codes: Vec<u8> = w.values.iter().map(|&v| (v + 8) as u8).collect();
        let groups = w.k / w.group;
        Ok(CpuWeight::Int4(Arc::new(
            Int4Weight::new(w.n, w.k, w.group, &codes, |r, g| w.scales[r * groups + g])
                .with_simd(self.simd())
                .with_amx(self.opts.amx),
        )))
    }

    fn fp8_weight(&self, w: vlm_model::fp8::Fp8Linear) -> Result<CpuWeight> {
        // The kernel's groups are the blocks' input runs; a row takes its block's scales.
        Ok(CpuWeight::Fp8(Arc::new(
            Fp8Weight::new(w.n, w.k, w.block_k, &w.codes, |r, g| w.scale(r, g))
                .with_simd(self.simd())
                .with_amx(self.opts.amx),
        )))
    }

    fn weight_dims(&self, w: &CpuWeight) -> (usize, usize) {
        match w {
            CpuWeight::Fp8(q) => q.dims(),
            CpuWeight::Int4(q) => q.dims(),
            CpuWeight::Packed(p) => (p.n(), p.k()),
            CpuWeight::Int8(q) => q.dims(),
            CpuWeight::Quantized(q) => q.dims(),
            CpuWeight::Dense(t) => {
                let d = t.dims();
                (d[0], d[1])
            }
        }
    }

    /// Packed weights concatenated; quantized ones as one [`QuantizedWeight`] of the parts'
    /// slices ([`QuantizedWeight::concat`]), so q/k/v and gate/up run as one set of tasks.
    fn fuse(&self, parts: &[&CpuWeight]) -> Option<CpuWeight> {
        /// Every part as `T`, or `None` when one is held otherwise.
        fn all<'a, T: ?Sized>(
            parts: &[&'a CpuWeight],
            as_t: impl Fn(&'a CpuWeight) -> Option<&'a T>,
        ) -> Option<Vec<&'a T>> {
            parts.iter().map(|w| as_t(w)).collect()
        }
        let quantized = all(parts, |w| match w {
            CpuWeight::Quantized(q) => Some(q.as_ref()),
            _ => None,
        });
        if let Some(q) = quantized {
            return QuantizedWeight::concat(&q).map(|q| CpuWeight::Quantized(Arc::new(q)));
        }
        let int8 = all(parts, |w| match w {
            CpuWeight::Int8(q) => Some(q.as_ref()),
            _ => None,
        });
        if let Some(q) = int8 {
            return Int8Weight::concat(&q).map(|q| CpuWeight::Int8(Arc::new(q)));
        }
        let int4 = all(parts, |w| match w {
            CpuWeight::Int4(q) => Some(q.as_ref()),
            _ => None,
        });
        if let Some(q) = int4 {
            return Int4Weight::concat(&q).map(|q| CpuWeight::Int4(Arc::new(q)));
        }
        let fp8 = all(parts, |w| match w {
            CpuWeight::Fp8(q) => Some(q.as_ref()),
            _ => None,
        });
        if let Some(q) = fp8 {
            return Fp8Weight::concat(&q).map(|q| CpuWeight::Fp8(Arc::new(q)));
        }
        let packed = all(parts, |w| w.packed().map(|p| p.as_ref()))?;
        Some(CpuWeight::Packed(Arc::new(PackedB::concat_n(&packed)?)))
    }

    /// Packed gate and up interleaved in halves of panels ([`PackedB::interleave_gate_up`]),
    /// so that the product applies the SiLU ([`Self::gate_up_silu`]); side by side when the
    /// shapes do not allow it.
    fn fuse_gate_up(&self, gate: &CpuWeight, up: &CpuWeight) -> Option<CpuWeight> {
        match (gate.packed(), up.packed()) {
            (Some(g), Some(u)) => PackedB::interleave_gate_up(g, u)
                .map(|p| CpuWeight::Packed(Arc::new(p)))
                .or_else(|| self.fuse(&[gate, up])),
            _ => self.fuse(&[gate, up]),
        }
    }

    /// The SiLU and the product with up on the register tile's sums (`gemm_gate_up_silu`):
    /// the (rows, 2 inter) gate/up values are never written (a 273-token prefill of the 2B
    /// model wrote and re-read 13 MB a layer for them). On AMX tiles (whose sums go through
    /// memory anyway) the plain product, then the SiLU over its interleaved halves.
    fn gate_up_silu(&self, x: &Tensor, w: &CpuWeight, inter: usize) -> Result<Tensor> {
        match w {
            CpuWeight::Packed(p) if p.gate_up() => {
                Ok(crate::kernels::candle_op::gate_up_silu(x, p, inter)?)
            }
            _ => self.silu_mul(&self.matmul(x, w)?, inter),
        }
    }

    fn matmul(&self, x: &Tensor, w: &CpuWeight) -> Result<Tensor> {
        let rows = x.dim(0)?;
        Ok(match w {
            CpuWeight::Packed(p) => matmul_packed(x, p)?,
            CpuWeight::Dense(w) if rows <= SMALL_ROWS => {
                x.apply_op2_no_bwd(w, &SmallRowsMatmul(self.opts.gemv))?
            }
            CpuWeight::Dense(w) if w.dtype() != DType::F32 => {
                x.apply_op2_no_bwd(w, &WideningMatmul)?
            }
            CpuWeight::Dense(w) => x.matmul(&w.t()?)?,
            CpuWeight::Quantized(q) => q.matmul(x)?,
            CpuWeight::Int8(q) => self.rows_matmul(x, q.dims(), "int8", |xs| q.matmul(xs, rows))?,
            CpuWeight::Int4(q) => self.rows_matmul(x, q.dims(), "int4", |xs| q.matmul(xs, rows))?,
            CpuWeight::Fp8(q) => self.rows_matmul(x, q.dims(), "fp8", |xs| q.matmul(xs, rows))?,
        })
    }

    /// The bf16 kernel sums each row in one fixed order whatever the row count or split
    /// (`a_row_alone_equals_the_same_row_in_a_batch`); the dense paths switch kernels by the
    /// row count.
    fn row_independent(&self, w: &CpuWeight) -> bool {
        matches!(w, CpuWeight::Packed(_) | CpuWeight::Int8(_))
    }

    fn rows_of(&self, w: &CpuWeight, ids: &[u32]) -> Result<Tensor> {
        match w {
            CpuWeight::Packed(p) => {
                let hidden = p.k();
                let mut out = vec![0f32; ids.len() * hidden];
                for (row, &id) in out.chunks_exact_mut(hidden).zip(ids) {
                    p.column_f32(id as usize, row);
                }
                Ok(Tensor::from_vec(out, (ids.len(), hidden), &self.device)?)
            }
            CpuWeight::Dense(t) => {
                let idx = Tensor::new(ids, t.device())?;
                Ok(t.index_select(&idx, 0)?.to_dtype(DType::F32)?)
            }
            CpuWeight::Quantized(q) => Ok(q.rows(ids)?),
            CpuWeight::Int8(q) => self.rows_f32(ids, q.dims().1, |r, o| q.row_f32(r, o)),
            CpuWeight::Int4(q) => self.rows_f32(ids, q.dims().1, |r, o| q.row_f32(r, o)),
            CpuWeight::Fp8(q) => self.rows_f32(ids, q.dims().1, |r, o| q.row_f32(r, o)),
        }
    }

    /// candle's `rope_thd` runs a batch of one on one thread, head by head down each
    /// dimension: here rows in parallel, each head's halves as contiguous runs. The same
    /// products and sums per value, so the same bits (`rope_matches_candle_bit_for_bit`).
    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        use rayon::prelude::*;
        let (n, h, d) = x.dims3()?;
        if [x.dtype(), cos.dtype(), sin.dtype()] != [DType::F32; 3]
            || cos.dims() != [n, d / 2]
            || sin.dims() != [n, d / 2]
            || d % 2 != 0
        {
            return vlm_model::text::rope_rows(x, cos, sin);
        }
        let (x, cos, sin) = (x.contiguous()?, cos.contiguous()?, sin.contiguous()?);
        let (xv, cv, sv) = (
            CpuF32::new(&x, "rope input")?,
            CpuF32::new(&cos, "rope cos")?,
            CpuF32::new(&sin, "rope sin")?,
        );
        let (xs, cs, ss) = (xv.slice(), cv.slice(), sv.slice());
        let half = d / 2;
        let mut out = vec![0f32; n * h * d];
        let row = |t: usize, o: &mut [f32], src: &[f32]| {
            let (c, s) = (&cs[t * half..(t + 1) * half], &ss[t * half..(t + 1) * half]);
            for (oh, xh) in o.chunks_exact_mut(d).zip(src.chunks_exact(d)) {
                let (x1, x2) = xh.split_at(half);
                let (o1, o2) = oh.split_at_mut(half);
                for k in 0..half {
                    o1[k] = x1[k] * c[k] - x2[k] * s[k];
                    o2[k] = x1[k] * s[k] + x2[k] * c[k];
                }
            }
        };
        // A decode step's few rows are not worth waking the other threads for.
        if n * h * d < ROPE_PARALLEL_MIN {
            for (t, (o, src)) in out
                .chunks_exact_mut(h * d)
                .zip(xs.chunks_exact(h * d))
                .enumerate()
            {
                row(t, o, src);
            }
        } else {
            out.par_chunks_mut(h * d)
                .zip(xs.par_chunks(h * d))
                .enumerate()
                .for_each(|(t, (o, src))| row(t, o, src));
        }
        drop((xv, cv, sv));
        Ok(Tensor::from_vec(out, (n, h, d), x.device())?)
    }

    /// One pass over [gate | up] rows.
    fn silu_mul(&self, y: &Tensor, inter: usize) -> Result<Tensor> {
        use rayon::prelude::*;
        let n = y.dim(0)?;
        let y = y.contiguous()?;
        let view = CpuF32::new(&y, "fused gate/up output")?;
        let data = view.slice();
        let mut out = vec![0f32; n * inter];
        out.par_chunks_mut(inter)
            .zip(data.par_chunks(2 * inter))
            .for_each(|(o, row)| {
                let (gate, up) = row.split_at(inter);
                crate::kernels::softmax::silu_mul_row(gate, up, o);
            });
        drop(view);
        Ok(Tensor::from_vec(out, (n, inter), y.device())?)
    }

    /// 16 running sums a row ([`crate::kernels::rms_norm`]) where candle's sum is one serial
    /// chain; in parallel on the pool for a prefill's rows.
    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
        let d = w.elem_count();
        if x.dtype() != DType::F32 || w.dtype() != DType::F32 || x.dims().last() != Some(&d) {
            return Ok(candle_nn::ops::rms_norm(x, w, eps)?);
        }
        let (x, w) = (x.contiguous()?, w.contiguous()?);
        let (xv, wv) = (
            CpuF32::new(&x, "norm input")?,
            CpuF32::new(&w, "norm weight")?,
        );
        let mut out = vec![0f32; x.elem_count()];
        crate::kernels::rms_norm::rms_norm(xv.slice(), wv.slice(), eps, &mut out);
        drop((xv, wv));
        Ok(Tensor::from_vec(out, x.dims(), x.device())?)
    }

    /// In parallel over the pool from [`ADD_PARALLEL_MIN`] values (candle's own split would
    /// run on its separate thread pool, which the step's spinning threads starve).
    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        use rayon::prelude::*;
        let n = a.elem_count();
        if a.dtype() != DType::F32 || b.dtype() != DType::F32 || a.dims() != b.dims() {
            return Ok((a + b)?);
        }
        let (a, b) = (a.contiguous()?, b.contiguous()?);
        let (av, bv) = (CpuF32::new(&a, "add lhs")?, CpuF32::new(&b, "add rhs")?);
        let (x, y) = (av.slice(), bv.slice());
        let mut out: Vec<f32> = Vec::with_capacity(n);
        type Parts<'a> = (&'a mut [std::mem::MaybeUninit<f32>], (&'a [f32], &'a [f32]));
        let sum = |(o, (x, y)): Parts| {
            for ((o, x), y) in o.iter_mut().zip(x).zip(y) {
                o.write(x + y);
            }
        };
        let spare = &mut out.spare_capacity_mut()[..n];
        if n < ADD_PARALLEL_MIN {
            sum((spare, (x, y)));
        } else {
            spare
                .par_chunks_mut(ADD_CHUNK)
                .zip(x.par_chunks(ADD_CHUNK).zip(y.par_chunks(ADD_CHUNK)))
                .for_each(sum);
        }
        // SAFETY: every one of the n values was written above.
        unsafe { out.set_len(n) };
        drop((av, bv));
        Ok(Tensor::from_vec(out, a.dims(), a.device())?)
    }

    /// The pool's other threads stay awake through the step (see `step_spin`).
    fn step<R>(&self, f: impl FnOnce() -> R) -> R {
        crate::step_spin::during(f)
    }

    fn kv_dtype(&self, weights: DType) -> DType {
        vlm_model::dtype::kv_dtype(weights)
    }

    fn attention(&self, call: &AttnCall) -> Result<Tensor> {
        let AttnCall {
            q,
            k,
            v,
            kv,
            layer,
            rows,
            scale,
        } = *call;
        let h = q.dim(1)?;
        let amx = self.opts.amx;
        match rows {
            // A bf16 (or FP8) cache's chunk on the bf16 kernel too.
            AttnRows::Chunk { start, table, .. }
                if self.opts.bf16_dot && matches!(kv.dtype(), DType::BF16 | DType::F8E4M3) =>
            {
                let (k, v) = (k.contiguous()?, v.contiguous()?);
                let (kd, vd) = (CpuF32::new(&k, "k")?, CpuF32::new(&v, "v")?);
                write_chunk_rows(kv, layer, table, *start, kd.slice(), vd.slice())?;
                on_cache_memory(q, kv, layer, |cache, geo, qd, out| match cache {
                    KvLayer::F32(kc, vc) => {
                        chunk_attention(kc, vc, geo, h, qd, *start, table, scale, amx, out)
                    }
                    KvLayer::Bf16(kc, vc) => {
                        chunk_attention(kc, vc, geo, h, qd, *start, table, scale, amx, out)
                    }
                    KvLayer::Fp8(kc, vc) => {
                        chunk_attention(kc, vc, geo, h, qd, *start, table, scale, amx, out)
                    }
                })
            }
            AttnRows::Chunk { .. } => paged_attention::attention(call),
            AttnRows::Decode(rows) => {
                let (k, v) = (k.contiguous()?, v.contiguous()?);
                let (kd, vd) = (CpuF32::new(&k, "k")?, CpuF32::new(&v, "v")?);
                write_decode_rows(kv, layer, rows, kd.slice(), vd.slice())?;
                on_cache_memory(q, kv, layer, |cache, geo, qd, out| match cache {
                    KvLayer::F32(kc, vc) => decode_attention(kc, vc, geo, h, qd, rows, scale, out),
                    KvLayer::Bf16(kc, vc) => decode_attention(kc, vc, geo, h, qd, rows, scale, out),
                    KvLayer::Fp8(kc, vc) => decode_attention(kc, vc, geo, h, qd, rows, scale, out),
                })
            }
        }
    }
}

/// Runs an attention kernel on the layer's cache memory: `f(cache, geometry, q, out)` with
/// q (n, H, hd) and out (n, H*hd) as f32 slices; returns out as a tensor.
fn on_cache_memory(
    q: &Tensor,
    kv: &PagedKvCache,
    layer: usize,
    f: impl FnOnce(KvLayer<'_>, CacheGeometry, &[f32], &mut [f32]),
) -> Result<Tensor> {
    let (n, h, hd) = q.dims3()?;
    let q = q.contiguous()?;
    let qd = CpuF32::new(&q, "q")?;
    let mut out = vec![0f32; n * h * hd];
    with_layer(kv, layer, |cache| {
        f(cache, kv.geometry(), qd.slice(), &mut out)
    })?;
    Ok(Tensor::from_vec(out, (n, h * hd), q.device())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_matches_candle_bit_for_bit() {
        let k = CpuKernels::new(CpuOptions::detect());
        let val = |i: usize| ((i * 2654435761) % 2003) as f32 / 7.0 - 140.0;
        // Serial and parallel sizes, a length not a multiple of the chunk, and a transposed
        // (non-contiguous) operand.
        for (r, c) in [(3usize, 2048usize), (273, 2048), (37, 3001)] {
            let t = |off: usize| {
                Tensor::from_vec(
                    (0..r * c).map(|i| val(i + off)).collect::<Vec<_>>(),
                    (r, c),
                    &Device::Cpu,
                )
                .unwrap()
            };
            let (a, b) = (t(0), t(11));
            let bt = Tensor::from_vec(
                (0..r * c).map(|i| val(i + 5)).collect::<Vec<_>>(),
                (c, r),
                &Device::Cpu,
            )
            .unwrap()
            .t()
            .unwrap();
            for b in [&b, &bt] {
                let got: Vec<f32> = k
                    .add(&a, b)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let want: Vec<f32> = (&a + b).unwrap().flatten_all().unwrap().to_vec1().unwrap();
                assert_eq!(got.len(), want.len());
                assert!(got
                    .iter()
                    .zip(&want)
                    .all(|(g, w)| g.to_bits() == w.to_bits()));
            }
        }
    }

    #[test]
    fn rope_matches_candle_bit_for_bit() {
        let k = CpuKernels::new(CpuOptions::detect());
        // A decode-sized and a prefill-sized call (serial and parallel), head_dim 128.
        for (n, h) in [(3usize, 2usize), (300, 4)] {
            let d = 128;
            let val = |i: usize| ((i * 2654435761) % 2003) as f32 / 1001.0 - 1.0;
            let x = Tensor::from_vec(
                (0..n * h * d).map(val).collect::<Vec<_>>(),
                (n, h, d),
                &Device::Cpu,
            )
            .unwrap();
            let ang: Vec<f32> = (0..n * d / 2).map(|i| val(i + 7) * 3.0).collect();
            let cos = Tensor::from_vec(
                ang.iter().map(|a| a.cos()).collect::<Vec<_>>(),
                (n, d / 2),
                &Device::Cpu,
            )
            .unwrap();
            let sin = Tensor::from_vec(
                ang.iter().map(|a| a.sin()).collect::<Vec<_>>(),
                (n, d / 2),
                &Device::Cpu,
            )
            .unwrap();
            let got: Vec<f32> = k
                .rope(&x, &cos, &sin)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let want: Vec<f32> = vlm_model::text::rope_rows(&x, &cos, &sin)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "n {n}"
            );
        }
    }
}
