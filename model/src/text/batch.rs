//! What one forward step of the decoder computes: a prefill chunk of one sequence, or one decode
//! token for each row of a padded decode batch. The caller (the LM service's runner, or
//! [`crate::pipeline`]) builds these from its scheduler's plan and its block manager's tables.
use super::rope::{get_rope_index, Position3};
use crate::config::Qwen3VlConfig;
use crate::embeds::ImageEmbeds;
use crate::error::{ModelError, Result};
use std::ops::Range;

/// One forward step.
#[derive(Debug, Clone)]
pub enum BatchInput {
    Prefill(PrefillChunk),
    Decode(DecodeBatch),
}

/// Tokens [start, start + n) of one sequence. The step writes their K/V at those cache indices
/// and attends to the cached prefix [0, start) plus, causally, the chunk itself. Logits: (1, vocab)
/// for the chunk's last token.
#[derive(Debug, Clone)]
pub struct PrefillChunk {
    /// The n token ids.
    pub tokens: Vec<u32>,
    /// Cache index of `tokens[0]`: how many tokens of this sequence are already cached.
    pub start: usize,
    /// The n 3-D rotary positions (from [`get_rope_index`]).
    pub positions: Vec<Position3>,
    /// Image rows of this chunk: their embeddings replace the image-token rows, and their
    /// deepstack features are added after text layer k at those rows. Together they must cover
    /// exactly the chunk's image-token rows.
    pub images: Vec<ImageRows>,
    /// The sequence's blocks; must cover `start + n` tokens.
    pub block_table: Vec<u32>,
}

/// `len` consecutive rows of one image, placed in a prefill chunk. An image cut by a chunk
/// boundary appears in two chunks with complementary `src_start`/`len`.
#[derive(Debug, Clone)]
pub struct ImageRows {
    /// The whole image (tensors are shared, not copied).
    pub image: ImageEmbeds,
    /// First row of `image` used.
    pub src_start: usize,
    /// Chunk row (0-based within the chunk) that receives it.
    pub dst_start: usize,
    pub len: usize,
}

/// One decode step over a decoder-batch bucket: `rows.len()` is the bucket size; `None` rows
/// are padding (their K/V go to the dummy block, they read no cache, their logits are garbage).
/// Logits: (rows.len(), vocab).
#[derive(Debug, Clone)]
pub struct DecodeBatch {
    pub rows: Vec<Option<DecodeRow>>,
}

/// One sequence's next token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeRow {
    pub token: u32,
    /// Rotary position on all three axes: `cache index + rope_delta`.
    pub position: i64,
    /// Tokens already cached = the cache index this token is written at; the step attends to
    /// context_len + 1 tokens.
    pub context_len: usize,
    /// The sequence's blocks; must cover context_len + 1 tokens.
    pub block_table: Vec<u32>,
}

impl DecodeBatch {
    /// `rows` padded with `None` up to `bucket` rows.
    pub fn padded(rows: Vec<DecodeRow>, bucket: usize) -> Result<Self> {
        if rows.len() > bucket {
            return Err(ModelError::invalid(format!(
                "{} decode rows do not fit a bucket of {bucket}",
                rows.len()
            )));
        }
        let mut rows: Vec<Option<DecodeRow>> = rows.into_iter().map(Some).collect();
        rows.resize(bucket, None);
        Ok(DecodeBatch { rows })
    }
}

/// A tokenized multimodal prompt: its 3-D positions, `rope_delta`, and the token range of each
/// image. Cuts the prompt into prefill chunks.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLayout {
    pub positions: Vec<Position3>,
    pub rope_delta: i64,
    /// Token range of image k's `<|image_pad|>` run.
    pub image_spans: Vec<Range<usize>>,
}

impl PromptLayout {
    /// Validates the prompt against the image grids (raw patches) and computes its layout.
    pub fn new(ids: &[u32], grids: &[[usize; 3]], cfg: &Qwen3VlConfig) -> Result<Self> {
        let (positions, rope_delta) = get_rope_index(
            ids,
            cfg.image_token_id,
            cfg.vision_start_token_id,
            grids,
            cfg.vision.spatial_merge_size,
        )?;
        // get_rope_index checked that image k is a run of exactly its token count.
        let m = cfg.vision.spatial_merge_size.max(1);
        let mut image_spans = Vec::with_capacity(grids.len());
        let mut i = 0;
        for g in grids {
            let n = g[0] * (g[1] / m) * (g[2] / m);
            while i < ids.len() && ids[i] != cfg.image_token_id {
                i += 1;
            }
            image_spans.push(i..i + n);
            i += n;
        }
        Ok(PromptLayout {
            positions,
            rope_delta,
            image_spans,
        })
    }

    pub fn len(&self) -> usize {
        self.positions.len()
    }
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// The prefill chunk for prompt tokens `range`, with the image rows that fall in it.
    /// `images[k]` is image k of the prompt.
    pub fn chunk(
        &self,
        ids: &[u32],
        images: &[ImageEmbeds],
        range: Range<usize>,
        block_table: Vec<u32>,
    ) -> Result<PrefillChunk> {
        if ids.len() != self.positions.len() || range.start >= range.end || range.end > ids.len() {
            return Err(ModelError::invalid(format!(
                "prefill range {range:?} of a {}-token prompt ({} ids given)",
                self.positions.len(),
                ids.len()
            )));
        }
        if images.len() != self.image_spans.len() {
            return Err(ModelError::invalid(format!(
                "the prompt has {} images, {} image embeddings were given",
                self.image_spans.len(),
                images.len()
            )));
        }
        let mut rows = Vec::new();
        for (span, image) in self.image_spans.iter().zip(images) {
            if image.tokens() != span.len() {
                return Err(ModelError::invalid(format!(
                    "image at tokens {span:?} has {} image tokens, its embeddings have {} rows",
                    span.len(),
                    image.tokens()
                )));
            }
            let lo = span.start.max(range.start);
            let hi = span.end.min(range.end);
            if lo < hi {
                rows.push(ImageRows {
                    image: image.clone(),
                    src_start: lo - span.start,
                    dst_start: lo - range.start,
                    len: hi - lo,
                });
            }
        }
        Ok(PrefillChunk {
            tokens: ids[range.clone()].to_vec(),
            start: range.start,
            positions: self.positions[range].to_vec(),
            images: rows,
            block_table,
        })
    }

    /// The chunks of the whole prompt, each at most `chunk_size` tokens.
    pub fn chunks(
        &self,
        ids: &[u32],
        images: &[ImageEmbeds],
        chunk_size: usize,
        block_table: &[u32],
    ) -> Result<Vec<PrefillChunk>> {
        if chunk_size == 0 {
            return Err(ModelError::invalid("prefill chunk size must be positive"));
        }
        (0..ids.len())
            .step_by(chunk_size)
            .map(|s| {
                self.chunk(
                    ids,
                    images,
                    s..(s + chunk_size).min(ids.len()),
                    block_table.to_vec(),
                )
            })
            .collect()
    }

    /// Rotary position of the token at cache index `index` (>= the prompt length).
    pub fn decode_position(&self, index: usize) -> i64 {
        index as i64 + self.rope_delta
    }
}
