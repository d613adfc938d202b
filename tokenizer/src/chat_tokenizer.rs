//! [`ChatTokenizer`]: a checkpoint's tokenizer and chat template, loaded, rendering and
//! encoding prompts, decoding ids.
use crate::bounded;
use crate::byte_level::byte_alphabet;
use crate::error::{tok_err, Result, TokenizerError};
use crate::files::{find_template, id_list, read_json, token_string};
use crate::incremental::IncrementalDecoder;
use crate::messages::*;
use crate::template::template_env;
use minijinja::value::{Serde, Value as JinjaValue};
use minijinja::Environment;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, OnceLock};
use tokenizers::decoders::DecoderWrapper;
use tokenizers::Tokenizer;

/// The tokenizer and chat template of a checkpoint. Cheap to clone (shared).
#[derive(Clone)]
pub struct ChatTokenizer {
    pub(crate) inner: Arc<Inner>,
    /// Special tokens written in message content encode as control tokens (the old,
    /// injectable behaviour); off by default: they are text.
    pub(crate) control_tokens_in_content: bool,
}

pub(crate) struct Inner {
    pub(crate) tokenizer: Tokenizer,
    /// Holds the template "chat" when the checkpoint has one.
    pub(crate) env: Environment<'static>,
    pub(crate) has_template: bool,
    pub(crate) bos_token: Option<String>,
    pub(crate) eos_token: Option<String>,
    pub(crate) pad_token: Option<String>,
    pub(crate) image_pad_id: u32,
    pub(crate) video_pad_id: Option<u32>,
    pub(crate) vision_start_id: u32,
    pub(crate) vision_end_id: u32,
    pub(crate) eos_ids: Vec<u32>,
    pub(crate) pad_id: Option<u32>,
    /// Ids of added tokens flagged `special` (skipped by `skip_special` decoding).
    pub(crate) special_ids: HashSet<u32>,
    /// Byte-level symbol -> byte, when the decoder is ByteLevel (Qwen's); `None` otherwise.
    pub(crate) byte_decoder: Option<HashMap<char, u8>>,
    /// The text of each special added token (to find it in message content).
    pub(crate) special_texts: Vec<String>,
    /// The most bytes one token stands for: `n` bytes of text are at least
    /// `n / max_token_bytes` tokens.
    pub(crate) max_token_bytes: usize,
    /// Long text may be encoded in pieces (see `bounded`).
    pub(crate) chunkable: bool,
    /// The tokenizer with special-token matching off, made on first use.
    pub(crate) literal: OnceLock<Tokenizer>,
}

impl std::fmt::Debug for ChatTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("image_pad_id", &self.inner.image_pad_id)
            .field("eos_ids", &self.inner.eos_ids)
            .field("has_template", &self.inner.has_template)
            .finish()
    }
}

