//! Wire request -> [`ValidRequest`]: the chat template applied, every image's header read and
//! planned (resize, grid, tokens, ViT bucket), placeholders expanded, each image hashed once,
//! and every limit checked. Every refusal is a [`GatewayError::Validation`] naming the limit
//! and the value.
use crate::error::GatewayError;
use crate::video::{plan_video, ValidVideo, VideoInput, VideoLimits};
use bytes::Bytes;
use sha2::{Digest, Sha256};
use vlm_config::video::VideoProcessorConfig;
use vlm_config::{DeployConfig, PixelBudget, VisualConfig};
use vlm_tokenizer::{ChatMessage, ChatPart, ChatTokenizer, VisionTokens};

/// One part of a message as the edges (gRPC, HTTP) decode it.
#[derive(Debug, Clone, PartialEq)]
pub enum InputPart {
    Text(String),
    Image {
        data: Bytes,
        mime_type: String,
        /// This image's pixel budget (OpenAI's `detail`, vLLM's `mm_processor_kwargs`).
        budget: PixelBudget,
    },
    Video(VideoInput),
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct InputMessage {
    pub role: String,
    pub content: Vec<InputPart>,
    /// An assistant turn's tool calls (OpenAI's `tool_calls`).
    pub tool_calls: Vec<vlm_tokenizer::ToolCall>,
}

/// Sampling as the caller asked for it (zero values = defaults, as in the proto). After
/// validation (`ValidRequest::sampling`) `max_tokens` is resolved: never 0, never past the
/// context.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InputSampling {
    pub max_tokens: u32,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub min_p: f32,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// 0 = off (as 1).
    pub repetition_penalty: f32,
    /// (token id, bias), sorted by id.
    pub logit_bias: Vec<(u32, f32)>,
    pub min_tokens: u32,
    pub logprobs: bool,
    pub top_logprobs: u32,
    /// The grammar the output must follow (compiled and enforced by the LM).
    pub structured: Option<vlm_proto::StructuredOutput>,
    /// Choices (0 or 1 = one).
    pub n: u32,
    /// The request field `max_tokens` came from (`max_tokens`, or OpenAI's
    /// `max_completion_tokens`), named by refusals.
    pub max_tokens_param: &'static str,
}

impl InputSampling {
    /// The wire form (`vlm.v1.SamplingParams`), stop strings included.
    pub fn to_wire(&self) -> vlm_proto::SamplingParams {
        vlm_proto::SamplingParams {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
            stop: self.stop.clone(),
            stop_token_ids: self.stop_token_ids.clone(),
            ignore_eos: self.ignore_eos,
            min_p: self.min_p,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            logit_bias: self.logit_bias.iter().copied().collect(),
            min_tokens: self.min_tokens,
            logprobs: self.logprobs,
            top_logprobs: self.top_logprobs,
            structured: self.structured.clone(),
            n: self.n,
        }
    }

    /// The domain form of the wire's.
    pub fn from_wire(s: vlm_proto::SamplingParams) -> Self {
        let mut logit_bias: Vec<(u32, f32)> = s.logit_bias.into_iter().collect();
        logit_bias.sort_by_key(|&(t, _)| t);
        InputSampling {
            max_tokens: s.max_tokens,
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            min_p: s.min_p,
            seed: s.seed,
            stop: s.stop,
            stop_token_ids: s.stop_token_ids,
            ignore_eos: s.ignore_eos,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            repetition_penalty: s.repetition_penalty,
            logit_bias,
            min_tokens: s.min_tokens,
            logprobs: s.logprobs,
            top_logprobs: s.top_logprobs,
            structured: s.structured,
            n: s.n,
            max_tokens_param: "max_tokens",
        }
    }
}

/// A prompt given as is (`/v1/completions`), instead of messages through the chat template.
#[derive(Debug, Clone, PartialEq)]
pub enum RawPrompt {
    /// Encoded as written: special tokens in it are special.
    Text(String),
    Ids(Vec<u32>),
}

