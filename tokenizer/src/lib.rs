//! The checkpoint tokenizer and chat template (host-side: no tensor library, no model).
//!
//! [`ChatTokenizer`] loads `tokenizer.json` (HF `tokenizers`) and the chat template
//! (`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`, else
//! `chat_template.json`), renders conversations the way transformers' `apply_chat_template`
//! does (Jinja with `trim_blocks` and `lstrip_blocks`, `namespace`, loop controls, Python
//! string methods, `raise_exception`, a Python-compatible `tojson`), and turns a rendered
//! prompt into ids with each image's single `<|image_pad|>` expanded to that image's token
//! count. [`IncrementalDecoder`] turns a stream of generated ids into text without ever
//! splitting a character.
mod bounded;
mod byte_level;
mod error;
mod literal;

pub use byte_level::byte_alphabet;
pub use error::{Result, TokenizerError};
use minijinja::value::{Kwargs, Serde, Value as JinjaValue, ValueKind};
use minijinja::{Environment, ErrorKind};
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, OnceLock};
use tokenizers::decoders::DecoderWrapper;
use tokenizers::Tokenizer;

pub const IMAGE_PAD: &str = "<|image_pad|>";
pub const VIDEO_PAD: &str = "<|video_pad|>";
pub const VISION_START: &str = "<|vision_start|>";
pub const VISION_END: &str = "<|vision_end|>";

/// One part of a message's content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatPart {
    Text(String),
    /// An image; the template renders `<|vision_start|><|image_pad|><|vision_end|>`.
    Image,
    /// A video; the template renders `<|vision_start|><|video_pad|><|vision_end|>`, whose pad
    /// the encoder expands into the video's temporal groups ([`VisionTokens::Video`]).
    Video,
}

/// The prompt text before a video temporal group at `seconds` (`replace_video_token`'s
/// `f"<{t:.1f} seconds>"`; Python and Rust both round the exact binary value, ties to even).
pub fn timestamp_text(seconds: f64) -> String {
    format!("<{seconds:.1} seconds>")
}

/// What one image or video placeholder of a prompt expands to, in prompt order.
#[derive(Debug, Clone, PartialEq)]
pub enum VisionTokens {
    /// An image: this many `<|image_pad|>`.
    Image(usize),
    /// A video: per temporal group, `<{t:.1f} seconds>` (as text) + `<|vision_start|>` +
    /// `tokens_per_group` x `<|video_pad|>` + `<|vision_end|>`
    /// (`Qwen3VLProcessor.replace_video_token`), one group per timestamp.
    Video {
        tokens_per_group: usize,
        timestamps: Vec<f64>,
    },
}

/// One conversation turn. Rendered as `{"role": ..., "content": [{"type": "text", "text":
/// ...} | {"type": "image"}, ...]}`, the list form the Qwen3-VL template expects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: Vec<ChatPart>,
    /// An assistant turn's tool calls, rendered by the template as `<tool_call>` blocks.
    pub tool_calls: Vec<ToolCall>,
}

