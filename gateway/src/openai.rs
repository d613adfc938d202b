//! The OpenAI-compatible HTTP surface: `POST /v1/chat/completions` (text and `image_url` parts
//! as `data:` URLs, or http(s):// URLs on `--allow-image-host` hosts, fetched by [`crate::fetch`];
//! `stream: true` as SSE chunks ending with `data: [DONE]`), `GET /v1/models`,
//! `GET /health`, `GET /metrics`. A body field this server does not implement is a 400 naming
//! it ([`crate::openai_params`]); other routes and methods are OpenAI-shaped 404 / 405s.
use crate::auth::ApiKeys;
use crate::error::{openai_error_body, GatewayError};
use crate::fetch::{ImageFetcher, Target};
use crate::generate::{Core, Delta, Tally};
use crate::logprobs::{openai_content, ShownLogprob};
use crate::openai_params::check_unread;
use crate::openai_sampling::SamplingFields;
use crate::response_format::StructuredFields;
use crate::tool_calls::{self, call_id, CallStream, Tools};
use crate::validation::{ChatRequest, InputMessage, InputPart};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use base64::Engine;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::watch;
use vlm_config::PixelBudget;
use vlm_service_kit::generation::{Finish, Usage};
use vlm_tokenizer::ToolCall;

#[derive(Clone)]
pub struct HttpState {
    pub core: Core,
    pub keys: ApiKeys,
    pub ready: watch::Receiver<bool>,
    pub metrics: metrics_exporter_prometheus::PrometheusHandle,
    /// Fetches allow-listed http(s) image URLs.
    pub images: ImageFetcher,
}

pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route(
            "/v1/completions",
            post(crate::openai_completions::completions),
        )
        .route("/tokenize", post(crate::openai_completions::tokenize))
        .route("/detokenize", post(crate::openai_completions::detokenize))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn(trim_after_large_bodies))
        .with_state(state)
}

/// After a request whose body was large (a refused 30 MB prompt, a body of images), the heap it
/// freed goes back to the system instead of staying with the process.
async fn trim_after_large_bodies(req: Request, next: axum::middleware::Next) -> Response {
    let length = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        .unwrap_or(0);
    let _trim = vlm_service_kit::memory::TrimOnDrop::for_bytes(length);
    next.run(req).await
}

/// OpenAI's error body for an HTTP status this API answers outside its handlers.
fn route_error(status: StatusCode, message: String) -> Response {
    let body = openai_error_body(
        &message,
        "invalid_request_error",
        None,
        status.as_u16().into(),
    );
    (status, axum::Json(body)).into_response()
}

async fn not_found(req: Request) -> Response {
    route_error(
        StatusCode::NOT_FOUND,
        format!(
            "no route {} {}: this server serves POST /v1/chat/completions, POST /v1/completions, \
             POST /tokenize, POST /detokenize, GET /v1/models, GET /v1/models/{{id}}, \
             GET /health, GET /metrics",
            req.method(),
            req.uri().path()
        ),
    )
}

async fn method_not_allowed(req: Request) -> Response {
    route_error(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}

async fn health(State(s): State<HttpState>) -> Response {
    if *s.ready.borrow() {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: no healthy LM or vision replica\n",
        )
            .into_response()
    }
}