/// A chat request before validation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatRequest {
    pub messages: Vec<InputMessage>,
    pub sampling: InputSampling,
    /// Tools the template lists (OpenAI's `tools` objects); empty = none.
    pub tools: Vec<serde_json::Value>,
    /// Set instead of `messages`: the prompt as is, no template.
    pub prompt: Option<RawPrompt>,
    /// Empty = the served model.
    pub model: String,
    /// Bytes of the request body as received (HTTP) or of the message (gRPC); 0 = unknown.
    pub body_bytes: usize,
}

/// One image, planned and hashed.
#[derive(Debug, Clone)]
pub struct ValidImage {
    pub data: Bytes,
    pub mime_type: String,
    /// SHA-256 of `data`, computed once here and carried through every hop.
    pub content_hash: [u8; 32],
    pub width: u32,
    pub height: u32,
    /// Grid in raw patches (t, h, w).
    pub grid: [u32; 3],
    /// Image tokens in the prompt.
    pub tokens: u32,
    /// The ViT bucket it runs in.
    pub bucket: u32,
    pub downscaled: bool,
    /// The request's pixel budget, forwarded so the vision service resizes the same way.
    pub budget: PixelBudget,
}

/// One image or video of a prompt, in prompt order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionRef {
    Image(usize),
    Video(usize),
}

/// A request that passed every check; the rest of the gateway accepts only this.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    /// Prompt ids with each image's placeholder run expanded.
    pub input_ids: Vec<u32>,
    pub images: Vec<ValidImage>,
    pub image_tokens: u32,
    pub videos: Vec<ValidVideo>,
    pub video_tokens: u32,
    /// The images and videos in prompt order.
    pub order: Vec<VisionRef>,
    /// `max_tokens` resolved.
    pub sampling: InputSampling,
}

impl ValidRequest {
    pub fn prompt_tokens(&self) -> u32 {
        self.input_ids.len() as u32
    }
    /// KV tokens this request may hold at most: prompt + max_tokens per choice (the prompt's
    /// blocks are shared).
    pub fn kv_tokens(&self) -> u64 {
        self.input_ids.len() as u64
            + self.sampling.max_tokens as u64 * self.sampling.n.max(1) as u64
    }
}

/// The limits the validator enforces.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Context length (prompt + generated), the LM's `max_seq_len`.
    pub max_seq_len: u32,
    pub max_images: usize,
    pub max_body_bytes: usize,
    /// Bytes of one image file.
    pub max_image_bytes: usize,
    /// Stop strings per request, and bytes of each.
    pub max_stop: usize,
    pub max_stop_len: usize,
    pub video: VideoLimits,
}

impl Limits {
    pub fn from_config(cfg: &DeployConfig, max_images: usize, max_body_bytes: usize) -> Self {
        Limits {
            max_seq_len: cfg.max_seq_len,
            max_images,
            max_body_bytes,
            max_image_bytes: max_body_bytes,
            max_stop: 8,
            max_stop_len: 256,
            video: VideoLimits::from_processor(&VideoProcessorConfig::default()),
        }
    }
}

/// Turns [`ChatRequest`]s into [`ValidRequest`]s.
#[derive(Clone)]
pub struct Validator {
    tokenizer: ChatTokenizer,
    visual: VisualConfig,
    limits: Limits,
    model_id: String,
    /// The checkpoint's `video_preprocessor_config.json` (or Qwen3-VL's defaults).
    video: VideoProcessorConfig,
    /// The OpenAI API's values for sampling fields a request leaves out.
    sampling_defaults: crate::sampling_defaults::SamplingDefaults,
}

const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

impl Validator {
    pub fn new(
        tokenizer: ChatTokenizer,
        visual: VisualConfig,
        limits: Limits,
        model_id: String,
    ) -> Self {
        Validator {
            tokenizer,
            visual,
            limits,
            model_id,
            video: VideoProcessorConfig::default(),
            sampling_defaults: Default::default(),
        }
    }

    pub fn with_sampling_defaults(mut self, d: crate::sampling_defaults::SamplingDefaults) -> Self {
        self.sampling_defaults = d;
        self
    }

    pub fn sampling_defaults(&self) -> &crate::sampling_defaults::SamplingDefaults {
        &self.sampling_defaults
    }

    /// The video processor settings (the checkpoint's `video_preprocessor_config.json`).
    pub fn with_video_processor(mut self, video: VideoProcessorConfig) -> Self {
        self.video = video;
        self
    }
    pub fn video_processor(&self) -> &VideoProcessorConfig {
        &self.video
    }

