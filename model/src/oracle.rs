//! The test oracle: both towers in one process, the exact unpadded ViT forward and a greedy
//! loop over [`TextModel::forward`] with a trivial block allocation (each sequence owns
//! consecutive blocks for its whole length). The services never use it: tests compare what
//! they stream with it, and `vlm inspect` dumps its intermediates.
use crate::error::{ModelError, Result};
use crate::kernels::Kernels;
use crate::text::{BatchInput, DecodeBatch, PagedKvCache, TextModel};
use crate::vision::{buckets::pixels_tensor, VisionModel};
use candle_core::{DType, Tensor};
use std::path::Path;
use vlm_compute::{
    argmax, DecodeRow, ImageEmbeds, PixelValues, Position3, PromptLayout, Qwen3VlConfig,
};

/// Default prefill chunk (the deployment default, `prefill_chunk_size`).
pub const DEFAULT_PREFILL_CHUNK: usize = 128;
/// Default KV block length of the oracle's cache.
pub const DEFAULT_BLOCK_LEN: usize = 256;

/// The whole model in one process.
#[derive(Debug, Clone)]
pub struct Oracle<K: Kernels> {
    pub config: Qwen3VlConfig,
    /// `None` when loaded text-only (image embeddings then come from elsewhere).
    pub vision: Option<VisionModel<K>>,
    pub text: TextModel<K>,
    /// Prompt tokens per prefill step.
    pub prefill_chunk_size: usize,
    /// Tokens per KV block.
    pub block_len: usize,
}

/// A greedy generation's result.
#[derive(Debug, Clone)]
pub struct GreedyOutput {
    /// Generated tokens (the eos token included when it ended the generation).
    pub tokens: Vec<u32>,
    /// (tokens.len(), vocab) f32: row i is the logits that chose `tokens[i]` (row 0 is the
    /// prefill's last-position logits).
    pub step_logits: Tensor,
    /// Rotary position of every token fed to the model: the prompt's, then one per decode step.
    pub positions: Vec<Position3>,
    pub rope_delta: i64,
}

/// One prompt of a batched generation.
#[derive(Debug, Clone)]
pub struct GreedyRequest {
    pub input_ids: Vec<u32>,
    pub images: Vec<ImageEmbeds>,
}

impl<K: Kernels> Oracle<K> {
    /// Loads both towers from a checkpoint directory; `dtype` is the weight storage dtype.
    pub fn load(k: &K, dir: &Path, dtype: DType) -> Result<Oracle<K>> {
        let config = Qwen3VlConfig::from_dir(dir)?;
        let vision = VisionModel::load(k, dir, dtype)?;
        let text = TextModel::load(k, dir, dtype)?;
        Ok(Self::from_parts(config, Some(vision), text))
    }

    /// Loads the LM only; images must be given as [`ImageEmbeds`].
    pub fn load_text_only(k: &K, dir: &Path, dtype: DType) -> Result<Oracle<K>> {
        let config = Qwen3VlConfig::from_dir(dir)?;
        let text = TextModel::load(k, dir, dtype)?;
        Ok(Self::from_parts(config, None, text))
    }

    pub fn from_parts(
        config: Qwen3VlConfig,
        vision: Option<VisionModel<K>>,
        text: TextModel<K>,
    ) -> Oracle<K> {
        Oracle {
            config,
            vision,
            text,
            prefill_chunk_size: DEFAULT_PREFILL_CHUNK,
            block_len: DEFAULT_BLOCK_LEN,
        }
    }

    pub fn with_prefill_chunk_size(mut self, tokens: usize) -> Oracle<K> {
        self.prefill_chunk_size = tokens;
        self
    }

    pub fn with_block_len(mut self, tokens: usize) -> Oracle<K> {
        self.block_len = tokens;
        self
    }

    /// Runs the ViT (exact, unpadded) on each image.
    pub fn encode_images(&self, images: &[PixelValues]) -> Result<Vec<ImageEmbeds>> {
        let vision = self.vision.as_ref().ok_or_else(|| {
            ModelError::invalid("this pipeline was loaded without the vision tower")
        })?;
        images
            .iter()
            .map(|p| {
                let values = pixels_tensor(p, vision.device())?;
                vision.forward(&values, p.grid_thw)?.to_host()
            })
            .collect()
    }

    /// Last-position logits of a prompt, (vocab,) f32, prefilled in chunks.
    pub fn prefill(&self, input_ids: &[u32], images: &[ImageEmbeds]) -> Result<Tensor> {
        let layout = self.layout(input_ids, images)?;
        let mut kv = self.cache(&[input_ids.len()])?;
        let table: Vec<u32> = (0..kv.num_blocks() as u32).collect();
        let logits = self.prefill_into(&layout, input_ids, images, &table, &mut kv)?;
        Ok(logits.squeeze(0)?)
    }

    /// Greedy generation at decode batch 1: stops after `max_new_tokens` or at a token in `eos`.
    pub fn generate_greedy(
        &self,
        input_ids: &[u32],
        images: &[ImageEmbeds],
        max_new_tokens: usize,
        eos: &[u32],
    ) -> Result<GreedyOutput> {
        let req = GreedyRequest {
            input_ids: input_ids.to_vec(),
            images: images.to_vec(),
        };
        let mut out =
            self.generate_greedy_batch(std::slice::from_ref(&req), 1, max_new_tokens, eos)?;
        out.pop().ok_or_else(|| ModelError::invalid("no output"))
    }

