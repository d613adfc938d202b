//! The LM side of the seam: what one forward step computes, and the trait a backend implements
//! to run it over its paged KV cache.
//!
//! The service owns everything about sequences (scheduling, block tables, sampling); a backend
//! owns the weights, the KV storage and the kernels. A step writes the K/V of its tokens at the
//! cache indices the block tables give and returns logits on the host.
use crate::embeds::ImageEmbeds;
use crate::error::{ComputeError, Result};
use crate::info::BackendInfo;
use crate::memory::LmMemory;
use crate::rope_index::Position3;

/// Tokens [start, start + n) of one sequence. The step writes their K/V at those cache indices
/// and attends to the cached prefix [0, start) plus, causally, the chunk itself. Logits: the
/// chunk's last token.
#[derive(Debug, Clone)]
pub struct PrefillChunk {
    /// The n token ids.
    pub tokens: Vec<u32>,
    /// Cache index of `tokens[0]`: how many tokens of this sequence are already cached.
    pub start: usize,
    /// The n 3-D rotary positions (from [`crate::get_rope_index`]).
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
    /// The whole image (its bytes are shared, not copied).
    pub image: ImageEmbeds,
    /// First row of `image` used.
    pub src_start: usize,
    /// Chunk row (0-based within the chunk) that receives it.
    pub dst_start: usize,
    pub len: usize,
}

/// One sequence's next token in a decode step.
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

/// What a [`LmBackend::packed_step`] gives back: each chunk's last-token logits (vocab,), in the
/// order given, and each decode row's.
#[derive(Debug)]
pub struct StepLogits {
    pub chunks: Vec<Result<Vec<f32>>>,
    pub decode: Result<Vec<Vec<f32>>>,
}

/// What the LM service needs from compute. One instance serves one LM replica's device pool;
/// the service calls it from one thread (its step loop).
pub trait LmBackend: Send {
    /// Which backend, on which devices, with which kernels (logged at start, in `Lm.Info`).
    fn info(&self) -> &BackendInfo;
    /// What it holds: weights, KV pool, per-step buffers.
    fn memory(&self) -> LmMemory;
    /// Usable KV blocks (ids `0..num_blocks`) and tokens per block.
    fn kv_blocks(&self) -> (usize, usize);
    /// One prefill chunk: its K/V written, the logits (vocab,) of its last token.
    fn prefill(&mut self, chunk: &PrefillChunk) -> Result<Vec<f32>>;
    /// One decode step in the batch bucket (graph) of `bucket` rows: `rows.len() <= bucket`
    /// sequences, the rest padding (their K/V go to a dummy block; they read no cache). The
    /// logits (vocab,) of each given row, in order.
    fn decode(&mut self, bucket: usize, rows: &[DecodeRow]) -> Result<Vec<Vec<f32>>>;

    /// One step of prefill chunks of several sequences (each `chunks[i]` as in [`Self::prefill`])
    /// and a decode batch in the bucket of `bucket` rows (`rows` may be empty: no decode). Each
    /// part's `Result` is what [`Self::prefill`] and [`Self::decode`] would give it alone. This
    /// default runs them apart (decode first, then the chunks in order); a backend that can run
    /// them through the weights together, each product reading the weights once for all,
    /// overrides it.
    fn packed_step(
        &mut self,
        chunks: &[PrefillChunk],
        bucket: usize,
        rows: &[DecodeRow],
    ) -> StepLogits {
        step_apart(self, chunks, bucket, rows)
    }

    /// Whether [`Self::packed_step`] runs its parts together (for `Info` and the logs).
    fn mixes_steps(&self) -> bool {
        false
    }

    /// Runs every decode bucket once (all rows padding) and one prefill chunk of `chunk`
    /// tokens, so that buffers, thread pools and (on graph backends) compiled graphs exist
    /// before the first request.
    fn warm_up(&mut self, buckets: &[u32], chunk: usize, image_token_id: u32) -> Result<()> {
        for &b in buckets {
            self.decode(b as usize, &[])?;
        }
        let (blocks, block_len) = self.kv_blocks();
        let n = chunk.min(blocks * block_len).max(1);
        let token = if image_token_id == 0 { 1 } else { 0 };
        let chunk = PrefillChunk {
            tokens: vec![token; n],
            start: 0,
            positions: (0..n as i64).map(|i| [i; 3]).collect(),
            images: Vec::new(),
            block_table: (0..n.div_ceil(block_len) as u32).collect(),
        };
        self.prefill(&chunk)?;
        Ok(())
    }
}

/// [`LmBackend::packed_step`]'s parts run one after the other: the decode batch (when it has
/// rows), then each chunk in order.
pub fn step_apart<B: LmBackend + ?Sized>(
    b: &mut B,
    chunks: &[PrefillChunk],
    bucket: usize,
    rows: &[DecodeRow],
) -> StepLogits {
    let decode = if rows.is_empty() {
        Ok(Vec::new())
    } else {
        b.decode(bucket, rows)
    };
    StepLogits {
        chunks: chunks.iter().map(|c| b.prefill(c)).collect(),
        decode,
    }
}

/// The checks every backend makes of a block table before a step: it covers `tokens` cache
/// indices with ids below `num_blocks`.
pub fn check_table(
    table: &[u32],
    tokens: usize,
    num_blocks: usize,
    block_len: usize,
    what: &str,
) -> Result<()> {
    let need = tokens.div_ceil(block_len.max(1));
    if table.len() < need {
        return Err(ComputeError::KvCache(format!(
            "{what}: {tokens} tokens need {need} blocks of {block_len}, the block table has {}",
            table.len()
        )));
    }
    if let Some(&bad) = table[..need].iter().find(|&&b| b as usize >= num_blocks) {
        return Err(ComputeError::KvCache(format!(
            "{what}: block id {bad} is out of range (the cache has {num_blocks} blocks)"
        )));
    }
    Ok(())
}