    pub fn tokenizer(&self) -> &ChatTokenizer {
        &self.tokenizer
    }
    pub fn limits(&self) -> &Limits {
        &self.limits
    }
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// `model` (empty: the served one) names the model this gateway serves.
    pub fn check_model(&self, model: &str) -> Result<(), GatewayError> {
        if !model.is_empty() && model != self.model_id {
            return Err(GatewayError::ModelNotFound {
                model: model.to_string(),
                served: self.model_id.clone(),
            });
        }
        Ok(())
    }

    /// Checks that need no tokenizer: body size, model name, roles, image count, sampling.
    pub fn check_shape(&self, req: &ChatRequest) -> Result<(), GatewayError> {
        let l = &self.limits;
        if req.body_bytes > l.max_body_bytes {
            return Err(GatewayError::validation(format!(
                "request body is {} bytes, over the limit of {} bytes (--max-body-bytes)",
                req.body_bytes, l.max_body_bytes
            )));
        }
        self.check_model(&req.model)?;
        match (&req.prompt, req.messages.is_empty()) {
            (None, true) => {
                return Err(GatewayError::validation(
                    "messages is empty: at least one message is required",
                ))
            }
            (Some(_), false) => {
                return Err(GatewayError::validation(
                    "a request has messages or a prompt, not both",
                ))
            }
            (Some(RawPrompt::Text(t)), _) if t.is_empty() => {
                return Err(GatewayError::param("prompt", "prompt is empty"))
            }
            (Some(RawPrompt::Ids(ids)), _) if ids.is_empty() => {
                return Err(GatewayError::param("prompt", "prompt has no token ids"))
            }
            _ => {}
        }
        for (i, m) in req.messages.iter().enumerate() {
            if !ROLES.contains(&m.role.as_str()) {
                return Err(GatewayError::validation(format!(
                    "messages[{i}].role is {:?}; expected one of system, user, assistant, tool",
                    m.role
                )));
            }
            // What Qwen3-VL's chat template would silently drop is refused instead.
            if m.role == "system" && i > 0 {
                return Err(GatewayError::validation(format!(
                    "messages[{i}] is a system message; the chat template shows a system message \
                     only as the first message (a later one would be dropped)"
                )));
            }
            if matches!(m.role.as_str(), "system" | "assistant") {
                if let Some(j) = m
                    .content
                    .iter()
                    .position(|p| !matches!(p, InputPart::Text(_)))
                {
                    return Err(GatewayError::validation(format!(
                        "messages[{i}].content[{j}] is an image or video in this {} message; the \
                         chat template shows images and videos only in user and tool messages",
                        m.role
                    )));
                }
            }
        }
        let images = req
            .messages
            .iter()
            .flat_map(|m| &m.content)
            .filter(|p| matches!(p, InputPart::Image { .. }))
            .count();
        if images > l.max_images {
            return Err(GatewayError::validation(format!(
                "request has {images} images, over the limit of {} images per request (--max-images)",
                l.max_images
            )));
        }
        let videos = req
            .messages
            .iter()
            .flat_map(|m| &m.content)
            .filter(|p| matches!(p, InputPart::Video(_)))
            .count();
        if videos > l.video.max_videos {
            return Err(GatewayError::validation(format!(
                "request has {videos} videos, over the limit of {} videos per request (--max-videos)",
                l.video.max_videos
            )));
        }
        let s = &req.sampling;
        // The LM checks token ids against its vocabulary (the tokenizer's may be smaller).
        vlm_service_kit::sampling::check(&s.to_wire(), None)
            .map_err(|e| GatewayError::param(e.param, e.message))?;
        if s.stop.len() > l.max_stop {
            return Err(GatewayError::validation(format!(
                "{} stop strings given, over the limit of {}",
                s.stop.len(),
                l.max_stop
            )));
        }
        if let Some(bad) = s
            .stop
            .iter()
            .find(|t| t.is_empty() || t.len() > l.max_stop_len)
        {
            return Err(GatewayError::validation(format!(
                "stop string of {} bytes; each must be 1 to {} bytes",
                bad.len(),
                l.max_stop_len
            )));
        }
        Ok(())
    }

