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
//! Decode products (<= 4 rows) of Q4_K, Q6_K and Q8_0 weights on a CPU with AVX512-VNNI run
//! our own gemv on the slices' compact blocks ([`super::kquant_gemv`]), the activations
//! quantized to Q8_K once for all slices; the candle products stay for other CPUs, types and
//! row counts.
use super::kquant_gemv::{self, KQuant};
use super::ptr::SendPtr;
use super::q8k_act::{Order, Q8KRows, QK_K};
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
/// on the tiles. (On AVX512-VNNI CPUs, Q4_K, Q6_K and Q8_0 decode on [`kquant_gemv`].)
const COMPACT_ROWS: usize = 4;

/// Up to this many activation rows a Q4_K / Q6_K / Q8_0 product runs on [`kquant_gemv`]
/// (where the CPU has it): the rows share each load of the weight; more rows take candle's
/// tiles.
const KQUANT_ROWS: usize = 4;

/// Rows of a slice are a multiple of this (candle's repacked tiles take 16 rows).
const ROW_ALIGN: usize = 64;

/// Weight rows [first, first + rows) as their own QTensor.
#[derive(Debug, Clone)]
struct Slice {
    first: usize,
    rows: usize,
    q: QMatMul,
    dtype: GgmlDType,
}

#[derive(Debug)]
pub struct QuantizedWeight {
    slices: Vec<Slice>,
    n: usize,
    k: usize,
    /// Decode products may run on [`kquant_gemv`] (off: candle's products only).
    own_gemv: bool,
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
            slices.push(Slice {
                first: r,
                rows,
                q: QMatMul::from_qtensor(q)?,
                dtype,
            });
            r += rows;
        }
        Ok(QuantizedWeight {
            slices,
            n,
            k,
            own_gemv: true,
        })
    }

    /// `false`: every product on candle's kernels (the backend's `kernels.simd: off`).
    pub fn with_own_gemv(mut self, on: bool) -> Self {
        self.own_gemv = on;
        self
    }

    /// `parts` (all of the same k) as one weight, their rows stacked in order, so that the
    /// products of one input (q, k and v; gate and up) run as one set of tasks; the slices
    /// are shared, not copied, and may differ in type (Q4_K_M's v is Q6_K in some layers).
    /// `None` when the k differ.
    pub fn concat(parts: &[&QuantizedWeight]) -> Option<QuantizedWeight> {
        let k = parts.first()?.k;
        let mut slices = Vec::new();
        let mut n = 0;
        let own_gemv = parts.iter().all(|p| p.own_gemv);
        for p in parts {
            if p.k != k {
                return None;
            }
            slices.extend(p.slices.iter().map(|s| Slice {
                first: n + s.first,
                ..s.clone()
            }));
            n += p.n;
        }
        Some(QuantizedWeight {
            slices,
            n,
            k,
            own_gemv,
        })
    }

    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// The type of the first rows (a [`Self::concat`] of parts may mix types).
    pub fn dtype(&self) -> GgmlDType {
        self.slices.first().map_or(GgmlDType::F32, |s| s.dtype)
    }

    /// x (m, k) f32 -> x · Wᵀ (m, n) f32.
    pub fn matmul(&self, x: &Tensor) -> Result<Tensor> {
        let m = x.dim(0)?;
        if self.kquant(m) {
            return self.kquant_matmul(x);
        }
        self.matmul_candle(x)
    }

    /// Whether an `m`-row product runs on [`kquant_gemv`]: every slice of a type it takes.
    fn kquant(&self, m: usize) -> bool {
        self.own_gemv
            && (1..=KQUANT_ROWS).contains(&m)
            && self.k.is_multiple_of(QK_K)
            && kquant_gemv::available()
            && self
                .slices
                .iter()
                .all(|s| kquant_type(s.dtype).is_some() && matches!(s.q, QMatMul::QTensor(_)))
    }

    /// The product on [`kquant_gemv`]: x quantized once (per activation order the slices'
    /// types need), each slice's rows written in place.
    fn kquant_matmul(&self, x: &Tensor) -> Result<Tensor> {
        let (m, k) = x.dims2()?;
        if k != self.k {
            candle_core::bail!("quantized matmul: x has {k} columns, the weight {}", self.k)
        }
        let xs = x
            .to_dtype(DType::F32)?
            .contiguous()?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let needs = |o: Order| {
            self.slices
                .iter()
                .any(|s| kquant_type(s.dtype).map(KQuant::order) == Some(o))
        };
        let quantize = |o: Order| needs(o).then(|| Q8KRows::quantize(&xs, m, k, o));
        let (q4k, natural) = (quantize(Order::Q4K), quantize(Order::Natural));
        let mut out = vec![0f32; m * self.n];
        let optr = SendPtr(out.as_mut_ptr());
        self.slices.par_iter().try_for_each(|s| -> Result<()> {
            let (QMatMul::QTensor(t), Some(ty)) = (&s.q, kquant_type(s.dtype)) else {
                candle_core::bail!("slice of {:?} on the k-quant gemv", s.dtype)
            };
            let act = match ty.order() {
                Order::Q4K => q4k.as_ref(),
                Order::Natural => natural.as_ref(),
            };
            let act = act.expect("quantized for every slice's order");
            let data = t.data()?;
            // SAFETY: `kquant` checked the CPU's features; `act` is in `ty`'s order; the
            // slice writes columns [first, first + rows) of the (m, n) `out`, which no other
            // slice touches, and `out` outlives the tasks.
            unsafe { kquant_gemv::gemv(ty, &data, s.rows, act, optr.get().add(s.first), self.n) };
            Ok(())
        })?;
        Tensor::from_vec(out, (m, self.n), &Device::Cpu)
    }

    /// x · Wᵀ on candle's products (the path for what [`kquant_gemv`] does not take; public
    /// for the benches and the tests that compare the two).
    pub fn matmul_candle(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.to_dtype(DType::F32)?.contiguous()?;
        let m = x.dim(0)?;
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        let parts: Vec<Vec<f32>> = self
            .slices
            .par_iter()
            .map(|s| {
                if m <= COMPACT_ROWS && matches!(s.dtype, GgmlDType::Q4K | GgmlDType::Q5K) {
                    compact_matmul(&s.q, &xs, m, self.k)
                } else {
                    s.q.forward(&x)?.flatten_all()?.to_vec1::<f32>()
                }
            })
            .collect::<Result<_>>()?;
        let mut out = vec![0f32; m * self.n];
        for (s, part) in self.slices.iter().zip(&parts) {
            for r in 0..m {
                out[r * self.n + s.first..r * self.n + s.first + s.rows]
                    .copy_from_slice(&part[r * s.rows..(r + 1) * s.rows]);
            }
        }
        Tensor::from_vec(out, (m, self.n), &Device::Cpu)
    }

    /// Rows `ids` of W as (ids.len(), k) f32 (the embedding lookup of a tied head).
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        let rows = ids
            .iter()
            .map(|&id| {
                let id = id as usize;
                let s = self
                    .slices
                    .iter()
                    .find(|s| (s.first..s.first + s.rows).contains(&id))
                    .ok_or_else(|| candle_core::Error::Msg(format!("row {id} of {}", self.n)))?;
                let local = Tensor::new(&[(id - s.first) as u32], &Device::Cpu)?;
                s.q.embedding(&local)
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&rows, 0)?.to_dtype(DType::F32)
    }
}

