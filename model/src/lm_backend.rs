//! The seam's [`LmBackend`] for any [`Kernels`]: the one text forward over a paged KV cache of
//! the backend's dtype, logits copied to the host.
use crate::error::Result;
use crate::kernels::Kernels;
use crate::text::{BatchInput, DecodeBatch, PagedKvCache, TextModel};
use candle_core::DType;
use vlm_compute::{BackendInfo, DecodeRow, LmBackend, LmMemory, PrefillChunk, StepLogits};

/// The text model and its KV cache.
#[derive(Debug)]
pub struct TextBackend<K: Kernels> {
    model: TextModel<K>,
    kv: PagedKvCache,
    info: BackendInfo,
    /// Prefill chunks and decode rows share forward passes ([`TextModel::row_independent`]).
    mixes: bool,
}

impl<K: Kernels> TextBackend<K> {
    /// Allocates a cache of `num_blocks` blocks of `block_len` tokens (plus the dummy block)
    /// for `model`.
    pub fn new(
        model: TextModel<K>,
        num_blocks: usize,
        block_len: usize,
        info: BackendInfo,
    ) -> Result<Self> {
        let kv = model.new_kv_cache(num_blocks, block_len)?;
        let mixes = model.row_independent();
        Ok(TextBackend {
            model,
            kv,
            info,
            mixes,
        })
    }
    pub fn model(&self) -> &TextModel<K> {
        &self.model
    }
    pub fn kv(&self) -> &PagedKvCache {
        &self.kv
    }
}

impl<K: Kernels> LmBackend for TextBackend<K> {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn memory(&self) -> LmMemory {
        let block_bytes =
            PagedKvCache::bytes_for(self.model.config(), 0, self.kv.block_len(), self.kv.dtype());
        LmMemory {
            weight_bytes: self.model.weight_bytes() as u64,
            kv_block_bytes: block_bytes as u64,
            kv_blocks_allocated: self.kv.num_blocks() as u64 + 1,
            held_bytes: 0,
        }
    }

    fn kv_blocks(&self) -> (usize, usize) {
        (self.kv.num_blocks(), self.kv.block_len())
    }

    fn prefill(&mut self, chunk: &PrefillChunk) -> vlm_compute::Result<Vec<f32>> {
        let mut run = || -> Result<Vec<f32>> {
            let logits = self.model.prefill(chunk, &mut self.kv)?;
            Ok(logits.squeeze(0)?.to_dtype(DType::F32)?.to_vec1()?)
        };
        Ok(run()?)
    }

    /// Together when every product is row-independent (no sequence's numbers change), so the
    /// chunks and decode rows share each product; apart otherwise, and again apart when the
    /// joint forward fails, so that an error is charged to the part that caused it.
    fn packed_step(
        &mut self,
        chunks: &[PrefillChunk],
        bucket: usize,
        rows: &[DecodeRow],
    ) -> StepLogits {
        let parts = chunks.len() + usize::from(!rows.is_empty());
        if self.mixes_steps() && parts > 1 {
            let mut joint = || -> Result<StepLogits> {
                let logits = self
                    .model
                    .packed_step(chunks, rows, &mut self.kv)?
                    .to_dtype(DType::F32)?
                    .to_vec2()?;
                let mut logits = logits.into_iter();
                Ok(StepLogits {
                    chunks: logits.by_ref().take(chunks.len()).map(Ok).collect(),
                    decode: Ok(logits.collect()),
                })
            };
            // The inputs are checked before any compute, so an error here is one of the
            // parts' (a bad block table, an image row out of range): running them apart
            // charges it to that part alone, as a step without the others would.
            if let Ok(out) = joint() {
                return out;
            }
        }
        vlm_compute::step_apart(self, chunks, bucket, rows)
    }

    fn mixes_steps(&self) -> bool {
        self.mixes
    }

    fn decode(&mut self, bucket: usize, rows: &[DecodeRow]) -> vlm_compute::Result<Vec<Vec<f32>>> {
        let mut run = || -> Result<Vec<Vec<f32>>> {
            let n = rows.len();
            let batch = DecodeBatch::padded(rows.to_vec(), bucket)?;
            let logits = self
                .model
                .forward(&BatchInput::Decode(batch), &mut self.kv)?;
            Ok(logits.narrow(0, 0, n)?.to_dtype(DType::F32)?.to_vec2()?)
        };
        Ok(run()?)
    }
}
