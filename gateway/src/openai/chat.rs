//! `POST /v1/chat/completions`: streamed as SSE chunks or answered whole, with tool calls
//! parsed out of the text when the request declared tools.
use super::request::{parse_chat_request, ChatCompletionRequest};
use super::state::{read_json, HttpState};
use super::wire::{
    chat_choice_json, chunk_json, completion_json, now_secs, sse_deltas, usage_chunk, Collected,
};
use crate::generate::Tally;
use crate::tool_calls::{self, call_id, CallStream};
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use vlm_service_kit::generation::Finish;

pub(crate) async fn chat_completions(State(s): State<HttpState>, req: Request) -> Response {
    let span = tracing::info_span!("POST /v1/chat/completions");
    let tally = Tally::start();
    vlm_service_kit::telemetry::extract_http(req.headers(), &span);
    let (mut parsed, body_len): (ChatCompletionRequest, usize) =
        match read_json(&s, req, "chat completion request").await {
            Ok(p) => p,
            Err(e) => return tally.refuse(e).into_response(),
        };
    parsed
        .sampling
        .fill_defaults(s.core.validator().sampling_defaults());
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
