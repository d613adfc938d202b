//! Block-quantized linear weights (GGUF Q8_0, Q4_K, Q6_K, ...) on the backend's own pool.
//!
//! The products are candle's quantized matmul (`candle_core::quantized::k_quants::matmul`, a
//! port of ggml-cpu's `mul_mat`: each activation row quantized to the type's dot partner, Q8_0
//! or Q8_K, then integer dot products; on AVX512-VNNI its repacked `vpdpbusd` tiles). candle
//! runs them on a barrier pool of its own, which on a machine whose cores our rayon pool
//! already keeps busy (`step_spin`) means two pools fighting for the same cores: measured on 2
//! cores, 2.4 tok/s decoding the 2B in Q8_0 with 21% of the time in the kernel. So the weight
//! is split at load into row slices, one per pool thread, each its own `QTensor` (with its own
//! repacked cache), and a product runs the slices as rayon tasks, each slice's matmul on the
//! task's thread (the process sets candle's pool to that one thread: `CANDLE_NUM_THREADS=1`,
//! see `lm-service`'s main). Memory stays one copy of the quantized bytes (plus candle's
//! repacked layout).
//!
//! Decode products (<= 4 rows) of Q4_K and Q6_K weights on a CPU with AVX512-VNNI run our own
//! gemv on the slices' compact blocks ([`super::kquant_gemv`]), the activations quantized to
//! Q8_K once for all slices; the candle products stay for other CPUs, types and row counts.
use super::kquant_gemv::{self, KQuant};
use super::ptr::SendPtr;
use super::q8k_act::{Q8KRows, QK_K};
use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Module, Result, Tensor};
use rayon::prelude::*;
use std::borrow::Cow;

/// Up to this many activation rows (decode) a Q4_K / Q5_K product reads the weight in the
/// file's compact blocks (`k_quants::matmul`: ggml's `vec_dot_q4_K_q8_K` per row, as llama.cpp
/// decodes), which measured up to 1.9x candle's repacked tiles at one row on Zen 4 (the tiles
/// expand each superblock's scales to f32: 192 bytes read per 144 stored); more rows take the
/// tiles, which reuse each expanded tile across rows. Both pair the weight with Q8_K rows, so
/// the results agree to summation order. Q6_K already decodes compact in candle; Q8_0's
/// compact product pairs it with Q8_0 rows (another scheme) and measured slower, so it stays
/// on the tiles. (On AVX512-VNNI CPUs, Q4_K and Q6_K decode on [`kquant_gemv`] instead.)
const COMPACT_ROWS: usize = 4;

/// Up to this many activation rows a Q4_K / Q6_K product runs on [`kquant_gemv`] (where the
/// CPU has it): the rows share each load of the weight; more rows take candle's tiles.
const KQUANT_ROWS: usize = 4;

/// Rows of a slice are a multiple of this (candle's repacked tiles take 16 rows).
const ROW_ALIGN: usize = 64;

#[derive(Debug)]
pub struct QuantizedWeight {
    /// (first row, weight rows [first, first + rows) as a QTensor).
    slices: Vec<(usize, QMatMul)>,
    n: usize,
    k: usize,
    dtype: GgmlDType,
}

impl QuantizedWeight {
    /// Splits `w` (n, k) into about `parts` row slices.
    pub fn new(w: &QTensor, parts: usize) -> Result<Self> {
        let (n, k) = w.shape().dims2()?;
        let dtype = w.dtype();
        let row_bytes = k / dtype.block_size() * dtype.type_size();
        let data = w.data()?;
        let per = n
            .div_ceil(parts.max(1))
            .next_multiple_of(ROW_ALIGN)
            .min(n.max(1));
        let mut slices = Vec::new();
        let mut r = 0;
        while r < n {
            let rows = per.min(n - r);
            let bytes = &data[r * row_bytes..(r + rows) * row_bytes];
            let storage = QStorage::from_data(Cow::Borrowed(bytes), &Device::Cpu, dtype)?;
            let q = QTensor::new(storage, (rows, k))?;
            slices.push((r, QMatMul::from_qtensor(q)?));
            r += rows;
        }
        Ok(QuantizedWeight {
            slices,
            n,
            k,
            dtype,
        })
    }

    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    pub fn dtype(&self) -> GgmlDType {
        self.dtype
    }

