//! `Lm.Generate` as a plain async function: validate the request against the replica's limits,
//! get each image's embeddings (cache, else the vision endpoint the request names), and hand
//! the sequence to the engine. The tonic handler in `service` only adapts to this.
use crate::embed_cache::EmbedCache;
use crate::engine::{EngineHandle, GenEvent, SeqRequest};
use crate::error::LmError;
use crate::sampler::{Penalties, SamplingConfig};
use crate::structured::Grammars;
use crate::vision_client::{EmbedShape, EncodeItem, VisionClients};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tracing::Span;
use vlm_compute::{ImageEmbeds, PromptLayout};
use vlm_proto::ImageInput;

/// A generate request in domain terms.
#[derive(Debug, Clone)]
pub struct GenerateInput {
    pub request_id: String,
    pub input_ids: Vec<u32>,
    pub images: Vec<ImageIn>,
    pub vision_replica: String,
    /// Sampling as received (zero values = the documented defaults).
    pub sampling: vlm_proto::SamplingParams,
    pub deadline: Option<Instant>,
}

#[derive(Debug, Clone)]
pub struct ImageIn {
    pub content_hash: Vec<u8>,
    pub grid: Option<[usize; 3]>,
    /// The image, forwarded to the vision service on a cache miss.
    pub input: Option<ImageInput>,
    /// A video temporal group (`<|video_pad|>` placeholders), not an image.
    pub video: bool,
}

/// What the handlers share.
#[derive(Debug)]
pub struct Context {
    pub engine: EngineHandle,
    /// The grammar compiler; `None` when the checkpoint has no usable tokenizer.json.
    pub grammars: Option<Arc<Grammars>>,
    pub cache: Mutex<EmbedCache>,
    pub vision: VisionClients,
    pub draining: AtomicBool,
}

impl Context {
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
}

pub type EventReceiver = UnboundedReceiver<Result<GenEvent, LmError>>;

/// Validates, fetches embeddings, queues. The stream of events is returned.
pub async fn generate(
    ctx: &Context,
    input: GenerateInput,
    span: Span,
) -> Result<EventReceiver, LmError> {
    let received = Instant::now();
    if ctx.is_draining() {
        return Err(LmError::Unavailable(
            "this LM replica is draining; route the request elsewhere".into(),
        ));
    }
    let info = ctx.engine.info();
    let n = input.input_ids.len();
    if n == 0 {
        return Err(LmError::validation(
            "the prompt is empty (input_ids has no tokens)",
        ));
    }
    let max_seq_len = info.deploy.max_seq_len as usize;
    if n >= max_seq_len {
        return Err(LmError::validation(format!(
            "the prompt has {n} tokens; max_seq_len is {max_seq_len} (prompt + generated), so at most {} prompt tokens fit",
            max_seq_len - 1
        )));
    }
    let limit = info.max_sequence_tokens();
    if n >= limit {
        return Err(LmError::validation(format!(
            "the prompt has {n} tokens; the KV pool of this replica holds at most {limit} tokens per sequence ({} blocks of {})",
            info.num_blocks, info.block_len
        )));
    }
    let vocab = info.model.text.vocab_size;
    if let Some((i, &bad)) = input
        .input_ids
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab)
    {
        return Err(LmError::validation(format!(
            "input_ids[{i}] = {bad} is out of the vocabulary (size {vocab})"
        )));
    }

    // Sampling.
    let s = &input.sampling;
    vlm_service_kit::sampling::check(s, Some(vocab)).map_err(|e| LmError::validation(e.message))?;
    // A sequence never grows past `limit`: max_tokens beyond it (or 0) means "until the context
    // is full" (finish reason LENGTH).
    let room = limit - n;
    let max_new = if s.max_tokens == 0 {
        room
    } else {
        (s.max_tokens as usize).min(room)
    };
    let mut logit_bias: Vec<(u32, f32)> = s.logit_bias.iter().map(|(&t, &b)| (t, b)).collect();
    logit_bias.sort_by_key(|&(t, _)| t);
    let sampling = SamplingConfig {
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p: if s.top_p == 0.0 { 1.0 } else { s.top_p },
        min_p: s.min_p,
        seed: s.seed.unwrap_or_else(rand::random),
        penalties: Penalties {
            presence: s.presence_penalty,
            frequency: s.frequency_penalty,
            repetition: if s.repetition_penalty == 0.0 {
                1.0
            } else {
                s.repetition_penalty
            },
        },
        logit_bias,
        min_tokens: s.min_tokens as usize,
        logprobs: s.logprobs.then_some(s.top_logprobs as usize),
    };
    // Structured output: compiled before any image is encoded, so a bad grammar costs nothing.
    let guide = match (&s.structured, &ctx.grammars) {
        (None, _) => None,
        (Some(_), None) => {
            return Err(LmError::validation(
                "structured output is unavailable on this LM replica: its checkpoint has no \
                 usable tokenizer.json (see the replica's start-up log)",
            ))
        }
        (Some(spec), Some(g)) => Some(g.compile(spec).map_err(|e| {
            LmError::validation(format!("structured output cannot be compiled: {e}"))
        })?),
    };
    let mut stop_ids = s.stop_token_ids.clone();
    if !s.ignore_eos {
        stop_ids.extend_from_slice(&info.model.eos_token_ids);
    }

    // Prompt layout against the image grids.
    let mut grids = Vec::with_capacity(input.images.len());
    for (k, img) in input.images.iter().enumerate() {
        let g = img
            .grid
            .ok_or_else(|| LmError::validation(format!("image {k} has no grid")))?;
        grids.push(g);
    }
    let video: Vec<bool> = input.images.iter().map(|i| i.video).collect();
    let layout = PromptLayout::with_videos(&input.input_ids, &grids, &video, &info.model)?;

    // Embeddings.
    let shape = EmbedShape {
        hidden: info.model.text.hidden_size,
        deepstack_levels: info.model.vision.deepstack_visual_indexes.len(),
        spatial_merge_size: info.model.vision.spatial_merge_size,
    };
    let images = embeddings(ctx, &input, &grids, shape).await?;
    let tokens_where = |want: bool| {
        grids
            .iter()
            .zip(&video)
            .filter(|(_, v)| **v == want)
            .map(|(&g, _)| shape.rows_for(g) as u32)
            .sum::<u32>()
    };
    let (image_tokens, video_tokens) = (tokens_where(false), tokens_where(true));

    let (tx, rx) = unbounded_channel();
    let image_hashes = input
        .images
        .iter()
        .map(|i| i.content_hash.clone())
        .collect();
    ctx.engine.submit(SeqRequest {
        request_id: input.request_id,
        prompt: input.input_ids,
        images,
        image_hashes,
        layout,
        image_tokens,
        video_tokens,
        sampling,
        guide,
        n: s.n.max(1) as usize,
        index: 0,
        max_new_tokens: max_new,
        stop_ids,
        deadline: input.deadline,
        events: tx,
        span,
        received,
    })?;
    Ok(rx)
}

