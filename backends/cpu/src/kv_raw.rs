//! The paged KV cache's memory read and written directly by the CPU kernels (the layout is
//! `vlm_model::text::PagedKvCache`'s: per layer `(num_blocks + 1, kv_heads, block_len,
//! head_dim)`, f32, bf16 or FP8 E4M3).
use crate::kernels::cpu_view::CpuView;
use crate::kernels::e4m3;
use candle_core::{CpuStorage, DType, InplaceOp1, Layout};
use float8::F8E4M3;
use half::bf16;
use vlm_model::text::PagedKvCache;
use vlm_model::Result;

/// One layer's K and V storage on the CPU, borrowed (see [`with_layer`]).
pub(crate) enum KvLayer<'a> {
    F32(&'a [f32], &'a [f32]),
    Bf16(&'a [bf16], &'a [bf16]),
    Fp8(&'a [F8E4M3], &'a [F8E4M3]),
}

/// Writes one decode token per row: k, v (n, kv_heads, head_dim) f32 contiguous CPU data
/// (rounded to nearest even into a bf16 or FP8 cache, as candle's `to_dtype`; FP8 saturates
/// at +-448, see `e4m3::encode`); row r goes to cache index ctx of its table, a padding row
/// to slot r of the dummy block.
pub(crate) fn write_decode_rows(
    kv: &PagedKvCache,
    layer: usize,
    rows: &[Option<(usize, &[u32])>],
    k: &[f32],
    v: &[f32],
) -> Result<()> {
    let geo = kv.geometry();
    let (bl, kvh, hd) = (geo.block_len, geo.kv_heads, geo.head_dim);
    let dsts: Vec<usize> = rows
        .iter()
        .enumerate()
        .map(|(r, row)| {
            let (block, off) = match row {
                Some((ctx, table)) => (table[ctx / bl] as usize, ctx % bl),
                None => (kv.dummy_block() as usize, r % bl),
            };
            (block * kvh * bl + off) * hd
        })
        .collect();
    let (kc, vc) = kv.layer(layer);
    for (cache, src) in [(kc, k), (vc, v)] {
        cache.inplace_op1(&WriteRows {
            src,
            dsts: &dsts,
            row_len: kvh * hd,
            head_stride: bl * hd,
            hd,
        })?;
    }
    Ok(())
}

/// Writes a prefill chunk's k, v (n, kv_heads, head_dim) f32 at cache indices
/// `start..start + n` of the sequence with block table `table`: [`write_decode_rows`] with one
/// row per token, in one pass (candle's write transposes, converts and copies in four, on one
/// thread), the same bits.
pub(crate) fn write_chunk_rows(
    kv: &PagedKvCache,
    layer: usize,
    table: &[u32],
    start: usize,
    k: &[f32],
    v: &[f32],
) -> Result<()> {
    let geo = kv.geometry();
    let n = k.len() / (geo.kv_heads * geo.head_dim);
    let rows: Vec<Option<(usize, &[u32])>> = (start..start + n).map(|c| Some((c, table))).collect();
    write_decode_rows(kv, layer, &rows, k, v)
}

/// Runs `f` on one layer's K and V storage as slices (a CPU cache).
pub(crate) fn with_layer<R>(
    kv: &PagedKvCache,
    layer: usize,
    f: impl FnOnce(KvLayer<'_>) -> R,
) -> Result<R> {
    let (k, v) = kv.layer(layer);
    if kv.dtype() == DType::BF16 {
        let (k, v) = (
            CpuView::<bf16>::new(k, "K cache")?,
            CpuView::<bf16>::new(v, "V cache")?,
        );
        Ok(f(KvLayer::Bf16(k.slice(), v.slice())))
    } else if kv.dtype() == DType::F8E4M3 {
        let (k, v) = (
            CpuView::<F8E4M3>::new(k, "K cache")?,
            CpuView::<F8E4M3>::new(v, "V cache")?,
        );
        Ok(f(KvLayer::Fp8(k.slice(), v.slice())))
    } else {
        let (k, v) = (
            CpuView::<f32>::new(k, "K cache")?,
            CpuView::<f32>::new(v, "V cache")?,
        );
        Ok(f(KvLayer::F32(k.slice(), v.slice())))
    }
}

/// In-place copy of one token per row into the cache: row r's `row_len` values (kv_heads runs
/// of head_dim) go to `dsts[r] + h * head_stride` for each kv head h.
struct WriteRows<'a> {
    src: &'a [f32],
    dsts: &'a [usize],
    row_len: usize,
    head_stride: usize,
    hd: usize,
}

/// Rows from which [`WriteRows`] runs its kv heads in parallel (a prefill chunk; a decode
/// step's few rows stay on the calling thread).
const PARALLEL_ROWS: usize = 32;

impl WriteRows<'_> {
    fn copy<T: Copy + Send + Sync>(&self, cache: &mut [T], convert: impl Fn(f32) -> T + Sync) {
        use rayon::prelude::*;
        let heads = self.row_len / self.hd;
        let end = cache.len();
        let base = crate::kernels::SendPtr(cache.as_mut_ptr());
        let head = |h: usize| {
            for (r, &dst) in self.dsts.iter().enumerate() {
                let src = &self.src[r * self.row_len + h * self.hd..][..self.hd];
                let at = dst + h * self.head_stride;
                assert!(at + self.hd <= end, "kv-write-rows: row {r} past the cache");
                // SAFETY: in bounds (checked); each head writes its own runs (`head_stride`
                // apart, a run no longer than it), so the tasks never touch the same values.
                let out = unsafe { std::slice::from_raw_parts_mut(base.get().add(at), self.hd) };
                for (c, &x) in out.iter_mut().zip(src) {
                    *c = convert(x);
                }
            }
        };
        if self.dsts.len() >= PARALLEL_ROWS && heads > 1 {
            (0..heads).into_par_iter().for_each(head);
        } else {
            (0..heads).for_each(head);
        }
    }
}

impl InplaceOp1 for WriteRows<'_> {
    fn name(&self) -> &'static str {
        "kv-write-rows"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((a, b)) = layout.contiguous_offsets() else {
            candle_core::bail!("{}: the cache must be contiguous", self.name());
        };
        match storage {
            CpuStorage::F32(cache) => self.copy(&mut cache[a..b], |x| x),
            CpuStorage::BF16(cache) => self.copy(&mut cache[a..b], bf16::from_f32),
            CpuStorage::F8E4M3(cache) => {
                self.copy(&mut cache[a..b], |x| F8E4M3::from_bits(e4m3::encode(x)))
            }
            _ => candle_core::bail!("{}: the cache must be f32, bf16 or f8e4m3", self.name()),
        }
        Ok(())
    }
}