    /// Greedy generation of several prompts decoded together in one padded bucket of `bucket`
    /// rows (>= requests): each prompt is prefilled on its own, then every decode step runs all
    /// unfinished sequences in one [`DecodeBatch`]; finished ones become padding rows.
    pub fn generate_greedy_batch(
        &self,
        requests: &[GreedyRequest],
        bucket: usize,
        max_new_tokens: usize,
        eos: &[u32],
    ) -> Result<Vec<GreedyOutput>> {
        if requests.is_empty() || requests.len() > bucket {
            return Err(ModelError::invalid(format!(
                "{} requests for a decode bucket of {bucket}",
                requests.len()
            )));
        }
        let lens: Vec<usize> = requests
            .iter()
            .map(|r| r.input_ids.len() + max_new_tokens)
            .collect();
        let mut kv = self.cache(&lens)?;
        // Trivial allocation: sequence s owns blocks [s*per, (s+1)*per).
        let per = lens
            .iter()
            .map(|&l| kv.blocks_for(l.max(1)))
            .max()
            .unwrap_or(1);
        let vocab = self.text.config().vocab_size;

        struct Seq {
            layout: PromptLayout,
            table: Vec<u32>,
            len: usize,
            tokens: Vec<u32>,
            logits: Vec<f32>,
            positions: Vec<Position3>,
            done: bool,
        }
        let mut seqs = Vec::with_capacity(requests.len());
        for (s, req) in requests.iter().enumerate() {
            let layout = self.layout(&req.input_ids, &req.images)?;
            let table: Vec<u32> = ((s * per) as u32..((s + 1) * per) as u32).collect();
            let mut seq = Seq {
                positions: layout.positions.clone(),
                layout,
                table,
                len: req.input_ids.len(),
                tokens: Vec::new(),
                logits: Vec::new(),
                done: max_new_tokens == 0,
            };
            if !seq.done {
                let logits = self.prefill_into(
                    &seq.layout,
                    &req.input_ids,
                    &req.images,
                    &seq.table,
                    &mut kv,
                )?;
                push_step(
                    &mut seq.tokens,
                    &mut seq.logits,
                    &logits.squeeze(0)?,
                    eos,
                    max_new_tokens,
                    &mut seq.done,
                )?;
            }
            seqs.push(seq);
        }
        fn push_step(
            tokens: &mut Vec<u32>,
            all: &mut Vec<f32>,
            logits: &Tensor,
            eos: &[u32],
            max_new: usize,
            done: &mut bool,
        ) -> Result<()> {
            let row: Vec<f32> = logits.to_dtype(DType::F32)?.to_vec1()?;
            let tok = argmax(&row);
            all.extend_from_slice(&row);
            tokens.push(tok);
            *done = eos.contains(&tok) || tokens.len() >= max_new;
            Ok(())
        }

        while seqs.iter().any(|s| !s.done) {
            let mut rows = Vec::with_capacity(bucket);
            for s in &mut seqs {
                if s.done {
                    rows.push(None);
                    continue;
                }
                let token = *s
                    .tokens
                    .last()
                    .ok_or_else(|| ModelError::invalid("no token to feed"))?;
                let position = s.layout.decode_position(s.len);
                s.positions.push([position; 3]);
                rows.push(Some(DecodeRow {
                    token,
                    position,
                    context_len: s.len,
                    block_table: s.table.clone(),
                }));
            }
            rows.resize(bucket, None);
            let logits = self
                .text
                .forward(&BatchInput::Decode(DecodeBatch { rows }), &mut kv)?;
            for (r, s) in seqs.iter_mut().enumerate() {
                if s.done {
                    continue;
                }
                s.len += 1;
                push_step(
                    &mut s.tokens,
                    &mut s.logits,
                    &logits.get(r)?,
                    eos,
                    max_new_tokens,
                    &mut s.done,
                )?;
            }
        }

        let device = self.text.device().clone();
        seqs.into_iter()
            .map(|s| {
                let steps = s.tokens.len();
                Ok(GreedyOutput {
                    tokens: s.tokens,
                    step_logits: Tensor::from_vec(s.logits, (steps, vocab), &device)?,
                    positions: s.positions,
                    rope_delta: s.layout.rope_delta,
                })
            })
            .collect()
    }

    fn layout(&self, input_ids: &[u32], images: &[ImageEmbeds]) -> Result<PromptLayout> {
        if input_ids.is_empty() {
            return Err(ModelError::invalid("the prompt is empty"));
        }
        let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid_thw).collect();
        Ok(PromptLayout::infer(input_ids, &grids, &self.config)?)
    }

    /// A cache with room for sequences of the given lengths, blocks split evenly.
    fn cache(&self, lens: &[usize]) -> Result<PagedKvCache> {
        let block_len = self.block_len.max(1);
        let per = lens
            .iter()
            .map(|&l| l.max(1).div_ceil(block_len))
            .max()
            .unwrap_or(1);
        self.text.new_kv_cache(per * lens.len().max(1), block_len)
    }

    /// Prefills a whole prompt in chunks of `prefill_chunk_size`; returns (1, vocab).
    fn prefill_into(
        &self,
        layout: &PromptLayout,
        input_ids: &[u32],
        images: &[ImageEmbeds],
        table: &[u32],
        kv: &mut PagedKvCache,
    ) -> Result<Tensor> {
        let mut last = None;
        for chunk in layout.chunks(input_ids, images, self.prefill_chunk_size, table)? {
            last = Some(self.text.forward(&BatchInput::Prefill(chunk), kv)?);
        }
        last.ok_or_else(|| ModelError::invalid("the prompt is empty"))
    }
}