impl ChatTokenizer {
    /// Loads `tokenizer.json`, the chat template and the token settings of a checkpoint
    /// directory. When `config.json` is there, its image / vision token ids must agree with
    /// the tokenizer's.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(TokenizerError::io(
                &tok_path,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "the checkpoint has no tokenizer.json",
                ),
            ));
        }
        let tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| tok_err(&format!("{}", tok_path.display()), e))?;
        let tok_config = read_json(&dir.join("tokenizer_config.json"))?;
        let template = find_template(dir, tok_config.as_ref())?;
        let get = |k: &str| token_string(tok_config.as_ref().and_then(|c| c.get(k)));
        let generation = read_json(&dir.join("generation_config.json"))?;
        let model_config = read_json(&dir.join("config.json"))?;
        let inner = Inner::new(
            tokenizer,
            template,
            [get("bos_token"), get("eos_token"), get("pad_token")],
            id_list(generation.as_ref().and_then(|g| g.get("eos_token_id"))),
        )?;
        if let Some(cfg) = model_config {
            inner.check_against_config(&cfg, &dir.join("config.json"))?;
        }
        Ok(ChatTokenizer {
            inner: Arc::new(inner),
            control_tokens_in_content: false,
        })
    }

    /// With `on`, special tokens written in message content encode as control tokens, as
    /// transformers' `apply_chat_template` does (injectable: a user can close their turn and
    /// open a system one). Off (the default), they are text.
    pub fn with_control_tokens_in_content(mut self, on: bool) -> Self {
        self.control_tokens_in_content = on;
        self
    }
    pub fn control_tokens_in_content(&self) -> bool {
        self.control_tokens_in_content
    }

    /// The fewest tokens `bytes` bytes of text can encode to (every token stands for at most
    /// `max_token_bytes` bytes): lets a caller refuse text too long before encoding it.
    pub fn min_tokens(&self, bytes: usize) -> usize {
        bytes.div_ceil(self.inner.max_token_bytes)
    }

    /// The underlying HF tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.inner.tokenizer
    }

    /// Renders `messages` with the chat template; `add_generation_prompt` appends the
    /// assistant turn opening (`<|im_start|>assistant\n`).
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, &[], add_generation_prompt)
    }

    /// [`Self::render`] with `tools` (OpenAI's `{"type": "function", "function": {...}}`
    /// objects, as the template's `tools`; none = the template's tool-free branch).
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let i = &self.inner;
        if !i.has_template {
            return Err(TokenizerError::Tokenizer(
                "the checkpoint has no chat template".into(),
            ));
        }
        let ctx = json!({
            "messages": messages.iter().map(ChatMessage::to_json).collect::<Vec<_>>(),
            "add_generation_prompt": add_generation_prompt,
            "tools": (!tools.is_empty()).then_some(tools),
            "bos_token": i.bos_token.clone().unwrap_or_default(),
            "eos_token": i.eos_token.clone().unwrap_or_default(),
            "pad_token": i.pad_token.clone().unwrap_or_default(),
        });
        let tmpl = i
            .env
            .get_template("chat")
            .map_err(|e| tok_err("chat template", e))?;
        tmpl.render(JinjaValue::from(Serde(&ctx)))
            .map_err(|e| tok_err("chat template render", e))
    }

    /// Encodes text as is: added tokens written in the text (`<|im_start|>`, ...) become their
    /// ids; nothing is prepended or appended.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_within(text, usize::MAX)
    }

    /// [`Self::encode`], refused with [`TokenizerError::TooLong`] once over `limit` tokens:
    /// before encoding when the byte length alone proves it, else as soon as the count
    /// passes it (long text is encoded in pieces, keeping only ids).
    pub fn encode_within(&self, text: &str, limit: usize) -> Result<Vec<u32>> {
        self.check_bytes(text.len(), limit)?;
        let mut ids = Vec::new();
        let i = &self.inner;
        bounded::encode_within(&i.tokenizer, text, limit, i.chunkable, &mut ids)?;
        Ok(ids)
    }

    pub(crate) fn check_bytes(&self, bytes: usize, limit: usize) -> Result<()> {
        let at_least = self.min_tokens(bytes);
        if at_least > limit {
            return Err(TokenizerError::TooLong { at_least, limit });
        }
        Ok(())
    }

    /// Renders `messages` with the generation prompt, encodes, and expands the k-th image's
    /// `<|image_pad|>` into `image_token_counts[k]` copies.
    pub fn encode_prompt(
        &self,
        messages: &[ChatMessage],
        image_token_counts: &[usize],
    ) -> Result<Vec<u32>> {
        self.encode_prompt_with_tools(messages, &[], image_token_counts)
    }

    /// [`Self::encode_prompt`] with `tools` rendered by the template.
    pub fn encode_prompt_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[Value],
        image_token_counts: &[usize],
    ) -> Result<Vec<u32>> {
        self.encode_prompt_within(messages, tools, image_token_counts, usize::MAX)
    }

    /// [`Self::encode_prompt_with_tools`], refused with [`TokenizerError::TooLong`] once the
    /// prompt (images expanded) is over `limit` tokens; text too long is refused before the
    /// template runs. Special tokens written in message content or tool definitions are
    /// text unless [`Self::with_control_tokens_in_content`] is on.
    pub fn encode_prompt_within(
        &self,
        messages: &[ChatMessage],
        tools: &[Value],
        image_token_counts: &[usize],
        limit: usize,
    ) -> Result<Vec<u32>> {
        let vision: Vec<VisionTokens> = image_token_counts
            .iter()
            .map(|&n| VisionTokens::Image(n))
            .collect();
        self.encode_prompt_vision(messages, tools, &vision, limit)
    }

    /// Decodes ids to text, special tokens included (as transformers' default).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .tokenizer
            .decode(ids, false)
            .map_err(|e| tok_err("decode", e))
    }

    /// Decodes ids to text, leaving out tokens flagged special (`<|im_end|>`, ...).
    pub fn decode_skip_special(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .tokenizer
            .decode(ids, true)
            .map_err(|e| tok_err("decode", e))
    }

    /// A streaming decoder over this tokenizer.
    pub fn incremental_decoder(&self, skip_special: bool) -> IncrementalDecoder {
        IncrementalDecoder::new(self.clone(), skip_special)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.tokenizer.token_to_id(token)
    }
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.tokenizer.id_to_token(id)
    }
    /// The bytes token `id` stands for in decoded text (special tokens: their content), as
    /// OpenAI's logprob `bytes`; `None` for an id the tokenizer does not know.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let inner = &self.inner;
        match &inner.byte_decoder {
            Some(table) => inner.token_bytes(id, false, table),
            None => {
                inner.tokenizer.id_to_token(id)?;
                inner
                    .tokenizer
                    .decode(&[id], false)
                    .ok()
                    .map(String::into_bytes)
            }
        }
    }
    /// Tokens known to the tokenizer, added tokens included (may be below the embedding's rows).
    pub fn vocab_size(&self) -> usize {
        self.inner.tokenizer.get_vocab_size(true)
    }
    pub fn image_pad_id(&self) -> u32 {
        self.inner.image_pad_id
    }
    pub fn video_pad_id(&self) -> Option<u32> {
        self.inner.video_pad_id
    }
    pub fn vision_start_id(&self) -> u32 {
        self.inner.vision_start_id
    }
    pub fn vision_end_id(&self) -> u32 {
        self.inner.vision_end_id
    }
    /// Ids that end generation: generation_config.json's `eos_token_id`, plus the
    /// `eos_token` of tokenizer_config.json.
    pub fn eos_ids(&self) -> &[u32] {
        &self.inner.eos_ids
    }
    pub fn pad_id(&self) -> Option<u32> {
        self.inner.pad_id
    }
    pub fn is_special(&self, id: u32) -> bool {
        self.inner.special_ids.contains(&id)
    }
    pub fn has_chat_template(&self) -> bool {
        self.inner.has_template
    }
}