    /// Every check, then the prompt.
    pub fn validate(&self, req: ChatRequest) -> Result<ValidRequest, GatewayError> {
        self.check_shape(&req)?;
        let l = &self.limits;
        let mut images = Vec::new();
        let mut videos: Vec<ValidVideo> = Vec::new();
        let mut order = Vec::new();
        let mut vision = Vec::new();
        let mut messages = Vec::with_capacity(req.messages.len());
        for (mi, m) in req.messages.into_iter().enumerate() {
            let mut parts = Vec::with_capacity(m.content.len());
            for part in m.content {
                match part {
                    InputPart::Text(t) => parts.push(ChatPart::Text(t)),
                    InputPart::Image {
                        data,
                        mime_type,
                        budget,
                    } => {
                        let index = images.len();
                        let image = self.plan_image(index, mi, data, mime_type, budget, l)?;
                        vision.push(VisionTokens::Image(image.tokens as usize));
                        images.push(image);
                        order.push(VisionRef::Image(index));
                        parts.push(ChatPart::Image);
                    }
                    InputPart::Video(v) => {
                        let index = videos.len();
                        let video = plan_video(index, v, &self.video, &self.visual, &l.video)?;
                        vision.push(VisionTokens::Video {
                            tokens_per_group: video.geometry.group_tokens() as usize,
                            timestamps: video.geometry.timestamps.clone(),
                        });
                        videos.push(video);
                        order.push(VisionRef::Video(index));
                        parts.push(ChatPart::Video);
                    }
                }
            }
            let mut msg = ChatMessage::new(m.role, parts);
            msg.tool_calls = m.tool_calls;
            messages.push(msg);
        }
        // The prompt must leave room for one generated token; encoding stops once past that
        // (or never starts when the text's byte length proves it too long).
        let limit = l.max_seq_len.saturating_sub(1) as usize;
        let input_ids = match req.prompt {
            Some(p) => self.raw_prompt_ids(p, limit)?,
            None => self
                .tokenizer
                .encode_prompt_vision(&messages, &req.tools, &vision, limit)
                .map_err(|e| self.encode_error("cannot build the prompt", e))?,
        };
        let prompt = input_ids.len() as u32;
        if prompt >= l.max_seq_len {
            return Err(self.too_long(prompt as usize, true));
        }
        let room = l.max_seq_len - prompt;
        let mut s = req.sampling;
        let max_tokens = match s.max_tokens {
            0 => room,
            n if n > room => {
                let param = match s.max_tokens_param {
                    "" => "max_tokens",
                    p => p,
                };
                return Err(GatewayError::param(
                    param,
                    format!(
                        "prompt ({prompt} tokens) + {param} ({n}) = {} tokens, over the context \
                         limit of {} tokens (max_seq_len)",
                        prompt as u64 + n as u64,
                        l.max_seq_len
                    ),
                ));
            }
            n => n,
        };
        if s.min_tokens > max_tokens {
            return Err(GatewayError::param(
                "min_tokens",
                format!(
                    "min_tokens ({}) is over the {max_tokens} tokens this request may generate \
                     (max_tokens, or the context left after the {prompt}-token prompt)",
                    s.min_tokens
                ),
            ));
        }
        s.max_tokens = max_tokens;
        let image_tokens = images.iter().map(|i| i.tokens).sum();
        let video_tokens = videos.iter().map(|v| v.tokens()).sum();
        Ok(ValidRequest {
            input_ids,
            images,
            image_tokens,
            videos,
            video_tokens,
            order,
            sampling: s,
        })
    }

    /// The prompt leaves no room to generate; `exact`: `tokens` is its count, else a lower
    /// bound (encoding stopped once past the limit).
    fn too_long(&self, tokens: usize, exact: bool) -> GatewayError {
        GatewayError::validation(format!(
            "prompt is {}{tokens} tokens (images included); the context limit is {} tokens \
             (max_seq_len), which leaves no room to generate",
            if exact { "" } else { "at least " },
            self.limits.max_seq_len
        ))
    }

    fn encode_error(&self, what: &str, e: vlm_tokenizer::TokenizerError) -> GatewayError {
        match e {
            vlm_tokenizer::TokenizerError::TooLong { at_least, .. } => {
                self.too_long(at_least, false)
            }
            e => GatewayError::validation(format!("{what}: {e}")),
        }
    }