/// One function call of an assistant turn: the function's name and its arguments as JSON
/// text (as OpenAI carries them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: Vec<ChatPart>) -> Self {
        ChatMessage {
            role: role.into(),
            content,
            tool_calls: Vec::new(),
        }
    }
    pub fn system(text: impl Into<String>) -> Self {
        Self::new("system", vec![ChatPart::Text(text.into())])
    }
    pub fn user(content: Vec<ChatPart>) -> Self {
        Self::new("user", content)
    }
    pub fn user_text(text: impl Into<String>) -> Self {
        Self::new("user", vec![ChatPart::Text(text.into())])
    }
    pub fn assistant(text: impl Into<String>) -> Self {
        Self::new("assistant", vec![ChatPart::Text(text.into())])
    }
    pub fn image_count(&self) -> usize {
        self.content
            .iter()
            .filter(|p| matches!(p, ChatPart::Image))
            .count()
    }
    pub fn video_count(&self) -> usize {
        self.content
            .iter()
            .filter(|p| matches!(p, ChatPart::Video))
            .count()
    }
    /// The text this message's content and tool calls carry.
    fn texts(&self) -> impl Iterator<Item = &str> {
        let parts = self.content.iter().filter_map(|p| match p {
            ChatPart::Text(t) => Some(t.as_str()),
            ChatPart::Image | ChatPart::Video => None,
        });
        let calls = self
            .tool_calls
            .iter()
            .flat_map(|c| [c.name.as_str(), c.arguments.as_str()]);
        parts.chain(calls)
    }
    fn text_bytes(&self) -> usize {
        self.texts().map(str::len).sum()
    }
    fn to_json(&self) -> Value {
        let parts: Vec<Value> = self
            .content
            .iter()
            .map(|p| match p {
                ChatPart::Text(t) => json!({"type": "text", "text": t}),
                ChatPart::Image => json!({"type": "image"}),
                ChatPart::Video => json!({"type": "video"}),
            })
            .collect();
        let mut m = json!({"role": self.role, "content": parts});
        if !self.tool_calls.is_empty() {
            m["tool_calls"] = self
                .tool_calls
                .iter()
                .map(|c| json!({"type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
                .collect();
        }
        m
    }
}

/// The tokenizer and chat template of a checkpoint. Cheap to clone (shared).
#[derive(Clone)]
pub struct ChatTokenizer {
    inner: Arc<Inner>,
    /// Special tokens written in message content encode as control tokens (the old,
    /// injectable behaviour); off by default: they are text.
    control_tokens_in_content: bool,
}

struct Inner {
    tokenizer: Tokenizer,
    /// Holds the template "chat" when the checkpoint has one.
    env: Environment<'static>,
    has_template: bool,
    bos_token: Option<String>,
    eos_token: Option<String>,
    pad_token: Option<String>,
    image_pad_id: u32,
    video_pad_id: Option<u32>,
    vision_start_id: u32,
    vision_end_id: u32,
    eos_ids: Vec<u32>,
    pad_id: Option<u32>,
    /// Ids of added tokens flagged `special` (skipped by `skip_special` decoding).
    special_ids: HashSet<u32>,
    /// Byte-level symbol -> byte, when the decoder is ByteLevel (Qwen's); `None` otherwise.
    byte_decoder: Option<HashMap<char, u8>>,
    /// The text of each special added token (to find it in message content).
    special_texts: Vec<String>,
    /// The most bytes one token stands for: `n` bytes of text are at least
    /// `n / max_token_bytes` tokens.
    max_token_bytes: usize,
    /// Long text may be encoded in pieces (see `bounded`).
    chunkable: bool,
    /// The tokenizer with special-token matching off, made on first use.
    literal: OnceLock<Tokenizer>,
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

/// Messages and tools as [`ChatTokenizer::wrap_content`] gives them, and whether any content
/// was wrapped.
type Wrapped<'a> = (
    std::borrow::Cow<'a, [ChatMessage]>,
    std::borrow::Cow<'a, [Value]>,
    bool,
);

/// Whether any string inside `v` satisfies `f`.
fn json_holds(v: &Value, f: &impl Fn(&str) -> bool) -> bool {
    match v {
        Value::String(s) => f(s),
        Value::Array(items) => items.iter().any(|i| json_holds(i, f)),
        Value::Object(map) => map.values().any(|i| json_holds(i, f)),
        _ => false,
    }
}

fn tok_err(context: &str, e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Tokenizer(format!("{context}: {e}"))
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| TokenizerError::io(path, e))?;
    let value = serde_json::from_str(&text).map_err(|e| TokenizerError::Config {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    Ok(Some(value))
}

/// A token in tokenizer_config.json: a string, or an AddedToken object with "content".
fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    }
}

fn id_list(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|n| n.as_u64())
            .map(|n| n as u32)
            .collect(),
        _ => Vec::new(),
    }
}

