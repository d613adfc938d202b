//! `POST /v1/completions` (a prompt as text or token ids, no chat template; streamed or not;
//! `logprobs: N` in the legacy shape; `echo`), and vLLM's `POST /tokenize` / `POST
//! /detokenize`.
use super::params::check_unread_of;
use super::request::{parse_chat_request, ChatCompletionRequest};
use super::sampling::SamplingFields;
use super::state::{read_json, HttpState};
use super::wire::{finish_reason, now_secs, sse_deltas, usage_chunk, usage_json, Collected};
use crate::error::GatewayError;
use crate::generate::Tally;
use crate::logprobs::ShownLogprob;
use crate::response_format::StructuredFields;
use crate::validation::{ChatRequest, RawPrompt};
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use vlm_service_kit::generation::Finish;

/// OpenAI's default `max_tokens` for completions.
const DEFAULT_MAX_TOKENS: u32 = 16;

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: String,
    pub prompt: Value,
    /// The sampled token's logprob and this many alternatives per position.
    pub logprobs: Option<u32>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<u32>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(flatten)]
    pub structured: StructuredFields,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One prompt: a string, or token ids (each also as a one-element list).
fn prompt(v: &Value) -> Result<RawPrompt, GatewayError> {
    let bad = || {
        GatewayError::param(
            "prompt",
            "prompt must be a string, a list of token ids, or a one-element list of either",
        )
    };
    match v {
        Value::String(s) => Ok(RawPrompt::Text(s.clone())),
        Value::Array(a) if a.len() == 1 && (a[0].is_string() || a[0].is_array()) => prompt(&a[0]),
        Value::Array(a) if a.iter().all(Value::is_u64) => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or_else(bad)
            })
            .collect::<Result<Vec<u32>, _>>()
            .map(RawPrompt::Ids),
        Value::Array(a) if a.len() > 1 && a.iter().all(|x| x.is_string() || x.is_array()) => {
            Err(GatewayError::param(
                "prompt",
                format!(
                    "{} prompts given; one prompt per request (send one request each)",
                    a.len()
                ),
            ))
        }
        _ => Err(bad()),
    }
}

/// The fields `/v1/completions` reads, as its refusals list them.
const COMPLETION_FIELDS: &str = "model, prompt, max_tokens, max_completion_tokens, \
     temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, presence_penalty, \
     frequency_penalty, repetition_penalty, logit_bias, logprobs, echo, best_of, min_tokens, \
     ignore_eos, response_format, structured_outputs, guided_json/regex/choice/grammar, stream, \
     stream_options.include_usage, n";

/// The request in domain terms, with `echo`'s text.
fn parse(body: CompletionRequest, body_bytes: usize) -> Result<(ChatRequest, bool), GatewayError> {
    check_unread_of(&body.extra, "", COMPLETION_FIELDS)?;
    if body.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(GatewayError::param(
            "suffix",
            "suffix (insertion) is not supported",
        ));
    }
    if body.best_of.is_some_and(|b| b != 1) {
        return Err(GatewayError::param("best_of", "best_of must be 1"));
    }
    let echo = body.echo.unwrap_or(false);
    if echo && body.logprobs.is_some() {
        return Err(GatewayError::param(
            "echo",
            "echo with logprobs needs the prompt's logprobs, which this server does not compute; \
             send echo or logprobs",
        ));
    }
    let max = vlm_service_kit::sampling::MAX_TOP_LOGPROBS;
    if let Some(n) = body.logprobs.filter(|&n| n > max) {
        return Err(GatewayError::param(
            "logprobs",
            format!("logprobs is {n}; it must be in [0, {max}]"),
        ));
    }
    let p = prompt(&body.prompt)?;
    let logprobs = (body.logprobs.is_some(), body.logprobs.unwrap_or(0));
    let sampling =
        body.sampling
            .into_sampling(body.structured, DEFAULT_MAX_TOKENS, logprobs, None)?;
    Ok((
        ChatRequest {
            prompt: Some(p),
            sampling,
            model: body.model,
            body_bytes,
            ..Default::default()
        },
        echo,
    ))
}