    /// A raw prompt's ids (text encoded up to `limit` tokens); an image placeholder (which
    /// needs an image) is refused.
    fn raw_prompt_ids(&self, p: RawPrompt, limit: usize) -> Result<Vec<u32>, GatewayError> {
        let ids = match p {
            RawPrompt::Text(t) => self
                .tokenizer
                .encode_within(&t, limit)
                .map_err(|e| self.encode_error("cannot encode the prompt", e))?,
            RawPrompt::Ids(ids) => ids,
        };
        let t = &self.tokenizer;
        let vision = [Some(t.image_pad_id()), t.video_pad_id()];
        if let Some((i, id)) = ids
            .iter()
            .enumerate()
            .find(|(_, id)| vision.contains(&Some(**id)))
        {
            return Err(GatewayError::param(
                "prompt",
                format!(
                    "prompt token {i} is {id}, an image placeholder; images are served through \
                     /v1/chat/completions"
                ),
            ));
        }
        Ok(ids)
    }

    fn plan_image(
        &self,
        index: usize,
        message: usize,
        data: Bytes,
        mime_type: String,
        budget: PixelBudget,
        l: &Limits,
    ) -> Result<ValidImage, GatewayError> {
        if data.len() > l.max_image_bytes {
            return Err(GatewayError::validation(format!(
                "image {index} is {} bytes, over the limit of {} bytes per image",
                data.len(),
                l.max_image_bytes
            )));
        }
        let (width, height) = vlm_preprocess::worker::read_image_size(&l.video.decoding, &data)
            .map_err(|e| {
                GatewayError::validation(format!(
                    "image {index} (in messages[{message}]): {}",
                    strip_prefix(&e.to_string())
                ))
            })?;
        let planned = self
            .visual
            .plan_image_within(width, height, budget)
            .map_err(|e| {
                GatewayError::validation(format!("image {index} ({width}x{height}): {e}"))
            })?;
        let g = planned.geometry;
        let content_hash: [u8; 32] = Sha256::digest(&data).into();
        Ok(ValidImage {
            data,
            mime_type,
            content_hash,
            width,
            height,
            grid: [g.grid_t, g.grid_h, g.grid_w],
            tokens: g.tokens() as u32,
            bucket: planned.bucket,
            downscaled: planned.downscaled,
            budget,
        })
    }
}