/// Each image's embeddings: from the cache, else (all misses in one call) from the vision
/// endpoint, then cached.
async fn embeddings(
    ctx: &Context,
    input: &GenerateInput,
    grids: &[[usize; 3]],
    shape: EmbedShape,
) -> Result<Vec<ImageEmbeds>, LmError> {
    let mut out: Vec<Option<ImageEmbeds>> = {
        let mut cache = ctx
            .cache
            .lock()
            .map_err(|_| LmError::internal("embedding cache lock poisoned"))?;
        input
            .images
            .iter()
            .zip(grids)
            .map(|(img, &g)| cache.get(&img.content_hash, g))
            .collect()
    };
    // Misses, one vision item per distinct content hash.
    let mut items: Vec<EncodeItem> = Vec::new();
    let mut item_of: Vec<Option<usize>> = vec![None; out.len()];
    for (k, img) in input.images.iter().enumerate() {
        if out[k].is_some() {
            continue;
        }
        let same = (0..k).find(|&j| {
            item_of[j].is_some()
                && !img.content_hash.is_empty()
                && input.images[j].content_hash == img.content_hash
                && grids[j] == grids[k]
        });
        if let Some(j) = same {
            item_of[k] = item_of[j];
            continue;
        }
        let source = img.input.clone().ok_or_else(|| {
            LmError::validation(format!(
                "image {k} is not in the embedding cache and the request carries no image input"
            ))
        })?;
        item_of[k] = Some(items.len());
        items.push(EncodeItem {
            input: source,
            content_hash: img.content_hash.clone(),
            grid: grids[k],
        });
    }
    if !items.is_empty() {
        let hashes: Vec<Vec<u8>> = items.iter().map(|i| i.content_hash.clone()).collect();
        let got = ctx
            .vision
            .encode(&input.vision_replica, &input.request_id, items, shape)
            .await?;
        {
            let mut cache = ctx
                .cache
                .lock()
                .map_err(|_| LmError::internal("embedding cache lock poisoned"))?;
            for (h, e) in hashes.iter().zip(&got) {
                cache.insert(h, e.clone());
            }
        }
        for (k, slot) in out.iter_mut().enumerate() {
            if slot.is_none() {
                if let Some(i) = item_of[k] {
                    *slot = Some(got[i].clone());
                }
            }
        }
    }
    out.into_iter()
        .enumerate()
        .map(|(k, e)| e.ok_or_else(|| LmError::internal(format!("image {k} has no embeddings"))))
        .collect()
}
