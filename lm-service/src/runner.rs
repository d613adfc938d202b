//! Owns the text model and the paged KV tensors, and executes the forward steps of a plan:
//! one decode step padded to its graph, and one prefill chunk.
use crate::error::LmError;
use candle_core::{DType, Device};
use std::path::Path;
use vlm_model::embeds::ImageEmbeds;
use vlm_model::text::{
    BatchInput, DecodeBatch, DecodeRow, PagedKvCache, PrefillChunk, PromptLayout, TextModel,
};

/// The model and its KV cache.
#[derive(Debug)]
pub struct Runner {
    model: TextModel,
    kv: PagedKvCache,
}

impl Runner {
    /// Loads the LM weights from `dir` and allocates a cache of `num_blocks` blocks of
    /// `block_len` tokens (plus the dummy block).
    pub fn load(
        dir: &Path,
        device: &Device,
        dtype: DType,
        num_blocks: usize,
        block_len: usize,
    ) -> Result<Self, LmError> {
        let model = TextModel::load(dir, device, dtype)?;
        Self::new(model, num_blocks, block_len)
    }

    pub fn new(model: TextModel, num_blocks: usize, block_len: usize) -> Result<Self, LmError> {
        let kv = model.new_kv_cache(num_blocks, block_len)?;
        Ok(Runner { model, kv })
    }

    pub fn model(&self) -> &TextModel {
        &self.model
    }
    pub fn kv(&self) -> &PagedKvCache {
        &self.kv
    }

    /// Runs every decode graph once (all rows padding) and one prefill chunk of `chunk` tokens,
    /// so buffers and thread pools exist before the first request.
    pub fn warm_up(&mut self, graphs: &[u32], chunk: usize) -> Result<(), LmError> {
        for &g in graphs {
            self.decode(g as usize, Vec::new())?;
        }
        let block_len = self.kv.block_len();
        let n = chunk.min(self.kv.num_blocks() * block_len).max(1);
        let token = if self.model.image_token_id() == 0 {
            1
        } else {
            0
        };
        let table: Vec<u32> = (0..n.div_ceil(block_len) as u32).collect();
        let c = PrefillChunk {
            tokens: vec![token; n],
            start: 0,
            positions: (0..n as i64).map(|i| [i; 3]).collect(),
            images: Vec::new(),
            block_table: table,
        };
        self.prefill(c)?;
        Ok(())
    }

    /// One decode step in a graph of `graph` rows: logits of the given rows, in order.
    pub fn decode(&mut self, graph: usize, rows: Vec<DecodeRow>) -> Result<Vec<Vec<f32>>, LmError> {
        let n = rows.len();
        let batch = DecodeBatch::padded(rows, graph)?;
        let logits = self
            .model
            .forward(&BatchInput::Decode(batch), &mut self.kv)?;
        let logits = logits.narrow(0, 0, n)?.to_dtype(DType::F32)?;
        Ok(logits.to_vec2()?)
    }

    /// One prefill chunk: the logits of its last token.
    pub fn prefill(&mut self, chunk: PrefillChunk) -> Result<Vec<f32>, LmError> {
        let logits = self
            .model
            .forward(&BatchInput::Prefill(chunk), &mut self.kv)?;
        Ok(logits.squeeze(0)?.to_dtype(DType::F32)?.to_vec1()?)
    }
}

/// The prefill chunk for tokens `start..start+len` of a sequence whose known tokens are
/// `prompt` then `generated` (the part past the prompt happens when recomputing after a
/// preemption; those tokens take their decode positions).
pub fn build_chunk(
    layout: &PromptLayout,
    prompt: &[u32],
    generated: &[u32],
    images: &[ImageEmbeds],
    start: usize,
    len: usize,
    block_table: Vec<u32>,
) -> Result<PrefillChunk, LmError> {
    let end = start + len;
    let p = prompt.len();
    if len == 0 || end > p + generated.len() {
        return Err(LmError::internal(format!(
            "prefill range {start}..{end} of a sequence of {} tokens",
            p + generated.len()
        )));
    }
    let mut c = if start < p {
        layout.chunk(prompt, images, start..end.min(p), block_table)?
    } else {
        PrefillChunk {
            tokens: Vec::new(),
            start,
            positions: Vec::new(),
            images: Vec::new(),
            block_table,
        }
    };
    for idx in start.max(p)..end {
        c.tokens.push(generated[idx - p]);
        let pos = layout.decode_position(idx);
        c.positions.push([pos; 3]);
    }
    Ok(c)
}