async fn metrics_text(State(s): State<HttpState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

fn auth(s: &HttpState, req: &Request) -> Result<(), GatewayError> {
    let h = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    s.keys.check(h)
}

/// The served model as `/v1/models` lists it, or why it cannot be listed yet: tools that
/// wait for a server by polling `/v1/models` (as they do for vLLM, whose port opens only when
/// it can serve) see 503 for as long as `/health` does.
fn served_model(s: &HttpState, req: &Request) -> Result<Value, GatewayError> {
    auth(s, req)?;
    if !*s.ready.borrow() {
        return Err(GatewayError::Unavailable(
            "not ready: no healthy LM or vision replica yet (GET /health turns 200 when it can \
             serve)"
                .into(),
        ));
    }
    let id = s.core.validator().model_id();
    Ok(json!({"id": id, "object": "model", "created": 0, "owned_by": "vlm"}))
}

async fn models(State(s): State<HttpState>, req: Request) -> Response {
    match served_model(&s, &req) {
        Ok(m) => axum::Json(json!({"object": "list", "data": [m]})).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/models/{id}` (the SDK's `models.retrieve`): the served model, else 404.
async fn model(
    State(s): State<HttpState>,
    axum::extract::Path(id): axum::extract::Path<String>,
    req: Request,
) -> Response {
    let served = match served_model(&s, &req) {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    match s.core.validator().check_model(&id) {
        Ok(()) if !id.is_empty() => axum::Json(served).into_response(),
        Ok(()) | Err(_) => GatewayError::ModelNotFound {
            model: id,
            served: s.core.validator().model_id().to_string(),
        }
        .into_response(),
    }
}

/// The request body: the fields this server reads, and in `extra` the rest, which
/// [`check_unread`] refuses unless they ask for nothing (see `openai_params`).
#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    #[serde(default)]
    pub model: String,
    pub messages: Vec<OaMessage>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    /// Tool calling (see `tool_calls`).
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// vLLM's per-request processor options: `min_pixels` / `max_pixels` of every image.
    pub mm_processor_kwargs: Option<Map<String, Value>>,
    /// Sampling, stop conditions, structured output, streaming.
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(flatten)]
    pub structured: StructuredFields,
    /// Declared last: it gets only what the fields above leave.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
pub struct OaMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<OaContent>,
    /// An assistant turn's calls: `[{id, type: "function", function: {name, arguments}}]`.
    pub tool_calls: Option<Vec<Value>>,
    /// A tool result's call id (the Qwen template does not show it; accepted as OpenAI sends it).
    pub tool_call_id: Option<String>,
    /// `name`, ...: refused unless null (see `openai_params`).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum OaContent {
    Text(String),
    Parts(Vec<OaPart>),
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OaPart {
    Text {
        text: String,
    },
    ImageUrl {
        image_url: OaImageUrl,
    },
    /// vLLM's video part: an MP4 in a data: URL.
    VideoUrl {
        video_url: OaImageUrl,
    },
    /// Pre-sampled frames (qwen-vl-utils' form): image data: URLs, taken at `fps`.
    Video {
        video: Vec<Value>,
        fps: Option<f64>,
        /// qwen-vl-utils' other per-video keys (`nframes`, `max_pixels`, ...): refused.
        #[serde(flatten)]
        extra: Map<String, Value>,
    },
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum OaImageUrl {
    Object {
        url: String,
        /// Only `auto` (the processor's own resolution rules) is served.
        detail: Option<String>,
    },
    Plain(String),
}

impl OaImageUrl {
    fn url(&self) -> &str {
        match self {
            OaImageUrl::Object { url, .. } | OaImageUrl::Plain(url) => url,
        }
    }

    fn detail(&self) -> Option<&str> {
        match self {
            OaImageUrl::Object { detail, .. } => detail.as_deref(),
            OaImageUrl::Plain(_) => None,
        }
    }
}

/// OpenAI's `detail: "low"`: at most a 512x512 image (256 image tokens on Qwen3-VL).
pub const LOW_DETAIL_PIXELS: u64 = 512 * 512;

/// vLLM's `mm_processor_kwargs`: `min_pixels` and `max_pixels` for every image of the request,
/// `fps` or `num_frames` for every video.
fn mm_processor_kwargs(
    kw: Option<&Map<String, Value>>,
) -> Result<(PixelBudget, vlm_config::video::Sampling), GatewayError> {
    let Some(kw) = kw else {
        return Ok(Default::default());
    };
    let mut rest = kw.clone();
    let sampling = crate::openai_video::take_video_kwargs(&mut rest)?;
    let mut take = |k: &str| -> Result<Option<u64>, GatewayError> {
        match rest.remove(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().filter(|&n| n > 0).map(Some).ok_or_else(|| {
                GatewayError::param(
                    &format!("mm_processor_kwargs.{k}"),
                    format!("mm_processor_kwargs.{k} must be a positive pixel count"),
                )
            }),
        }
    };
    let b = PixelBudget {
        min_pixels: take("min_pixels")?,
        max_pixels: take("max_pixels")?,
    };
    check_unread(&rest, "mm_processor_kwargs.")?;
    Ok((b, sampling))
}

/// An image part's budget: the request's, with OpenAI's `detail` (`low`: at most
/// [`LOW_DETAIL_PIXELS`]; `high`: up to the server's max_pixels; `auto`: the request's, else
/// the server's resolution rules).
fn detail_budget(
    detail: Option<&str>,
    request: PixelBudget,
    param: &str,
) -> Result<PixelBudget, GatewayError> {
    match detail {
        None | Some("auto") => Ok(request),
        Some("low") => Ok(PixelBudget {
            max_pixels: Some(
                request
                    .max_pixels
                    .map_or(LOW_DETAIL_PIXELS, |m| m.min(LOW_DETAIL_PIXELS)),
            ),
            min_pixels: request.min_pixels.map(|m| m.min(LOW_DETAIL_PIXELS)),
        }),
        Some("high") => Ok(PixelBudget {
            max_pixels: Some(request.max_pixels.unwrap_or(u64::MAX)),
            ..request
        }),
        Some(d) => Err(GatewayError::param(
            param,
            format!("{param} {d:?} is not one of low, high, auto"),
        )),
    }
}

fn with_budget(part: InputPart, budget: PixelBudget) -> InputPart {
    match part {
        InputPart::Image {
            data, mime_type, ..
        } => InputPart::Image {
            data,
            mime_type,
            budget,
        },
        text => text,
    }
}

/// Decodes a `data:` URL.
pub fn image_from_data_url(url: &str) -> Result<InputPart, GatewayError> {
    let (mime_type, data) = decode_data_url(url, "image_url", "data:image/png;base64,...")?;
    Ok(InputPart::Image {
        data,
        mime_type,
        budget: Default::default(),
    })
}

/// The MIME type and bytes of a base64 `data:` URL; `what` names the field in errors and
/// `example` shows the expected form.
pub(crate) fn decode_data_url(
    url: &str,
    what: &str,
    example: &str,
) -> Result<(String, Bytes), GatewayError> {
    let rest = url.strip_prefix("data:").ok_or_else(|| {
        GatewayError::validation(format!("{what} must be a data: URL ({example})"))
    })?;
    let (meta, data) = rest.split_once(',').ok_or_else(|| {
        GatewayError::validation(format!("{what} data: URL has no ',' before the data"))
    })?;
    let mime = meta.split(';').next().unwrap_or("").to_string();
    if !meta.split(';').any(|p| p == "base64") {
        return Err(GatewayError::validation(format!(
            "{what} data: URL must be base64 ({example})"
        )));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| {
            GatewayError::validation(format!("{what} data: URL is not valid base64: {e}"))
        })?;
    Ok((mime, bytes.into()))
}

/// Where an `image_url` part's bytes come from.
#[derive(Debug)]
pub enum ImageSource {
    /// A `data:` URL, already decoded.
    Inline(InputPart),
    /// An http(s) URL on an allow-listed host, not fetched yet.
    Remote(Target),
}

/// The synchronous part of an `image_url`: a `data:` URL is decoded; an http(s) URL is checked
/// against the scheme and the allow-list (refused at once when the host is not listed).
pub fn image_source(url: &str, fetcher: &ImageFetcher) -> Result<ImageSource, GatewayError> {
    if url.starts_with("data:") {
        return image_from_data_url(url).map(ImageSource::Inline);
    }
    fetcher.check(url).map(ImageSource::Remote)
}

/// An `image_url` to image bytes: `data:` URLs decoded, allow-listed http URLs fetched under
/// the fetcher's byte and time limits.
pub async fn image_from_url(url: &str, fetcher: &ImageFetcher) -> Result<InputPart, GatewayError> {
    match image_source(url, fetcher)? {
        ImageSource::Inline(p) => Ok(p),
        ImageSource::Remote(t) => fetch_part(fetcher, &t).await,
    }
}

async fn fetch_part(fetcher: &ImageFetcher, t: &Target) -> Result<InputPart, GatewayError> {
    let f = fetcher.fetch_target(t).await?;
    Ok(InputPart::Image {
        data: f.data,
        mime_type: f.mime_type,
        budget: Default::default(),
    })
}

/// A parsed request whose http image URLs are not fetched yet: their parts hold empty images.
/// Check its shape (image count, roles, sampling) before [`fetch_images`](Self::fetch_images),
/// so a request that will be refused costs no network.
#[derive(Debug)]
pub struct ParsedChat {
    pub chat: ChatRequest,
    /// The tools the answer may call (`None`: plain text).
    pub tools: Option<Tools>,
    /// (message index, part index, URL) of each image still to fetch.
    pub remote: Vec<(usize, usize, Target)>,
}

impl ParsedChat {
    /// Fetches every remote image at once; the first failure refuses the request.
    pub async fn fetch_images(self, fetcher: &ImageFetcher) -> Result<ChatRequest, GatewayError> {
        let ParsedChat {
            mut chat, remote, ..
        } = self;
        let parts =
            futures::future::try_join_all(remote.iter().map(|(_, _, t)| fetch_part(fetcher, t)))
                .await?;
        for ((m, p, _), part) in remote.into_iter().zip(parts) {
            let slot = &mut chat.messages[m].content[p];
            let budget = match slot {
                InputPart::Image { budget, .. } => *budget,
                InputPart::Text(_) | InputPart::Video(_) => PixelBudget::default(),
            };
            *slot = with_budget(part, budget);
        }
        Ok(chat)
    }
}

/// OpenAI body -> domain request, image URLs fetched.
pub async fn to_chat_request(
    body: ChatCompletionRequest,
    body_bytes: usize,
    fetcher: &ImageFetcher,
) -> Result<ChatRequest, GatewayError> {
    parse_chat_request(body, body_bytes, fetcher)?
        .fetch_images(fetcher)
        .await
}

/// OpenAI body -> domain request, http image URLs checked but not fetched.
pub fn parse_chat_request(
    body: ChatCompletionRequest,
    body_bytes: usize,
    fetcher: &ImageFetcher,
) -> Result<ParsedChat, GatewayError> {
    check_unread(&body.extra, "")?;
    let (pixels, video_sampling) = mm_processor_kwargs(body.mm_processor_kwargs.as_ref())?;
    let mut messages = Vec::with_capacity(body.messages.len());
    let mut remote = Vec::new();
    for (mi, m) in body.messages.into_iter().enumerate() {
        check_unread(&m.extra, &format!("messages[{mi}]."))?;
        let content = match m.content {
            None => Vec::new(),
            Some(OaContent::Text(t)) => vec![InputPart::Text(t)],
            Some(OaContent::Parts(parts)) => {
                let mut content = Vec::with_capacity(parts.len());
                for (pi, p) in parts.into_iter().enumerate() {
                    content.push(match p {
                        OaPart::Text { text } => InputPart::Text(text),
                        OaPart::VideoUrl { video_url } => {
                            if video_url.detail().is_some() {
                                let param =
                                    format!("messages[{mi}].content[{pi}].video_url.detail");
                                return Err(GatewayError::param(
                                    &param,
                                    format!("{param}: detail is for images; a video's budget is mm_processor_kwargs"),
                                ));
                            }
                            InputPart::Video(crate::openai_video::video_url_part(
                                video_url.url(),
                                video_sampling,
                                &format!("messages[{mi}].content[{pi}].video_url"),
                            )?)
                        }
                        OaPart::Video { video, fps, extra } => {
                            check_unread(&extra, &format!("messages[{mi}].content[{pi}]."))?;
                            InputPart::Video(crate::openai_video::frames_part(
                                &video,
                                fps,
                                video_sampling,
                                &format!("messages[{mi}].content[{pi}]"),
                            )?)
                        }
                        OaPart::ImageUrl { image_url } => {
                            let param = format!("messages[{mi}].content[{pi}].image_url.detail");
                            let budget = detail_budget(image_url.detail(), pixels, &param)?;
                            match image_source(image_url.url(), fetcher)? {
                                ImageSource::Inline(part) => with_budget(part, budget),
                                ImageSource::Remote(t) => {
                                    remote.push((mi, pi, t));
                                    InputPart::Image {
                                        data: Bytes::new(),
                                        mime_type: String::new(),
                                        budget,
                                    }
                                }
                            }
                        }
                    });
                }
                content
            }
        };
        // OpenAI's "developer" role is the system prompt of newer models.
        let role = if m.role == "developer" {
            "system".to_string()
        } else {
            m.role
        };
        let mut tool_calls = Vec::new();
        for (ci, c) in m.tool_calls.into_iter().flatten().enumerate() {
            let param = format!("messages[{mi}].tool_calls[{ci}]");
            let f = c.get("function");
            let name = f.and_then(|f| f.get("name")).and_then(Value::as_str);
            let arguments = f.and_then(|f| f.get("arguments"));
            let (Some(name), Some(arguments)) = (name, arguments) else {
                return Err(GatewayError::param(
                    &param,
                    format!("{param} must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}"),
                ));
            };
            tool_calls.push(ToolCall {
                name: name.to_string(),
                arguments: match arguments {
                    Value::String(a) => a.clone(),
                    a => a.to_string(),
                },
            });
        }
        messages.push(InputMessage {
            role,
            content,
            tool_calls,
        });
    }
    let tools = tool_calls::parse(body.tools, body.tool_choice, body.parallel_tool_calls)?;
    let forced = tools
        .as_ref()
        .and_then(Tools::grammar)
        .map(|g| vlm_proto::StructuredOutput {
            kind: Some(vlm_proto::structured_output::Kind::Lark(g)),
        });
    let sampling = body.sampling.into_sampling(
        body.structured,
        0,
        (
            body.logprobs.unwrap_or(false),
            body.top_logprobs.unwrap_or(0),
        ),
        forced,
    )?;
    let chat = ChatRequest {
        messages,
        tools: tools.as_ref().map(|t| t.defs.clone()).unwrap_or_default(),
        prompt: None,
        sampling,
        model: body.model,
        body_bytes,
    };
    Ok(ParsedChat {
        chat,
        tools,
        remote,
    })
}

pub(crate) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The OpenAI `finish_reason` string. A cancelled generation never gets here: the caller
/// went away, or its deadline passed (an error, see `generate`).
pub(crate) fn finish_reason(f: Finish) -> &'static str {
    match f {
        Finish::Stop | Finish::Cancelled => "stop",
        Finish::Length => "length",
    }
}

/// OpenAI's `usage` object; `prompt_tokens_details.cached_tokens` are the prompt tokens the LM
/// read from its prefix cache (always present, 0 on a miss, as OpenAI sends it).
pub fn usage_json(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// One SSE chunk of a streamed completion. Usage never rides on it: with
/// `stream_options.include_usage` it follows as a chunk of its own ([`usage_chunk`]).
pub fn chunk_json(id: &str, model: &str, created: u64, d: &Delta, first: bool) -> Value {
    let mut delta = serde_json::Map::new();
    if first {
        delta.insert("role".into(), json!("assistant"));
    }
    if !d.text.is_empty() || first {
        delta.insert("content".into(), json!(d.text));
    }
    let logprobs = if d.logprobs.is_empty() {
        Value::Null
    } else {
        openai_content(&d.logprobs)
    };
    let v = json!({
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": d.index, "delta": delta, "logprobs": logprobs, "finish_reason": d.finish.map(finish_reason)}],
    });
    v
}

/// The stream's usage as OpenAI and vLLM send it: a last chunk of its own with `"choices": []`
/// (clients such as `vllm bench serve` and SDK code that skips chunks without choices read
/// usage only there). `object` is the stream's chunk object (`chat.completion.chunk`,
/// `text_completion`).
pub fn usage_chunk(id: &str, object: &str, model: &str, created: u64, u: Usage) -> Value {
    json!({
        "id": id,
        "object": object,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_json(u),
    })
}

/// `data: <json>\n\n`.
pub fn sse_event(v: &Value) -> String {
    format!("data: {v}\n\n")
}

pub const SSE_DONE: &str = "data: [DONE]\n\n";

/// Checks the API key, then reads a JSON body within the body limit: (body, its bytes). The
/// bytes are dropped here.
pub(crate) async fn read_json<T: serde::de::DeserializeOwned>(
    s: &HttpState,
    req: Request,
    what: &str,
) -> Result<(T, usize), GatewayError> {
    auth(s, &req)?;
    let limit = s.core.validator().limits().max_body_bytes;
    let body = axum::body::to_bytes(req.into_body(), limit)
        .await
        .map_err(|e| match crate::http_serve::BodyTimeout::find(&e) {
            Some(t) => GatewayError::RequestTimeout(t.to_string()),
            None => GatewayError::validation(format!(
                "request body is over the limit of {limit} bytes (--max-body-bytes)"
            )),
        })?;
    let parsed = serde_json::from_slice(&body).map_err(|e| {
        // A value of the wrong type: name its field (serde's message cannot, past a flatten).
        let named = e
            .is_data()
            .then(|| serde_json::from_slice::<Value>(&body).ok())
            .flatten()
            .and_then(|v| crate::openai_sampling::mistyped_field(&v));
        named.unwrap_or_else(|| {
            GatewayError::validation(format!("request body is not a valid {what}: {e}"))
        })
    })?;
    Ok((parsed, body.len()))
}

/// A streamed answer: `prelude`, then one event per delta as `chunk` writes it, up to the
/// stream's last delta (or an error event), then the usage chunk `usage` writes of the last
/// delta's usage (when the request asked for it), then `data: [DONE]`.
pub(crate) fn sse_deltas(
    mut rx: tokio::sync::mpsc::Receiver<Result<Delta, GatewayError>>,
    prelude: Vec<Value>,
    mut chunk: impl FnMut(Delta) -> Value + Send + 'static,
    usage: Option<impl FnOnce(Usage) -> Value + Send + 'static>,
) -> Response {
    let out = async_stream::stream! {
        for v in prelude {
            yield Ok::<_, std::convert::Infallible>(sse_event(&v));
        }
        while let Some(item) = rx.recv().await {
            match item {
                Ok(d) => {
                    let (end, counts) = (d.end, d.usage);
                    yield Ok(sse_event(&chunk(d)));
                    if end {
                        if let Some(usage) = usage {
                            yield Ok(sse_event(&usage(counts)));
                        }
                        break;
                    }
                }
                Err(e) => {
                    yield Ok(sse_event(&e.openai_body()));
                    break;
                }
            }
        }
        yield Ok(SSE_DONE.to_string());
    };
    sse_response(out)
}

/// A `text/event-stream` response of `events`.
pub(crate) fn sse_response(
    events: impl futures::Stream<Item = Result<String, std::convert::Infallible>> + Send + 'static,
) -> Response {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(events))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn chat_completions(State(s): State<HttpState>, req: Request) -> Response {
    let span = tracing::info_span!("POST /v1/chat/completions");
    let tally = Tally::start();
    vlm_service_kit::telemetry::extract_http(req.headers(), &span);
    let (parsed, body_len): (ChatCompletionRequest, usize) =
        match read_json(&s, req, "chat completion request").await {
            Ok(p) => p,
            Err(e) => return tally.refuse(e).into_response(),
        };
    let (stream, include_usage) = (parsed.sampling.stream, parsed.sampling.include_usage());
    let want_logprobs = parsed.logprobs == Some(true);
    let chat_n = parsed.sampling.n.unwrap_or(1);
    let pending = match parse_chat_request(parsed, body_len, &s.images) {
        Ok(p) => p,
        Err(e) => return tally.refuse(e).into_response(),
    };
    // Refuse what validation would refuse anyway (too many images, bad roles) before fetching.
    if !pending.remote.is_empty() {
        if let Err(e) = s.core.validator().check_shape(&pending.chat) {
            return tally.refuse(e).into_response();
        }
    }
    let tools = pending.tools.clone();
    let chat = match pending.fetch_images(&s.images).await {
        Ok(c) => c,
        Err(e) => return tally.refuse(e).into_response(),
    };
    let model = s.core.validator().model_id().to_string();
    // A stream that has to queue gets its status line at once and waits inside the stream.
    let started = if stream {
        s.core.start_streaming(chat, span, tally).await
    } else {
        s.core.start(chat, span, tally).await
    };
    let gen = match started {
        Ok(g) => g,
        Err(e) => return e.into_response(),
    };
    let id = format!("chatcmpl-{}", gen.request_id);
    let created = now_secs();
    let mut rx = gen.rx;
    let n = chat_n.max(1) as usize;
    if stream {
        let mut first = vec![true; n];
        let mut calls: Vec<Option<CallStream>> = (0..n)
            .map(|_| tools.as_ref().map(|_| CallStream::default()))
            .collect();
        let usage = include_usage.then(|| {
            let (id, model) = (id.clone(), model.clone());
            move |u| usage_chunk(&id, "chat.completion.chunk", &model, created, u)
        });
        return sse_deltas(
            rx,
            Vec::new(),
            move |mut d| {
                let i = (d.index as usize).min(n - 1);
                let mut found = Vec::new();
                if let (Some(c), Some(t)) = (calls[i].as_mut(), tools.as_ref()) {
                    d.text = c.push(&d.text);
                    if d.finish.is_some() {
                        let (rest, parsed) = c.finish(t.parallel);
                        d.text.push_str(&rest);
                        found = parsed;
                    }
                }
                let mut v = chunk_json(&id, &model, created, &d, first[i]);
                first[i] = false;
                if !found.is_empty() {
                    // Cut by max_tokens, the answer stays "length".
                    if d.finish == Some(Finish::Stop) {
                        v["choices"][0]["finish_reason"] = json!("tool_calls");
                    }
                    v["choices"][0]["delta"]["tool_calls"] = found
                        .iter()
                        .enumerate()
                        .map(|(k, c)| c.openai_json(k, &call_id()))
                        .collect();
                }
                v
            },
            usage,
        );
    }
    let all = match Collected::read(&mut rx, n).await {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let choices = (0..n)
        .map(|i| {
            let lp = want_logprobs.then_some(all.logprobs[i].as_slice());
            let mut c = chat_choice_json(i, &all.texts[i], lp, all.finishes[i]);
            if let Some(t) = &tools {
                with_tool_calls(&mut c, &all.texts[i], t.parallel, all.finishes[i]);
            }
            c
        })
        .collect();
    axum::Json(completion_json(&id, &model, created, choices, all.usage)).into_response()
}

/// A non-streamed answer of `n` choices, read to its end.
pub(crate) struct Collected {
    pub texts: Vec<String>,
    pub logprobs: Vec<Vec<ShownLogprob>>,
    pub finishes: Vec<Option<Finish>>,
    pub usage: Usage,
}

impl Collected {
    pub(crate) async fn read(
        rx: &mut tokio::sync::mpsc::Receiver<Result<Delta, GatewayError>>,
        n: usize,
    ) -> Result<Collected, GatewayError> {
        let mut c = Collected {
            texts: vec![String::new(); n],
            logprobs: vec![Vec::new(); n],
            finishes: vec![None; n],
            usage: Usage::default(),
        };
        while let Some(item) = rx.recv().await {
            let d = item?;
            let i = (d.index as usize).min(n - 1);
            c.texts[i].push_str(&d.text);
            c.logprobs[i].extend(d.logprobs);
            c.usage = d.usage;
            if d.finish.is_some() {
                c.finishes[i] = d.finish;
            }
            if d.end {
                break;
            }
        }
        Ok(c)
    }
}

/// A choice whose text holds tool calls: `message.tool_calls`, the content outside them, and
/// `finish_reason: "tool_calls"` (unless cut by max_tokens).
fn with_tool_calls(c: &mut Value, text: &str, parallel: bool, finish: Option<Finish>) {
    let (content, calls) = tool_calls::split(text, parallel);
    if calls.is_empty() {
        return;
    }
    let msg = &mut c["message"];
    msg["content"] = if content.is_empty() {
        Value::Null
    } else {
        json!(content)
    };
    msg["tool_calls"] = calls
        .iter()
        .enumerate()
        .map(|(i, call)| {
            let mut j = call.openai_json(i, &call_id());
            j.as_object_mut().map(|o| o.remove("index"));
            j
        })
        .collect();
    if finish == Some(Finish::Stop) {
        c["finish_reason"] = json!("tool_calls");
    }
}

/// One choice of a non-streamed chat completion.
pub fn chat_choice_json(
    index: usize,
    text: &str,
    logprobs: Option<&[ShownLogprob]>,
    finish: Option<Finish>,
) -> Value {
    json!({
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs.map(openai_content),
        "finish_reason": finish.map(finish_reason),
    })
}

/// The body of a non-streamed chat completion.
pub fn completion_json(
    id: &str,
    model: &str,
    created: u64,
    choices: Vec<Value>,
    usage: Usage,
) -> Value {
    json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_json(usage),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fetch::FetchOptions;

    #[test]
    fn sse_chunks() {
        let d = Delta {
            index: 0,
            text: "Hi".into(),
            token_ids: vec![1],
            logprobs: Vec::new(),
            finish: None,
            usage: Usage::default(),
            end: false,
        };
        let v = chunk_json("c1", "m", 7, &d, true);
        assert_eq!(
            v["choices"][0]["delta"],
            json!({"role": "assistant", "content": "Hi"})
        );
        assert_eq!(v["choices"][0]["finish_reason"], Value::Null);
        assert!(v.get("usage").is_none());
        let s = sse_event(&v);
        assert!(s.starts_with("data: {") && s.ends_with("}\n\n"), "{s}");

        let u = Usage {
            prompt_tokens: 10,
            image_tokens: 4,
            completion_tokens: 3,
            cached_tokens: 8,
            video_tokens: 0,
        };
        let last = Delta {
            index: 0,
            text: String::new(),
            token_ids: vec![2],
            logprobs: Vec::new(),
            finish: Some(Finish::Length),
            usage: u,
            end: true,
        };
        let v = chunk_json("c1", "m", 7, &last, false);
        assert_eq!(v["choices"][0]["delta"], json!({}));
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert!(
            v.get("usage").is_none(),
            "usage rides on its own chunk: {v}"
        );
        let v = usage_chunk("c1", "chat.completion.chunk", "m", 7, last.usage);
        assert_eq!(v["choices"], json!([]));
        assert_eq!(
            (&v["id"], &v["object"]),
            (&json!("c1"), &json!("chat.completion.chunk"))
        );
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                   "prompt_tokens_details": {"cached_tokens": 8}})
        );
        assert_eq!(SSE_DONE, "data: [DONE]\n\n");
    }

    #[test]
    fn completion_body_reports_cached_prompt_tokens() {
        let usage = |cached_tokens| Usage {
            prompt_tokens: 96,
            image_tokens: 0,
            completion_tokens: 5,
            cached_tokens,
            video_tokens: 0,
        };
        let v = completion_json(
            "c2",
            "m",
            9,
            vec![chat_choice_json(0, "Hello", None, Some(Finish::Stop))],
            usage(64),
        );
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["content"], "Hello");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": 96, "completion_tokens": 5, "total_tokens": 101,
                   "prompt_tokens_details": {"cached_tokens": 64}})
        );
        // A miss is an explicit 0, as OpenAI sends it.
        let v = completion_json(
            "c3",
            "m",
            9,
            vec![chat_choice_json(0, "", None, Some(Finish::Length))],
            usage(0),
        );
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    }

    #[test]
    fn parses_openai_bodies_and_data_urls() {
        let png = base64::engine::general_purpose::STANDARD.encode([1u8, 2, 3]);
        let body: ChatCompletionRequest = serde_json::from_value(json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{png}")}},
                    {"type": "text", "text": "what?"}
                ]}
            ],
            "max_tokens": 5, "temperature": 0, "stop": "x", "stream": true
        }))
        .unwrap();
        let parsed =
            parse_chat_request(body, 100, &ImageFetcher::new(FetchOptions::deny_all())).unwrap();
        assert!(parsed.remote.is_empty());
        let r = parsed.chat;
        assert_eq!(r.messages.len(), 2);
        assert_eq!(
            r.messages[1].content[0],
            InputPart::Image {
                data: vec![1u8, 2, 3].into(),
                mime_type: "image/png".into(),
                budget: Default::default(),
            }
        );
        assert_eq!(r.sampling.max_tokens, 5);
        assert_eq!(r.sampling.temperature, 0.0);
        assert_eq!(r.sampling.stop, vec!["x".to_string()]);
    }

    #[test]
    fn detail_and_mm_processor_kwargs_set_the_pixel_budget() {
        let (req, sampling) = mm_processor_kwargs(Some(
            json!({"min_pixels": 1000, "max_pixels": 900000, "fps": 1})
                .as_object()
                .unwrap(),
        ))
        .unwrap();
        assert_eq!(sampling, vlm_config::video::Sampling::Fps(1.0));
        assert_eq!(detail_budget(Some("auto"), req, "d").unwrap(), req);
        let low = detail_budget(Some("low"), req, "d").unwrap();
        assert_eq!(
            (low.min_pixels, low.max_pixels),
            (Some(1000), Some(LOW_DETAIL_PIXELS))
        );
        let high = detail_budget(Some("high"), PixelBudget::default(), "d").unwrap();
        assert_eq!(high.max_pixels, Some(u64::MAX));
        assert_eq!(
            detail_budget(Some("ultra"), req, "p.detail")
                .unwrap_err()
                .param_name(),
            Some("p.detail")
        );
        // Fetched and inline images alike keep their part's budget.
        let body: ChatCompletionRequest = serde_json::from_value(json!({
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url":
                {"url": format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode([1u8])),
                 "detail": "low"}}]}]
        }))
        .unwrap();
        let parsed =
            parse_chat_request(body, 10, &ImageFetcher::new(FetchOptions::deny_all())).unwrap();
        let InputPart::Image { budget, .. } = &parsed.chat.messages[0].content[0] else {
            panic!("not an image");
        };
        assert_eq!(budget.max_pixels, Some(LOW_DETAIL_PIXELS));
    }

    #[test]
    fn image_urls_refused_unless_allowed() {
        let deny = ImageFetcher::new(FetchOptions::deny_all());
        let e = image_source("https://evil.example/a.png", &deny).unwrap_err();
        assert!(
            e.to_string().contains("--allow-image-host evil.example"),
            "{e}"
        );
        let ok = ImageFetcher::new(FetchOptions {
            allow_hosts: vec!["ok.example".into()],
            ..FetchOptions::deny_all()
        });
        assert!(matches!(
            image_source("http://ok.example/a.png", &ok),
            Ok(ImageSource::Remote(_))
        ));
        assert!(matches!(
            image_source("https://ok.example/a.png", &ok),
            Ok(ImageSource::Remote(_))
        ));
        let e = image_source("data:image/png,abc", &deny).unwrap_err();
        assert!(e.to_string().contains("base64"), "{e}");
        assert!(image_source("ftp://x", &deny).is_err());
    }

    #[test]
    fn remote_parts_are_placeholders_until_fetched() {
        let body: ChatCompletionRequest = serde_json::from_value(json!({
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": "http://ok.example/a.png"}
            ]}]
        }))
        .unwrap();
        let ok = ImageFetcher::new(FetchOptions {
            allow_hosts: vec!["ok.example".into()],
            ..FetchOptions::deny_all()
        });
        let p = parse_chat_request(body, 10, &ok).unwrap();
        assert_eq!(p.remote.len(), 1);
        assert_eq!((p.remote[0].0, p.remote[0].1), (0, 1));
        assert_eq!(p.remote[0].2.shown(), "http://ok.example/a.png");
    }

    #[test]
    fn video_part_options_not_served_are_refused() {
        let deny = ImageFetcher::new(FetchOptions::deny_all());
        let parse = |part: Value| {
            let body: ChatCompletionRequest =
                serde_json::from_value(json!({"messages": [{"role": "user", "content": [part]}]}))
                    .unwrap();
            parse_chat_request(body, 10, &deny).map(|_| ())
        };
        let frame = "data:image/png;base64,AAAA";
        let e = parse(json!({"type": "video", "video": [frame], "nframes": 4})).unwrap_err();
        assert!(e.to_string().contains("content[0].nframes"), "{e}");
        assert!(
            parse(json!({"type": "video", "video": [frame], "fps": 2, "nframes": null})).is_ok()
        );
        let e = parse(json!({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA", "detail": "low"}}))
            .unwrap_err();
        assert!(e.to_string().contains("video_url.detail"), "{e}");
    }
}