/// The chat template text: chat_template.jinja, tokenizer_config's chat_template (a string,
/// or a list of {name, template} from which "default" is taken), chat_template.json.
fn find_template(dir: &Path, tokenizer_config: Option<&Value>) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        return std::fs::read_to_string(&jinja)
            .map(Some)
            .map_err(|e| TokenizerError::io(&jinja, e));
    }
    let from_value = |v: &Value| -> Option<String> {
        match v {
            Value::String(s) => Some(s.clone()),
            Value::Array(list) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .or(list.first())
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_string),
            _ => None,
        }
    };
    if let Some(t) = tokenizer_config
        .and_then(|c| c.get("chat_template"))
        .and_then(from_value)
    {
        return Ok(Some(t));
    }
    if let Some(v) = read_json(&dir.join("chat_template.json"))? {
        if let Some(t) = v.get("chat_template").and_then(from_value) {
            return Ok(Some(t));
        }
    }
    Ok(None)
}

/// A Jinja environment configured like transformers' chat-template environment.
fn template_env(template: Option<String>) -> Result<Environment<'static>> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| tok_err("chat template syntax", e))?;
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<JinjaValue, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_filter("tojson", tojson);
    if let Some(t) = template {
        env.add_template_owned("chat", t)
            .map_err(|e| tok_err("chat template does not parse", e))?;
    }
    Ok(env)
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)`, as transformers' `tojson`
/// (no HTML escaping, `", "` and `": "` separators).
fn tojson(value: &JinjaValue, kwargs: Kwargs) -> std::result::Result<JinjaValue, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, indent, 0)?;
    Ok(JinjaValue::from_safe_string(out))
}

fn write_json(
    out: &mut String,
    v: &JinjaValue,
    indent: Option<usize>,
    depth: usize,
) -> std::result::Result<(), minijinja::Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64() {
                out.push_str(&i.to_string());
            } else {
                let f = f64::try_from(v.clone())?;
                out.push_str(&serde_json::to_string(&f).unwrap_or_else(|_| "NaN".into()));
            }
        }
        ValueKind::String => {
            out.push_str(&serde_json::to_string(v.as_str().unwrap_or("")).unwrap_or_default())
        }
        ValueKind::Map => {
            out.push('{');
            let mut first = true;
            for key in v.try_iter()? {
                if !first {
                    out.push_str(sep);
                }
                first = false;
                newline(out, depth + 1);
                let k = key
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| key.to_string());
                out.push_str(&serde_json::to_string(&k).unwrap_or_default());
                out.push_str(": ");
                write_json(out, &v.get_item(&key)?, indent, depth + 1)?;
            }
            if !first {
                newline(out, depth);
            }
            out.push('}');
        }
        _ => {
            out.push('[');
            let mut first = true;
            for item in v.try_iter()? {
                if !first {
                    out.push_str(sep);
                }
                first = false;
                newline(out, depth + 1);
                write_json(out, &item, indent, depth + 1)?;
            }
            if !first {
                newline(out, depth);
            }
            out.push(']');
        }
    }
    Ok(())
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

    fn check_bytes(&self, bytes: usize, limit: usize) -> Result<()> {
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

    /// [`Self::encode_prompt_within`] for prompts with images and videos: `vision[k]` is the
    /// k-th image or video part of the messages, in order.
    pub fn encode_prompt_vision(
        &self,
        messages: &[ChatMessage],
        tools: &[Value],
        vision: &[VisionTokens],
        limit: usize,
    ) -> Result<Vec<u32>> {
        let expansions = self.vision_expansions(messages, vision)?;
        // Tokens the expansion adds: each placeholder is already one token of the text.
        let image_tokens: usize = expansions.iter().map(|e| e.len().saturating_sub(1)).sum();
        let room = limit.saturating_sub(image_tokens);
        let text_bytes: usize = messages.iter().map(ChatMessage::text_bytes).sum();
        self.check_bytes(text_bytes, room)
            .map_err(|e| e.plus(image_tokens))?;
        let i = &self.inner;
        let (messages, tools, wrapped) = self.wrap_content(messages, tools)?;
        let text = self.render_with_tools(&messages, &tools, true)?;
        let mut ids = Vec::new();
        if wrapped {
            for (span, literal) in literal::spans(&text)? {
                let tok = if literal {
                    self.literal()
                } else {
                    &i.tokenizer
                };
                bounded::encode_within(tok, span, room, i.chunkable, &mut ids)
                    .map_err(|e| e.plus(image_tokens))?;
            }
        } else {
            bounded::encode_within(&i.tokenizer, &text, room, i.chunkable, &mut ids)
                .map_err(|e| e.plus(image_tokens))?;
        }
        self.expand_vision_pads(&ids, &expansions)
    }

    /// The ids each vision placeholder becomes, checked against the messages' parts.
    fn vision_expansions(
        &self,
        messages: &[ChatMessage],
        vision: &[VisionTokens],
    ) -> Result<Vec<Vec<u32>>> {
        let parts: Vec<&ChatPart> = messages
            .iter()
            .flat_map(|m| &m.content)
            .filter(|p| !matches!(p, ChatPart::Text(_)))
            .collect();
        let (images, videos) = (
            parts
                .iter()
                .filter(|p| matches!(p, ChatPart::Image))
                .count(),
            parts
                .iter()
                .filter(|p| matches!(p, ChatPart::Video))
                .count(),
        );
        let given = |want_video: bool| {
            vision
                .iter()
                .filter(|v| matches!(v, VisionTokens::Video { .. }) == want_video)
                .count()
        };
        if images != given(false) || videos != given(true) {
            return Err(TokenizerError::invalid(format!(
                "the messages hold {images} images and {videos} videos but {} image and {} \
                 video token counts were given",
                given(false),
                given(true)
            )));
        }
        let i = &self.inner;
        let mut out = Vec::with_capacity(vision.len());
        for (k, (part, v)) in parts.iter().zip(vision).enumerate() {
            match (part, v) {
                (ChatPart::Image, VisionTokens::Image(0)) => {
                    return Err(TokenizerError::invalid(format!(
                        "image {k} has 0 tokens; every image has at least 1"
                    )))
                }
                (ChatPart::Image, VisionTokens::Image(n)) => out.push(vec![i.image_pad_id; *n]),
                (
                    ChatPart::Video,
                    VisionTokens::Video {
                        tokens_per_group,
                        timestamps,
                    },
                ) => {
                    let pad = i.video_pad_id.ok_or_else(|| {
                        TokenizerError::invalid(format!(
                            "this tokenizer has no {VIDEO_PAD} token: videos cannot be served"
                        ))
                    })?;
                    if *tokens_per_group == 0 || timestamps.is_empty() {
                        return Err(TokenizerError::invalid(format!(
                            "video part {k} has {} groups of {tokens_per_group} tokens; a video \
                             has at least one group of at least 1 token",
                            timestamps.len()
                        )));
                    }
                    let mut ids = Vec::new();
                    for &t in timestamps {
                        let text = timestamp_text(t);
                        ids.extend(self.encode(&text)?);
                        ids.push(i.vision_start_id);
                        ids.extend(std::iter::repeat_n(pad, *tokens_per_group));
                        ids.push(i.vision_end_id);
                    }
                    out.push(ids);
                }
                _ => {
                    return Err(TokenizerError::invalid(format!(
                        "vision part {k} of the messages and its token count disagree on image \
                         or video"
                    )))
                }
            }
        }
        Ok(out)
    }

    /// Replaces the k-th image or video placeholder of `ids` (`<|image_pad|>` /
    /// `<|video_pad|>`, in prompt order) with `expansions[k]`.
    fn expand_vision_pads(&self, ids: &[u32], expansions: &[Vec<u32>]) -> Result<Vec<u32>> {
        let i = &self.inner;
        let is_pad = |t: u32| t == i.image_pad_id || Some(t) == i.video_pad_id;
        let found = ids.iter().filter(|&&t| is_pad(t)).count();
        if found != expansions.len() {
            return Err(TokenizerError::invalid(format!(
                "the prompt holds {found} {IMAGE_PAD}/{VIDEO_PAD} placeholders but {} images and \
                 videos were given (text must not contain the placeholder itself)",
                expansions.len()
            )));
        }
        let mut out =
            Vec::with_capacity(ids.len() + expansions.iter().map(Vec::len).sum::<usize>());
        let mut next = expansions.iter();
        for &t in ids {
            if is_pad(t) {
                let e = next.next().map(Vec::as_slice).unwrap_or(&[]);
                // The template's pad and the expansion agree on the kind.
                let kind_ok = e.is_empty()
                    || (t == i.image_pad_id) == (e.iter().any(|&x| x == i.image_pad_id));
                if !kind_ok {
                    return Err(TokenizerError::invalid(
                        "the template placed an image placeholder where a video was expected, or \
                         the reverse",
                    ));
                }
                out.extend_from_slice(e);
            } else {
                out.push(t);
            }
        }
        Ok(out)
    }

    /// The messages and tools with content holding special-token text wrapped for literal
    /// encoding (borrowed as they are when nothing needs it), and whether any was.
    fn wrap_content<'a>(
        &self,
        messages: &'a [ChatMessage],
        tools: &'a [Value],
    ) -> Result<Wrapped<'a>> {
        use std::borrow::Cow;
        let specials = &self.inner.special_texts;
        let in_text = |t: &str| literal::holds_special(t, specials);
        // The template pastes a message's adjacent text parts together, so a special token's
        // text split over two parts (`"<|im_"`, `"start|>"`) counts: every text part of such
        // a message is encoded literally.
        let holds = |m: &ChatMessage| {
            literal::joined_runs(&m.content).any(|run| in_text(&run))
                || m.tool_calls
                    .iter()
                    .any(|c| in_text(&c.name) || in_text(&c.arguments))
        };
        let needed = !self.control_tokens_in_content
            && (messages.iter().any(holds) || tools.iter().any(|t| json_holds(t, &in_text)));
        if !needed {
            return Ok((Cow::Borrowed(messages), Cow::Borrowed(tools), false));
        }
        let mut msgs = messages.to_vec();
        for m in msgs.iter_mut().filter(|m| holds(m)) {
            for part in &mut m.content {
                if let ChatPart::Text(t) = part {
                    *t = literal::wrap_always(t)?;
                }
            }
            for c in &mut m.tool_calls {
                for t in [&mut c.name, &mut c.arguments] {
                    if let Some(w) = literal::wrap(t, specials)? {
                        *t = w;
                    }
                }
            }
        }
        let mut tools = tools.to_vec();
        for t in &mut tools {
            literal::wrap_json(t, specials)?;
        }
        Ok((Cow::Owned(msgs), Cow::Owned(tools), true))
    }

    fn literal(&self) -> &Tokenizer {
        self.inner.literal.get_or_init(|| {
            let mut t = self.inner.tokenizer.clone();
            t.set_encode_special_tokens(true);
            t
        })
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
    fn new(
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
    fn check_against_config(&self, cfg: &Value, path: &Path) -> Result<()> {
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
    fn token_bytes(
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

/// Streams generated ids into text. `push` returns only complete UTF-8 text: bytes of a
/// character split over several byte-level tokens are held until the character is whole
/// (invalid bytes become U+FFFD, as in [`ChatTokenizer::decode`]). The concatenation of
/// everything `push` and `finish` return equals decoding all ids at once.
pub struct IncrementalDecoder {
    tok: ChatTokenizer,
    skip_special: bool,
    /// Byte-level path: bytes not yet returned (at most an incomplete character).
    pending: Vec<u8>,
    /// Fallback path (non byte-level decoders): `tokenizers`' stream state.
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

impl IncrementalDecoder {
    pub fn new(tok: ChatTokenizer, skip_special: bool) -> Self {
        IncrementalDecoder {
            tok,
            skip_special,
            pending: Vec::new(),
            ids: Vec::new(),
            prefix: String::new(),
            prefix_index: 0,
        }
    }

    /// Adds one id; returns the text it completes, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        let inner = &self.tok.inner;
        let Some(table) = &inner.byte_decoder else {
            return tokenizers::tokenizer::step_decode_stream(
                &inner.tokenizer,
                vec![id],
                self.skip_special,
                &mut self.ids,
                &mut self.prefix,
                &mut self.prefix_index,
            )
            .map_err(|e| tok_err("decode", e));
        };
        if let Some(bytes) = inner.token_bytes(id, self.skip_special, table) {
            self.pending.extend_from_slice(&bytes);
        }
        let text = take_complete(&mut self.pending, false);
        Ok((!text.is_empty()).then_some(text))
    }

    /// Ends the stream: returns what is still held (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self) -> Result<Option<String>> {
        if self.tok.inner.byte_decoder.is_none() {
            let all = self
                .tok
                .inner
                .tokenizer
                .decode(&self.ids, self.skip_special)
                .map_err(|e| tok_err("decode", e))?;
            let rest = all.get(self.prefix.len()..).unwrap_or("").to_string();
            self.ids.clear();
            self.prefix.clear();
            self.prefix_index = 0;
            return Ok((!rest.is_empty()).then_some(rest));
        }
        let text = take_complete(&mut self.pending, true);
        Ok((!text.is_empty()).then_some(text))
    }
}

/// Removes and returns the longest decodable prefix of `pending`, exactly as
/// `String::from_utf8_lossy` would decode it; an incomplete trailing character stays unless
/// `last`.
fn take_complete(pending: &mut Vec<u8>, last: bool) -> String {
    let mut out = String::new();
    let mut start = 0;
    while start < pending.len() {
        match std::str::from_utf8(&pending[start..]) {
            Ok(s) => {
                out.push_str(s);
                start = pending.len();
            }
            Err(e) => {
                let valid = e.valid_up_to();
                out.push_str(
                    std::str::from_utf8(&pending[start..start + valid]).unwrap_or_default(),
                );
                start += valid;
                match e.error_len() {
                    Some(n) => {
                        out.push('\u{FFFD}');
                        start += n;
                    }
                    None => {
                        if last {
                            out.push('\u{FFFD}');
                            start = pending.len();
                        }
                        break;
                    }
                }
            }
        }
    }
    pending.drain(..start);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shareable_across_threads() {
        fn send_sync<T: Send + Sync>() {}
        fn send<T: Send>() {}
        send_sync::<ChatTokenizer>();
        send::<IncrementalDecoder>();
    }

    #[test]
    fn take_complete_matches_lossy_decoding() {
        let samples: [&[u8]; 5] = [
            "héllo 🦀 世界".as_bytes(),
            &[0xF0, 0x9F, 0xA6],
            &[0x80, b'a', 0xE4, 0xB8],
            &[0xFF, 0xC3, 0xA9, 0xC3],
            &[0xE4, 0x41, 0xF0, 0x9F, 0x98, 0x80],
        ];
        for s in samples {
            let mut pending = Vec::new();
            let mut out = String::new();
            for &b in s {
                pending.push(b);
                out.push_str(&take_complete(&mut pending, false));
            }
            out.push_str(&take_complete(&mut pending, true));
            assert_eq!(out, String::from_utf8_lossy(s), "{s:?}");
        }
    }
}

#[cfg(test)]
mod video_tests {
    use super::timestamp_text;

    #[test]
    fn timestamps_print_as_python_does() {
        // Python: f"{0.25:.1f}" == "0.2", f"{0.35:.1f}" == "0.3" (0.35 is below it in binary),
        // f"{0.75:.1f}" == "0.8", f"{0.45:.1f}" == "0.5".
        assert_eq!(timestamp_text(0.25), "<0.2 seconds>");
        assert_eq!(timestamp_text(0.35), "<0.3 seconds>");
        assert_eq!(timestamp_text(0.75), "<0.8 seconds>");
        assert_eq!(timestamp_text(0.45), "<0.5 seconds>");
        assert_eq!(timestamp_text(1.0), "<1.0 seconds>");
    }
}
