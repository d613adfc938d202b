//! A tokenized multimodal prompt cut into the seam's prefill chunks: its 3-D positions,
//! `rope_delta`, and the token range of each image.
use crate::embeds::ImageEmbeds;
use crate::error::{ComputeError, Result};
use crate::lm::{ImageRows, PrefillChunk};
use crate::model_config::Qwen3VlConfig;
use crate::rope_index::{get_rope_index_runs, Position3};
use std::ops::Range;

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
        Self::with_videos(ids, grids, &vec![false; grids.len()], cfg)
    }

    /// [`Self::with_videos`] with each vision run's kind read from the prompt: the k-th run of
    /// `<|video_pad|>` or `<|image_pad|>` tokens is vision input k.
    pub fn infer(ids: &[u32], grids: &[[usize; 3]], cfg: &Qwen3VlConfig) -> Result<Self> {
        let mut video = Vec::with_capacity(grids.len());
        let mut prev = None;
        for &t in ids {
            let pad = t == cfg.image_token_id || t == cfg.video_token_id;
            if pad && prev != Some(t) {
                video.push(t == cfg.video_token_id);
            }
            prev = Some(t);
        }
        // Extra runs or a missing kind: with_videos names the mismatch.
        video.resize(grids.len(), false);
        Self::with_videos(ids, grids, &video, cfg)
    }

    /// [`Self::new`] for a prompt whose vision runs `k` with `video[k]` are video temporal
    /// groups (`<|video_pad|>` runs of grid `[1, h, w]`), the others images.
    pub fn with_videos(
        ids: &[u32],
        grids: &[[usize; 3]],
        video: &[bool],
        cfg: &Qwen3VlConfig,
    ) -> Result<Self> {
        if video.len() != grids.len() {
            return Err(ComputeError::invalid(format!(
                "{} vision kinds given for {} grids",
                video.len(),
                grids.len()
            )));
        }
        let pads: Vec<u32> = video
            .iter()
            .map(|&v| match v {
                true => cfg.video_token_id,
                false => cfg.image_token_id,
            })
            .collect();
        let (positions, rope_delta) = get_rope_index_runs(
            ids,
            &pads,
            &[cfg.image_token_id, cfg.video_token_id],
            cfg.vision_start_token_id,
            grids,
            cfg.vision.spatial_merge_size,
        )?;
        // get_rope_index checked that image k is a run of exactly its token count.
        let m = cfg.vision.spatial_merge_size.max(1);
        let mut image_spans = Vec::with_capacity(grids.len());
        let mut i = 0;
        for (g, &pad) in grids.iter().zip(&pads) {
            let n = g[0] * (g[1] / m) * (g[2] / m);
            while i < ids.len() && ids[i] != pad {
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
            return Err(ComputeError::invalid(format!(
                "prefill range {range:?} of a {}-token prompt ({} ids given)",
                self.positions.len(),
                ids.len()
            )));
        }
        if images.len() != self.image_spans.len() {
            return Err(ComputeError::invalid(format!(
                "the prompt has {} images, {} image embeddings were given",
                self.image_spans.len(),
                images.len()
            )));
        }
        let mut rows = Vec::new();
        for (span, image) in self.image_spans.iter().zip(images) {
            if image.tokens() != span.len() {
                return Err(ComputeError::invalid(format!(
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
            return Err(ComputeError::invalid("prefill chunk size must be positive"));
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
) -> Result<PrefillChunk> {
    let end = start + len;
    let p = prompt.len();
    if len == 0 || end > p + generated.len() {
        return Err(ComputeError::invalid(format!(
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
