//! The answer's OpenAI shapes: chunks, usage, choices, the SSE stream, and a non-streamed
//! answer read to its end.
use crate::error::GatewayError;
use crate::generate::Delta;
use crate::logprobs::{openai_content, ShownLogprob};
use axum::body::Body;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::time::{SystemTime, UNIX_EPOCH};
use vlm_service_kit::generation::{Finish, Usage};

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
}