impl Inner {
    pub(crate) fn new(
        tokenizer: Tokenizer,
        template: Option<String>,
        [bos_token, eos_token, pad_token]: [Option<String>; 3],
        generation_eos: Vec<u32>,
    ) -> Result<Self> {
        let need = |t: &str| {
            tokenizer.token_to_id(t).ok_or_else(|| {
                TokenizerError::Tokenizer(format!("tokenizer.json has no {t} token"))
            })
        };
        let image_pad_id = need(IMAGE_PAD)?;
        let vision_start_id = need(VISION_START)?;
        let vision_end_id = need(VISION_END)?;
        let video_pad_id = tokenizer.token_to_id(VIDEO_PAD);
        let mut eos_ids = generation_eos;
        if let Some(id) = eos_token.as_deref().and_then(|t| tokenizer.token_to_id(t)) {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        if eos_ids.is_empty() {
            return Err(TokenizerError::Tokenizer(
                "no end-of-sequence token: neither generation_config.json eos_token_id nor tokenizer_config.json eos_token".into(),
            ));
        }
        let pad_id = pad_token.as_deref().and_then(|t| tokenizer.token_to_id(t));
        let special_ids = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect();
        let byte_decoder = match tokenizer.get_decoder() {
            Some(DecoderWrapper::ByteLevel(_)) => {
                Some(byte_alphabet().into_iter().map(|(b, c)| (c, b)).collect())
            }
            _ => None,
        };
        let has_template = template.is_some();
        let special_texts = tokenizer
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special)
            .map(|t| t.content)
            .collect();
        let chunkable = bounded::cuts_are_safe(&tokenizer);
        let max_token_bytes = max_token_bytes(&tokenizer, byte_decoder.as_ref());
        Ok(Inner {
            special_texts,
            max_token_bytes,
            chunkable,
            literal: OnceLock::new(),
            env: template_env(template)?,
            tokenizer,
            has_template,
            bos_token,
            eos_token,
            pad_token,
            image_pad_id,
            video_pad_id,
            vision_start_id,
            vision_end_id,
            eos_ids,
            pad_id,
            special_ids,
            byte_decoder,
        })
    }

    /// config.json's multimodal token ids must be the tokenizer's.
    pub(crate) fn check_against_config(&self, cfg: &Value, path: &Path) -> Result<()> {
        let pairs = [
            ("image_token_id", IMAGE_PAD, Some(self.image_pad_id)),
            ("video_token_id", VIDEO_PAD, self.video_pad_id),
            (
                "vision_start_token_id",
                VISION_START,
                Some(self.vision_start_id),
            ),
            ("vision_end_token_id", VISION_END, Some(self.vision_end_id)),
        ];
        for (key, token, id) in pairs {
            let (Some(want), Some(id)) = (cfg.get(key).and_then(|v| v.as_u64()), id) else {
                continue;
            };
            if want != id as u64 {
                return Err(TokenizerError::Config {
                    path: path.to_path_buf(),
                    message: format!("{key} is {want} but tokenizer.json has {token} at id {id}"),
                });
            }
        }
        Ok(())
    }

    /// The bytes token `id` contributes to decoded text (ByteLevel decoding, as the `tokenizers`
    /// ByteLevel decoder does it); `None` for unknown ids and skipped special tokens.
    pub(crate) fn token_bytes(
        &self,
        id: u32,
        skip_special: bool,
        table: &HashMap<char, u8>,
    ) -> Option<Vec<u8>> {
        if skip_special && self.special_ids.contains(&id) {
            return None;
        }
        let token = self.tokenizer.id_to_token(id)?;
        let mapped: Option<Vec<u8>> = token.chars().map(|c| table.get(&c).copied()).collect();
        Some(mapped.unwrap_or_else(|| token.into_bytes()))
    }
}

/// The most bytes of text one token of `tok` stands for (at least 1).
fn max_token_bytes(tok: &Tokenizer, byte_decoder: Option<&HashMap<char, u8>>) -> usize {
    let vocab = tok.get_vocab(true);
    let len = |t: &str| match byte_decoder {
        Some(table) if t.chars().all(|c| table.contains_key(&c)) => t.chars().count(),
        _ => t.len(),
    };
    vocab.keys().map(|t| len(t)).max().unwrap_or(1).max(1)
}