/// The [`kquant_gemv`] type of `dtype`, if it has one.
fn kquant_type(dtype: GgmlDType) -> Option<KQuant> {
    match dtype {
        GgmlDType::Q4K => Some(KQuant::Q4K),
        GgmlDType::Q6K => Some(KQuant::Q6K),
        GgmlDType::Q8_0 => Some(KQuant::Q8_0),
        _ => None,
    }
}

/// `xs` (m, k) · Wᵀ for the slice `q` (n, k) on the calling thread, on its compact blocks.
fn compact_matmul(q: &QMatMul, xs: &[f32], m: usize, k: usize) -> Result<Vec<f32>> {
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
        for dtype in [GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q8_0] {
            for (n, k, parts) in [(67, 256, 2), (130, 768, 4), (200, 1024, 3), (1, 512, 4)] {
                // candle pairs Q8_0 with Q8_K rows (our scheme) only on its tiles, which take
                // slices of 16-row multiples (as every Q8_0 weight of the 2B is).
                let n = if dtype == GgmlDType::Q8_0 {
                    (n / 16).max(1) * 16
                } else {
                    n
                };
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

    /// A concatenation of parts of mixed types is the parts' products side by side, bit for
    /// bit, on both paths (1..=4 rows on the k-quant gemv, 5 on candle's).
    #[test]
    fn a_concatenation_multiplies_as_its_parts() {
        let k = 512;
        let parts: Vec<QuantizedWeight> = [
            (GgmlDType::Q4K, 130),
            (GgmlDType::Q6K, 67),
            (GgmlDType::Q8_0, 64),
            (GgmlDType::Q4K, 64),
        ]
        .iter()
        .enumerate()
        .map(|(i, &(dtype, n))| {
            let w = Tensor::from_vec(data(n * k, 11 * i), (n, k), &Device::Cpu).unwrap();
            QuantizedWeight::new(&QTensor::quantize(&w, dtype).unwrap(), 3).unwrap()
        })
        .collect();
        let all = QuantizedWeight::concat(&parts.iter().collect::<Vec<_>>()).unwrap();
        assert_eq!(all.dims(), (325, k));
        for m in 1..=KQUANT_ROWS + 1 {
            let x = Tensor::from_vec(data(m * k, 3 * m), (m, k), &Device::Cpu).unwrap();
            let each: Vec<Tensor> = parts.iter().map(|p| p.matmul(&x).unwrap()).collect();
            let want = Tensor::cat(&each, 1).unwrap().to_vec2::<f32>().unwrap();
            assert_eq!(
                all.matmul(&x).unwrap().to_vec2::<f32>().unwrap(),
                want,
                "m={m}"
            );
            let each: Vec<Tensor> = parts.iter().map(|p| p.matmul_candle(&x).unwrap()).collect();
            let want = Tensor::cat(&each, 1).unwrap().to_vec2::<f32>().unwrap();
            assert_eq!(
                all.matmul_candle(&x).unwrap().to_vec2::<f32>().unwrap(),
                want,
                "m={m}"
            );
        }
        let rows = all
            .rows(&[0, 130, 196, 200, 260, 324])
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let want = [(0, 0), (1, 0), (1, 66), (2, 3), (2, 63), (3, 63)].map(|(p, r)| {
            parts[p]
                .rows(&[r])
                .unwrap()
                .to_vec2::<f32>()
                .unwrap()
                .remove(0)
        });
        assert_eq!(rows, want.to_vec());
        let other = QuantizedWeight::new(
            &QTensor::quantize(
                &Tensor::zeros((64, 256), DType::F32, &Device::Cpu).unwrap(),
                GgmlDType::Q4K,
            )
            .unwrap(),
            1,
        )
        .unwrap();
        assert!(
            QuantizedWeight::concat(&[&parts[0], &other]).is_none(),
            "k differ"
        );
    }
}