fn strip_prefix(s: &str) -> &str {
    s.strip_prefix("invalid input: ").unwrap_or(s)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::sync::OnceLock;

    /// A tokenizer-only tiny checkpoint, made once per test process.
    pub(crate) fn tiny_dir() -> PathBuf {
        static DIR: OnceLock<PathBuf> = OnceLock::new();
        DIR.get_or_init(|| {
            let dir =
                std::env::temp_dir().join(format!("vlm-gateway-test-tok-{}", std::process::id()));
            let mut opts = vlm_make_model::MakeOptions::new(vlm_make_model::Preset::Tiny);
            opts.weights = false;
            vlm_make_model::make_model(&dir, &opts).expect("make tiny checkpoint metadata");
            dir
        })
        .clone()
    }

    pub(crate) fn png(w: u32, h: u32) -> Bytes {
        let img = image::RgbImage::from_fn(w, h, |x, y| {
            image::Rgb([(x % 256) as u8, (y % 256) as u8, 7])
        });
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Png).unwrap();
        Bytes::from(out.into_inner())
    }

    pub(crate) fn validator(max_seq_len: u32) -> Validator {
        let tok = ChatTokenizer::from_dir(&tiny_dir()).unwrap();
        let mut cfg = DeployConfig::default_config();
        cfg.visual.max_seq_len = vec![1024, 4096];
        let mut limits = Limits::from_config(&cfg, 2, 1 << 20);
        limits.max_seq_len = max_seq_len;
        Validator::new(tok, cfg.visual, limits, "tiny".into())
    }

    fn req(parts: Vec<InputPart>) -> ChatRequest {
        ChatRequest {
            messages: vec![InputMessage {
                role: "user".into(),
                content: parts,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    fn err(v: &Validator, r: ChatRequest) -> String {
        match v.validate(r) {
            Err(GatewayError::Validation(m)) => m,
            Err(GatewayError::InvalidParam { message, .. }) => message,
            Err(e) => panic!("expected a validation error, got {e:?}"),
            Ok(r) => panic!(
                "expected a validation error, got a prompt of {} tokens",
                r.input_ids.len()
            ),
        }
    }

    #[test]
    fn expands_placeholders_and_hashes_once() {
        let v = validator(4096);
        let img = png(512, 512);
        let r = v
            .validate(req(vec![
                InputPart::Image {
                    data: img.clone(),
                    mime_type: String::new(),
                    budget: Default::default(),
                },
                InputPart::Text("hi".into()),
            ]))
            .unwrap();
        assert_eq!(r.images.len(), 1);
        let i = &r.images[0];
        assert_eq!(i.grid, [1, 32, 32]);
        assert_eq!(i.tokens, 256);
        assert_eq!(i.bucket, 1024);
        let pad = v.tokenizer().image_pad_id();
        assert_eq!(r.input_ids.iter().filter(|&&t| t == pad).count(), 256);
        assert_eq!(
            hex::encode(i.content_hash),
            hex::encode(Sha256::digest(&img))
        );
        assert_eq!(r.sampling.max_tokens, 4096 - r.prompt_tokens());
    }

    #[test]
    fn refusals_name_the_limit() {
        let v = validator(200);
        let m = err(
            &v,
            req(vec![
                InputPart::Image {
                    data: png(512, 512),
                    mime_type: String::new(),
                    budget: Default::default(),
                },
                InputPart::Text("hi".into()),
            ]),
        );
        assert!(m.contains("context limit is 200 tokens"), "{m}");

        let v = validator(4096);
        let mut r = req(vec![InputPart::Text("hi".into())]);
        r.sampling.max_tokens = 5000;
        let m = err(&v, r);
        assert!(m.contains("max_tokens (5000)") && m.contains("4096"), "{m}");

        let three: Vec<_> = (0..3)
            .map(|_| InputPart::Image {
                data: png(64, 64),
                mime_type: String::new(),
                budget: Default::default(),
            })
            .collect();
        let m = err(&v, req(three));
        assert!(m.contains("3 images") && m.contains("limit of 2"), "{m}");

        let m = err(
            &v,
            req(vec![InputPart::Image {
                data: png(2048, 2048),
                mime_type: String::new(),
                budget: Default::default(),
            }]),
        );
        assert!(m.contains("16384") && m.contains("4096"), "{m}");

        let m = err(
            &v,
            req(vec![InputPart::Image {
                data: Bytes::from_static(b"not an image"),
                mime_type: String::new(),
                budget: Default::default(),
            }]),
        );
        assert!(m.contains("image 0"), "{m}");

        let mut r = req(vec![InputPart::Text("hi".into())]);
        r.body_bytes = 2 << 20;
        let m = err(&v, r);
        assert!(
            m.contains("--max-body-bytes") && m.contains(&(1 << 20).to_string()),
            "{m}"
        );

        let mut r = req(vec![InputPart::Text("hi".into())]);
        r.model = "other".into();
        assert!(
            matches!(v.validate(r), Err(GatewayError::ModelNotFound { ref model, .. }) if model == "other")
        );

        let mut r = req(vec![InputPart::Text("hi".into())]);
        r.messages[0].role = "robot".into();
        assert!(err(&v, r).contains("role"));

        assert!(err(&v, ChatRequest::default()).contains("messages is empty"));

        // What the template would drop: a later system message, an image outside user/tool.
        let mut r = req(vec![InputPart::Text("hi".into())]);
        r.messages.push(InputMessage {
            role: "system".into(),
            content: vec![InputPart::Text("be brief".into())],
            ..Default::default()
        });
        assert!(err(&v, r).contains("messages[1] is a system message"));
        let mut r = req(vec![InputPart::Text("hi".into())]);
        r.messages.push(InputMessage {
            role: "assistant".into(),
            content: vec![InputPart::Image {
                data: png(64, 64),
                mime_type: String::new(),
                budget: Default::default(),
            }],
            ..Default::default()
        });
        assert!(
            err(&v, r).contains("messages[1].content[0] is an image or video in this assistant"),
            "template-dropped image"
        );
    }
}
