//! The OpenAI-compatible HTTP surface: `POST /v1/chat/completions` (text and `image_url` parts
//! as `data:` URLs; `stream: true` as SSE chunks ending with `data: [DONE]`), `GET /v1/models`,
//! `GET /health`, `GET /metrics`.
use crate::auth::ApiKeys;
use crate::error::GatewayError;
use crate::generate::{Core, Delta, Usage};
use crate::validation::{ChatRequest, InputMessage, InputPart, InputSampling};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use base64::Engine;
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::watch;

#[derive(Clone)]
pub struct HttpState {
    pub core: Core,
    pub keys: ApiKeys,
    pub ready: watch::Receiver<bool>,
    pub metrics: metrics_exporter_prometheus::PrometheusHandle,
    /// Hosts http(s) image URLs may come from.
    pub allow_image_hosts: Vec<String>,
}

pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .with_state(state)
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

async fn models(State(s): State<HttpState>, req: Request) -> Response {
    if let Err(e) = auth(&s, &req) {
        return e.into_response();
    }
    let id = s.core.validator().model_id();
    axum::Json(json!({"object": "list", "data": [{"id": id, "object": "model", "created": 0, "owned_by": "vlm"}]}))
        .into_response()
}

/// The request body (the fields this server reads; others are ignored).
#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    #[serde(default)]
    pub model: String,
    pub messages: Vec<OaMessage>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub ignore_eos: bool,
    pub n: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
pub struct OaMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<OaContent>,
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
    Text { text: String },
    ImageUrl { image_url: OaImageUrl },
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum OaImageUrl {
    Object { url: String },
    Plain(String),
}

impl OaImageUrl {
    fn url(&self) -> &str {
        match self {
            OaImageUrl::Object { url } | OaImageUrl::Plain(url) => url,
        }
    }
}