    /// x (m, k) f32 -> x · Wᵀ (m, n) f32.
    pub fn matmul(&self, x: &Tensor) -> Result<Tensor> {
        let m = x.dim(0)?;
        if let Some(ty) = self.kquant(m) {
            return self.kquant_matmul(ty, x);
        }
        self.matmul_candle(x)
    }

    /// Which [`kquant_gemv`] type takes an `m`-row product, if any.
    fn kquant(&self, m: usize) -> Option<KQuant> {
        let ty = match self.dtype {
            GgmlDType::Q4K => KQuant::Q4K,
            GgmlDType::Q6K => KQuant::Q6K,
            _ => return None,
        };
        let compact = self
            .slices
            .iter()
            .all(|(_, q)| matches!(q, QMatMul::QTensor(_)));
        (m >= 1
            && m <= KQUANT_ROWS
            && self.k.is_multiple_of(QK_K)
            && compact
            && kquant_gemv::available())
        .then_some(ty)
    }

    /// The product on [`kquant_gemv`]: x quantized once, each slice's rows written in place.
    fn kquant_matmul(&self, ty: KQuant, x: &Tensor) -> Result<Tensor> {
        let (m, k) = x.dims2()?;
        if k != self.k {
            candle_core::bail!("quantized matmul: x has {k} columns, the weight {}", self.k)
        }
        let xs = x
            .to_dtype(DType::F32)?
            .contiguous()?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let act = Q8KRows::quantize(&xs, m, k, ty.order());
        let mut out = vec![0f32; m * self.n];
        let optr = SendPtr(out.as_mut_ptr());
        self.slices
            .par_iter()
            .try_for_each(|(first, q)| -> Result<()> {
                let QMatMul::QTensor(t) = q else {
                    candle_core::bail!("a quantized slice holds floats")
                };
                let rows = t.shape().dims2()?.0;
                let data = t.data()?;
                // SAFETY: `kquant` checked the CPU's features; `act` is in `ty`'s order; the
                // slice writes columns [first, first + rows) of the (m, n) `out`, which no
                // other slice touches, and `out` outlives the tasks.
                unsafe {
                    kquant_gemv::gemv(ty, &data, rows, &act, optr.get().add(*first), self.n)
                };
                Ok(())
            })?;
        Tensor::from_vec(out, (m, self.n), &Device::Cpu)
    }

    /// x · Wᵀ on candle's products (the path for what [`kquant_gemv`] does not take; public
    /// for the benches and the tests that compare the two).
    pub fn matmul_candle(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.to_dtype(DType::F32)?.contiguous()?;
        let m = x.dim(0)?;
        if m <= COMPACT_ROWS && matches!(self.dtype, GgmlDType::Q4K | GgmlDType::Q5K) {
            let xs = x.flatten_all()?.to_vec1::<f32>()?;
            let parts: Vec<Vec<f32>> = self
                .slices
                .par_iter()
                .map(|(_, q)| compact_matmul(q, &xs, m, self.k))
                .collect::<Result<_>>()?;
            let mut out = vec![0f32; m * self.n];
            let mut col = 0;
            for part in &parts {
                let w = part.len() / m;
                for r in 0..m {
                    out[r * self.n + col..r * self.n + col + w]
                        .copy_from_slice(&part[r * w..(r + 1) * w]);
                }
                col += w;
            }
            return Tensor::from_vec(out, (m, self.n), &Device::Cpu);
        }
        let parts: Vec<Tensor> = self
            .slices
            .par_iter()
            .map(|(_, q)| q.forward(&x))
            .collect::<Result<_>>()?;
        Tensor::cat(&parts, 1)
    }

