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
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Module, Result, Tensor};
use rayon::prelude::*;
use std::borrow::Cow;

/// Rows of a slice are a multiple of this (candle's repacked tiles take 16 rows).
const ROW_ALIGN: usize = 64;

#[derive(Debug)]
pub struct QuantizedWeight {
    /// (first row, weight rows [first, first + rows) as a QTensor).
    slices: Vec<(usize, candle_core::quantized::QMatMul)>,
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
            slices.push((r, candle_core::quantized::QMatMul::from_qtensor(q)?));
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
        let x = x.to_dtype(DType::F32)?.contiguous()?;
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