/// Decodes a `data:` URL; http(s) URLs are refused unless their host is allow-listed.
pub fn image_from_url(url: &str, allow_hosts: &[String]) -> Result<InputPart, GatewayError> {
    if let Some(rest) = url.strip_prefix("data:") {
        let (meta, data) = rest.split_once(',').ok_or_else(|| {
            GatewayError::validation("image_url data: URL has no ',' before the data")
        })?;
        let mime = meta.split(';').next().unwrap_or("").to_string();
        if !meta.split(';').any(|p| p == "base64") {
            return Err(GatewayError::validation(
                "image_url data: URL must be base64 (data:image/png;base64,...)",
            ));
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map_err(|e| {
                GatewayError::validation(format!("image_url data: URL is not valid base64: {e}"))
            })?;
        return Ok(InputPart::Image {
            data: bytes.into(),
            mime_type: mime,
        });
    }
    if url.starts_with("http://") || url.starts_with("https://") {
        let host = url
            .split("://")
            .nth(1)
            .unwrap_or("")
            .split(['/', '?', '#'])
            .next()
            .unwrap_or("");
        let host = host.rsplit('@').next().unwrap_or(host);
        let name = host.split(':').next().unwrap_or(host);
        if !allow_hosts.iter().any(|h| h == name || h == host) {
            return Err(GatewayError::validation(format!(
                "image URL host {name:?} is not allowed: send the image as a data: URL, or start the gateway with \
                 --allow-image-host {name}"
            )));
        }
        return Err(GatewayError::validation(format!(
            "fetching image URLs (host {name:?}) is not implemented in this build; send the image as a data: URL"
        )));
    }
    Err(GatewayError::validation(
        "image_url must be a data: URL (data:image/png;base64,...) or an http(s) URL",
    ))
}

/// OpenAI body -> domain request.
pub fn to_chat_request(
    body: ChatCompletionRequest,
    body_bytes: usize,
    allow_hosts: &[String],
) -> Result<ChatRequest, GatewayError> {
    if body.n.is_some_and(|n| n != 1) {
        return Err(GatewayError::validation(
            "n must be 1: one choice per request",
        ));
    }
    let mut messages = Vec::with_capacity(body.messages.len());
    for m in body.messages {
        let content = match m.content {
            None => Vec::new(),
            Some(OaContent::Text(t)) => vec![InputPart::Text(t)],
            Some(OaContent::Parts(parts)) => parts
                .into_iter()
                .map(|p| match p {
                    OaPart::Text { text } => Ok(InputPart::Text(text)),
                    OaPart::ImageUrl { image_url } => image_from_url(image_url.url(), allow_hosts),
                })
                .collect::<Result<_, _>>()?,
        };
        messages.push(InputMessage {
            role: m.role,
            content,
        });
    }
    let stop = match body.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    Ok(ChatRequest {
        messages,
        sampling: InputSampling {
            max_tokens: body.max_completion_tokens.or(body.max_tokens).unwrap_or(0),
            temperature: body.temperature.unwrap_or(1.0),
            top_p: body.top_p.unwrap_or(0.0),
            top_k: body.top_k.unwrap_or(0),
            seed: body.seed,
            stop,
            stop_token_ids: Vec::new(),
            ignore_eos: body.ignore_eos,
        },
        model: body.model,
        body_bytes,
    })
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn usage_json(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// One SSE chunk of a streamed completion.
pub fn chunk_json(id: &str, model: &str, created: u64, d: &Delta, first: bool) -> Value {
    let mut delta = serde_json::Map::new();
    if first {
        delta.insert("role".into(), json!("assistant"));
    }
    if !d.text.is_empty() || first {
        delta.insert("content".into(), json!(d.text));
    }
    let mut v = json!({
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": d.finish.map(|f| f.openai())}],
    });
    if d.finish.is_some() {
        v["usage"] = usage_json(d.usage);
    }
    v
}

/// `data: <json>\n\n`.
pub fn sse_event(v: &Value) -> String {
    format!("data: {v}\n\n")
}

pub const SSE_DONE: &str = "data: [DONE]\n\n";

async fn chat_completions(State(s): State<HttpState>, req: Request) -> Response {
    if let Err(e) = auth(&s, &req) {
        return e.into_response();
    }
    let span = tracing::info_span!("POST /v1/chat/completions");
    vlm_service_kit::telemetry::extract_http(req.headers(), &span);
    let limit = s.core.validator().limits().max_body_bytes;
    let body = match axum::body::to_bytes(req.into_body(), limit).await {
        Ok(b) => b,
        Err(_) => {
            return GatewayError::validation(format!(
                "request body is over the limit of {limit} bytes (--max-body-bytes)"
            ))
            .into_response()
        }
    };
    let parsed: ChatCompletionRequest = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => {
            return GatewayError::validation(format!(
                "request body is not a valid chat completion request: {e}"
            ))
            .into_response()
        }
    };
    let stream = parsed.stream;
    let chat = match to_chat_request(parsed, body.len(), &s.allow_image_hosts) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    drop(body);
    let model = s.core.validator().model_id().to_string();
    let gen = match s.core.start(chat, span).await {
        Ok(g) => g,
        Err(e) => return e.into_response(),
    };
    let id = format!("chatcmpl-{}", gen.request_id);
    let created = now_secs();
    let mut rx = gen.rx;
    if stream {
        let out = async_stream::stream! {
            let mut first = true;
            while let Some(item) = rx.recv().await {
                match item {
                    Ok(d) => {
                        let end = d.finish.is_some();
                        yield Ok::<_, std::convert::Infallible>(sse_event(&chunk_json(&id, &model, created, &d, first)));
                        first = false;
                        if end { break; }
                    }
                    Err(e) => {
                        yield Ok(sse_event(&e.openai_body()));
                        break;
                    }
                }
            }
            yield Ok(SSE_DONE.to_string());
        };
        return Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(Body::from_stream(out))
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    }
    let mut text = String::new();
    let mut usage = Usage::default();
    let mut finish = None;
    while let Some(item) = rx.recv().await {
        match item {
            Ok(d) => {
                text.push_str(&d.text);
                usage = d.usage;
                if d.finish.is_some() {
                    finish = d.finish;
                    break;
                }
            }
            Err(e) => return e.into_response(),
        }
    }
    axum::Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish.map(|f| f.openai())}],
        "usage": usage_json(usage),
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::Finish;

    #[test]
    fn sse_chunks() {
        let d = Delta {
            text: "Hi".into(),
            token_ids: vec![1],
            finish: None,
            usage: Usage::default(),
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
        };
        let last = Delta {
            text: String::new(),
            token_ids: vec![2],
            finish: Some(Finish::Length),
            usage: u,
        };
        let v = chunk_json("c1", "m", 7, &last, false);
        assert_eq!(v["choices"][0]["delta"], json!({}));
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13})
        );
        assert_eq!(SSE_DONE, "data: [DONE]\n\n");
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
        let r = to_chat_request(body, 100, &[]).unwrap();
        assert_eq!(r.messages.len(), 2);
        assert_eq!(
            r.messages[1].content[0],
            InputPart::Image {
                data: vec![1u8, 2, 3].into(),
                mime_type: "image/png".into()
            }
        );
        assert_eq!(r.sampling.max_tokens, 5);
        assert_eq!(r.sampling.temperature, 0.0);
        assert_eq!(r.sampling.stop, vec!["x".to_string()]);
    }

    #[test]
    fn image_urls_refused_unless_allowed() {
        let e = image_from_url("https://evil.example/a.png", &[]).unwrap_err();
        assert!(
            e.to_string().contains("--allow-image-host evil.example"),
            "{e}"
        );
        let e = image_from_url("https://ok.example/a.png", &["ok.example".into()]).unwrap_err();
        assert!(e.to_string().contains("not implemented"), "{e}");
        let e = image_from_url("data:image/png,abc", &[]).unwrap_err();
        assert!(e.to_string().contains("base64"), "{e}");
        assert!(image_from_url("ftp://x", &[]).is_err());
    }
}