/// The legacy logprobs object of a completion choice: `tokens`, `token_logprobs`,
/// `top_logprobs` (token -> logprob maps) and `text_offset` (characters into the choice's
/// text, after `start`).
fn legacy_logprobs(l: &[ShownLogprob], start: usize) -> Value {
    let mut offset = start;
    let mut offsets = Vec::with_capacity(l.len());
    for x in l {
        offsets.push(offset);
        offset += x.chosen.token.chars().count();
    }
    json!({
        "tokens": l.iter().map(|x| x.chosen.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": l.iter().map(|x| x.chosen.logprob).collect::<Vec<_>>(),
        "top_logprobs": l.iter().map(|x| {
            x.top.iter().map(|t| (t.token.clone(), json!(t.logprob))).collect::<Map<String, Value>>()
        }).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

fn choice(index: usize, text: &str, logprobs: Option<Value>, finish: Option<Finish>) -> Value {
    json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish.map(finish_reason)})
}

pub async fn completions(State(s): State<HttpState>, req: Request) -> Response {
    let span = tracing::info_span!("POST /v1/completions");
    let tally = Tally::start();
    vlm_service_kit::telemetry::extract_http(req.headers(), &span);
    let (mut body, len): (CompletionRequest, usize) =
        match read_json(&s, req, "completion request").await {
            Ok(p) => p,
            Err(e) => return tally.refuse(e).into_response(),
        };
    body.sampling
        .fill_defaults(s.core.validator().sampling_defaults());
    let (stream, include_usage) = (body.sampling.stream, body.sampling.include_usage());
    let want_logprobs = body.logprobs.is_some();
    let n = body.sampling.n.unwrap_or(1);
    let (chat, echo) = match parse(body, len) {
        Ok(p) => p,
        Err(e) => return tally.refuse(e).into_response(),
    };
    let tok = s.core.validator().tokenizer().clone();
    let echoed = match (&chat.prompt, echo) {
        (Some(RawPrompt::Text(t)), true) => t.clone(),
        (Some(RawPrompt::Ids(ids)), true) => tok.decode(ids).unwrap_or_default(),
        _ => String::new(),
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
    let id = format!("cmpl-{}", gen.request_id);
    let created = now_secs();
    let mut rx = gen.rx;
    let n = n.max(1) as usize;
    let usage = (stream && include_usage).then(|| {
        let (id, model) = (id.clone(), model.clone());
        move |u| usage_chunk(&id, "text_completion", &model, created, u)
    });
    let chunk = move |index: usize, text: &str, lp: Option<Value>, finish: Option<Finish>| {
        json!({"id": id, "object": "text_completion", "created": created, "model": model,
               "choices": [choice(index, text, lp, finish)]})
    };
    if stream {
        let mut shown = vec![echoed.chars().count(); n];
        let prelude = if echoed.is_empty() {
            Vec::new()
        } else {
            (0..n).map(|i| chunk(i, &echoed, None, None)).collect()
        };
        return sse_deltas(
            rx,
            prelude,
            move |d| {
                let i = (d.index as usize).min(n - 1);
                let lp = want_logprobs.then(|| legacy_logprobs(&d.logprobs, shown[i]));
                shown[i] += d
                    .logprobs
                    .iter()
                    .map(|l| l.chosen.token.chars().count())
                    .sum::<usize>();
                chunk(i, &d.text, lp, d.finish)
            },
            usage,
        );
    }
    let all = match Collected::read(&mut rx, n).await {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let choices: Vec<Value> = (0..n)
        .map(|i| {
            let lp = want_logprobs.then(|| legacy_logprobs(&all.logprobs[i], 0));
            choice(i, &format!("{echoed}{}", all.texts[i]), lp, all.finishes[i])
        })
        .collect();
    let usage = all.usage;
    let mut v = chunk(0, "", None, None);
    v["choices"] = json!(choices);
    v["usage"] = usage_json(usage);
    axum::Json(v).into_response()
}

/// vLLM's `/tokenize`: `{"prompt": ...}` (encoded as is) or `{"messages": [...]}` (through the
/// chat template, images counted) -> `{"count", "max_model_len", "tokens", "token_strs"}`
/// (`token_strs`: the tokens' vocabulary strings when `return_token_strs` is true, else null).
#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    prompt: Option<String>,
    messages: Option<Value>,
    /// Served when the tokenizer adds nothing (Qwen's adds no BOS or EOS): true and false
    /// encode alike. Refused for a tokenizer that would add tokens.
    add_special_tokens: Option<Value>,
    return_token_strs: Option<Value>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// A boolean field of `/tokenize` (absent or null: `None`).
fn flag(name: &str, v: Option<&Value>) -> Result<Option<bool>, GatewayError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(GatewayError::param(
            name,
            format!("{name} is {other}; it must be true or false"),
        )),
    }
}

/// The fields `/tokenize` reads, as its refusals list them.
const TOKENIZE_FIELDS: &str = "prompt or messages, model, add_special_tokens, return_token_strs; \
     with messages also add_generation_prompt and the chat-completion fields (tools, \
     mm_processor_kwargs, ...)";

/// `add_special_tokens: true` adds what the tokenizer's post-processor adds: nothing for Qwen,
/// so it is served as false is; a tokenizer that would add tokens refuses it.
fn check_add_special_tokens(
    tok: &vlm_tokenizer::ChatTokenizer,
    add: Option<bool>,
) -> Result<(), GatewayError> {
    if add != Some(true) {
        return Ok(());
    }
    let added = tok
        .tokenizer()
        .encode("", true)
        .map(|e| e.get_ids().len())
        .unwrap_or(0);
    if added > 0 {
        return Err(GatewayError::param(
            "add_special_tokens",
            format!(
                "add_special_tokens: true would add {added} special tokens, which this server \
                 does not; send false"
            ),
        ));
    }
    Ok(())
}

pub async fn tokenize(State(s): State<HttpState>, req: Request) -> Response {
    let (body, len): (TokenizeRequest, usize) = match read_json(&s, req, "tokenize request").await {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let v = s.core.validator();
    let flags = flag("add_special_tokens", body.add_special_tokens.as_ref()).and_then(|add| {
        check_add_special_tokens(v.tokenizer(), add)?;
        flag("return_token_strs", body.return_token_strs.as_ref())
    });
    let return_token_strs = match flags {
        Ok(r) => r.unwrap_or(false),
        Err(e) => return e.into_response(),
    };
    let ids = match (body.prompt, body.messages) {
        (Some(p), None) => {
            // The prompt is encoded as written (nothing added; see add_special_tokens).
            let mut rest = body.rest;
            let model = rest.remove("model");
            check_unread_of(&rest, "", TOKENIZE_FIELDS)
                .and_then(|()| v.check_model(model.as_ref().and_then(Value::as_str).unwrap_or("")))
                .and_then(|()| {
                    // Bounded as the generation routes bound it (no room left is still a count).
                    let limit = v.limits().max_seq_len as usize;
                    v.tokenizer().encode_within(&p, limit).map_err(|e| {
                        GatewayError::validation(format!(
                            "cannot encode the prompt: {e} (max_seq_len)"
                        ))
                    })
                })
        }
        (None, Some(m)) => {
            // A chat request without generation: the same parse and checks as the chat route.
            let mut chat = body.rest;
            chat.insert("messages".into(), m);
            // The count is of what the chat route sends: the assistant turn opened.
            if chat
                .remove("add_generation_prompt")
                .is_some_and(|g| g != Value::Bool(true))
            {
                return GatewayError::param(
                    "add_generation_prompt",
                    "add_generation_prompt must be true: the count is of the prompt as the chat \
                     route sends it",
                )
                .into_response();
            }
            serde_json::from_value::<ChatCompletionRequest>(Value::Object(chat))
                .map_err(|e| GatewayError::validation(format!("not a valid tokenize request: {e}")))
                .and_then(|c| {
                    check_unread_of(&c.extra, "", TOKENIZE_FIELDS)?;
                    parse_chat_request(c, len, &s.images)
                })
                .and_then(|p| {
                    if !p.remote.is_empty() {
                        return Err(GatewayError::param(
                            "messages",
                            "/tokenize takes images as data: URLs only",
                        ));
                    }
                    v.validate(p.chat).map(|r| r.input_ids)
                })
        }
        _ => Err(GatewayError::validation(
            "a tokenize request has a prompt or messages (one of them)",
        )),
    };
    match ids {
        Ok(ids) => {
            let strs = return_token_strs.then(|| {
                let tok = v.tokenizer();
                ids.iter()
                    .map(|&id| tok.id_to_token(id).unwrap_or_default())
                    .collect::<Vec<_>>()
            });
            axum::Json(json!({
                "count": ids.len(), "max_model_len": v.limits().max_seq_len, "tokens": ids,
                "token_strs": strs,
            }))
            .into_response()
        }
        Err(e) => e.into_response(),
    }
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    tokens: Vec<u32>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// vLLM's `/detokenize`: `{"tokens": [...]}` -> `{"prompt": text}`.
pub async fn detokenize(State(s): State<HttpState>, req: Request) -> Response {
    let (mut body, _): (DetokenizeRequest, usize) =
        match read_json(&s, req, "detokenize request").await {
            Ok(p) => p,
            Err(e) => return e.into_response(),
        };
    let model = body.rest.remove("model");
    if let Err(e) = check_unread_of(&body.rest, "", "tokens, model").and_then(|()| {
        s.core
            .validator()
            .check_model(model.as_ref().and_then(Value::as_str).unwrap_or(""))
    }) {
        return e.into_response();
    }
    let tok = s.core.validator().tokenizer();
    if let Some(bad) = body.tokens.iter().find(|&&t| tok.id_to_token(t).is_none()) {
        return GatewayError::param(
            "tokens",
            format!(
                "token {bad} is not in the tokenizer's vocabulary ({} tokens)",
                tok.vocab_size()
            ),
        )
        .into_response();
    }
    match tok.decode(&body.tokens) {
        Ok(text) => axum::Json(json!({"prompt": text})).into_response(),
        Err(e) => GatewayError::validation(format!("cannot decode: {e}")).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_in_every_single_shape_and_batches_refused() {
        assert_eq!(prompt(&json!("hi")).unwrap(), RawPrompt::Text("hi".into()));
        assert_eq!(
            prompt(&json!(["hi"])).unwrap(),
            RawPrompt::Text("hi".into())
        );
        assert_eq!(prompt(&json!([1, 2])).unwrap(), RawPrompt::Ids(vec![1, 2]));
        assert_eq!(prompt(&json!([[3]])).unwrap(), RawPrompt::Ids(vec![3]));
        let e = prompt(&json!(["a", "b"])).unwrap_err();
        assert!(e.to_string().contains("one prompt per request"), "{e}");
        for bad in [
            json!(3),
            json!([-1]),
            json!([1, "a"]),
            json!([5_000_000_000u64]),
        ] {
            assert_eq!(
                prompt(&bad).unwrap_err().param_name(),
                Some("prompt"),
                "{bad}"
            );
        }
    }

    #[test]
    fn refusals_list_the_completion_fields_not_the_chat_ones() {
        let body: CompletionRequest =
            serde_json::from_value(json!({"prompt": "hi", "tools": [{"type": "function"}]}))
                .unwrap();
        let e = parse(body, 40).unwrap_err();
        assert_eq!(e.param_name(), Some("tools"));
        let msg = e.to_string();
        assert!(msg.contains("supported: model, prompt,"), "{msg}");
        assert!(msg.contains("echo") && !msg.contains("messages"), "{msg}");
    }

    #[test]
    fn legacy_logprobs_have_offsets_into_the_text() {
        use crate::logprobs::ShownToken;
        let t = |s: &str, lp| ShownToken {
            token_id: 0,
            token: s.into(),
            bytes: s.as_bytes().to_vec(),
            logprob: lp,
        };
        let l = vec![
            ShownLogprob {
                chosen: t("hé", -0.5),
                top: vec![t("hé", -0.5), t("x", -2.0)],
            },
            ShownLogprob {
                chosen: t("llo", -0.25),
                top: vec![],
            },
        ];
        let v = legacy_logprobs(&l, 3);
        assert_eq!(v["tokens"], json!(["hé", "llo"]));
        assert_eq!(v["token_logprobs"], json!([-0.5, -0.25]));
        assert_eq!(v["top_logprobs"][0], json!({"hé": -0.5, "x": -2.0}));
        assert_eq!(v["text_offset"], json!([3, 5]));
    }
}