    /// Rows `ids` of W as (ids.len(), k) f32 (the embedding lookup of a tied head).
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        let rows = ids
            .iter()
            .map(|&id| {
                let id = id as usize;
                let (first, q) = self
                    .slices
                    .iter()
                    .rev()
                    .find(|(first, _)| *first <= id)
                    .filter(|_| id < self.n)
                    .ok_or_else(|| candle_core::Error::Msg(format!("row {id} of {}", self.n)))?;
                let local = Tensor::new(&[(id - first) as u32], &Device::Cpu)?;
                q.embedding(&local)
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&rows, 0)?.to_dtype(DType::F32)
    }
}

/// `xs` (m, k) · Wᵀ for the slice `q` (n, k) on the calling thread, on its compact blocks.
fn compact_matmul(
    q: &QMatMul,
    xs: &[f32],
    m: usize,
    k: usize,
) -> Result<Vec<f32>> {
    use candle_core::quantized::k_quants::{self as kq, GgmlType};
    let QMatMul::QTensor(t) = q else {
        candle_core::bail!("a quantized slice holds floats")
    };
    let n = t.shape().dims2()?.0;
    let data = t.data()?;
    let mut out = vec![0f32; m * n];
    fn run<T: GgmlType>(
        data: &[u8],
        xs: &[f32],
        mkn: (usize, usize, usize),
        out: &mut [f32],
    ) -> Result<()> {
        // SAFETY: `data` is the QTensor's own storage, a Vec<T> viewed as bytes (aligned for T,
        // a whole number of blocks).
        let blocks = unsafe {
            std::slice::from_raw_parts(
                data.as_ptr() as *const T,
                data.len() / std::mem::size_of::<T>(),
            )
        };
        kq::matmul::<T>(mkn, xs, blocks, out)
    }
    let mkn = (m, k, n);
    match t.dtype() {
        GgmlDType::Q8_0 => run::<kq::BlockQ8_0>(&data, xs, mkn, &mut out)?,
        GgmlDType::Q4_0 => run::<kq::BlockQ4_0>(&data, xs, mkn, &mut out)?,
        GgmlDType::Q4_1 => run::<kq::BlockQ4_1>(&data, xs, mkn, &mut out)?,
        GgmlDType::Q5_0 => run::<kq::BlockQ5_0>(&data, xs, mkn, &mut out)?,
        GgmlDType::Q4K => run::<kq::BlockQ4K>(&data, xs, mkn, &mut out)?,
        GgmlDType::Q5K => run::<kq::BlockQ5K>(&data, xs, mkn, &mut out)?,
        GgmlDType::Q6K => run::<kq::BlockQ6K>(&data, xs, mkn, &mut out)?,
        other => candle_core::bail!("no compact product for {other:?}"),
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i + seed) * 7919 % 2003) as f32 / 1001.0) - 1.0)
            .collect()
    }

    /// Every slice writes its own columns: the split product equals candle's (the same Q8_K
    /// integer sums, f32 summation order aside) for 1..=4 rows, odd row counts and slices
    /// that are not all the same size.
    #[test]
    fn decode_products_agree_with_candles_across_slices() {
        for dtype in [GgmlDType::Q4K, GgmlDType::Q6K] {
            for (n, k, parts) in [(67, 256, 2), (130, 768, 4), (200, 1024, 3), (1, 512, 4)] {
                let w = Tensor::from_vec(data(n * k, 1), (n, k), &Device::Cpu).unwrap();
                let q = QTensor::quantize(&w, dtype).unwrap();
                let qw = QuantizedWeight::new(&q, parts).unwrap();
                for m in 1..=KQUANT_ROWS + 1 {
                    let x = Tensor::from_vec(data(m * k, 5 + m), (m, k), &Device::Cpu).unwrap();
                    let got = qw.matmul(&x).unwrap().to_vec2::<f32>().unwrap();
                    let want = qw.matmul_candle(&x).unwrap().to_vec2::<f32>().unwrap();
                    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                        let scale = w.iter().fold(1f32, |a, v| a.max(v.abs()));
                        for (j, (a, b)) in g.iter().zip(w).enumerate() {
                            assert!(
                                (a - b).abs() <= 2e-5 * scale,
                                "{dtype:?} {m}x{n}x{k}/{parts} at ({r}, {j}): {a} vs {b}"
                            );
                        }
                    }
                }
            }
        }
    }
}
