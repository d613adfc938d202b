//! The OpenAI route's parameter contract, through the real HTTP router in process: a parameter
//! this server does not implement is a 400 naming it in `error.param` (never a 200 that ignores
//! it); served parameters out of range are a 400 naming them; served values, no-op values,
//! caller metadata and the `developer` role get past the gateway's checks
//! (then find no replica: 503); unknown routes and methods answer OpenAI error JSON.
mod support;

use serde_json::json;
use support::{json_body, post, request, start_gateway};
use vlm_gateway::fetch::{FetchOptions, ImageFetcher};

fn body(extra: serde_json::Value) -> serde_json::Value {
    let mut b = json!({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

#[tokio::test]
async fn unsupported_parameters_are_refused_by_name() {
    let (gw, _dir) = start_gateway(ImageFetcher::new(FetchOptions::deny_all())).await;
    let png = "data:image/png;base64,iVBORw0KGgo=";
    for (b, param) in [
        (
            body(json!({"response_format": {"type": "bogus"}})),
            "response_format.type",
        ),
        (body(json!({"functions": [{"name": "f"}]})), "functions"),
        (body(json!({"best_of": 2})), "best_of"),
        (
            body(json!({"stream_options": {"include_usage": true}})),
            "stream_options",
        ),
        (
            body(json!({"stream": true, "stream_options": {"continuous_usage_stats": true}})),
            "stream_options.continuous_usage_stats",
        ),
        (
            json!({"messages": [{"role": "user", "name": "bob", "content": "hi"}]}),
            "messages[0].name",
        ),
        (
            json!({"messages": [{"role": "user", "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": png, "detail": "medium"}}
            ]}]}),
            "messages[0].content[1].image_url.detail",
        ),
        (
            body(json!({"mm_processor_kwargs": {"do_resize": false}})),
            "mm_processor_kwargs.do_resize",
        ),
        (
            body(json!({"mm_processor_kwargs": {"max_pixels": -4}})),
            "mm_processor_kwargs.max_pixels",
        ),
    ] {
        let (status, text) = post(gw, &b).await;
        assert_eq!(status, 400, "{b}: {text}");
        let v = json_body(&text);
        assert_eq!(v["error"]["type"], "invalid_request_error", "{text}");
        assert_eq!(v["error"]["param"], param, "{b}: {text}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(param),
            "{text}"
        );
    }
}

/// The sampling parameters that are served, each out of its range: a 400 naming it, before
/// any replica is asked.
#[tokio::test]
async fn served_sampling_parameters_out_of_range_are_refused_by_name() {
    let (gw, _dir) = start_gateway(ImageFetcher::new(FetchOptions::deny_all())).await;
    for (b, param, needle) in [
        (
            body(json!({"top_logprobs": 3})),
            "top_logprobs",
            "logprobs: true",
        ),
        (
            body(json!({"logprobs": true, "top_logprobs": 21})),
            "top_logprobs",
            "[0, 20]",
        ),
        (
            body(json!({"presence_penalty": 2.5})),
            "presence_penalty",
            "[-2, 2]",
        ),
        (
            body(json!({"frequency_penalty": -3})),
            "frequency_penalty",
            "[-2, 2]",
        ),
        (
            body(json!({"repetition_penalty": -1})),
            "repetition_penalty",
            "repetition_penalty is -1",
        ),
        (body(json!({"min_p": 1.5})), "min_p", "[0, 1]"),
        (
            body(json!({"logit_bias": {"x1": 5}})),
            "logit_bias",
            "\"x1\" is not a token id",
        ),
        (
            body(json!({"logit_bias": {"11": 101}})),
            "logit_bias",
            "[-100, 100]",
        ),
        (body(json!({"max_tokens": 0})), "max_tokens", "at least 1"),
        (
            body(json!({"max_completion_tokens": 0})),
            "max_completion_tokens",
            "at least 1",
        ),
        (body(json!({"top_k": -2})), "top_k", "-1 or 0"),
        (
            body(json!({"min_tokens": 5})),
            "min_tokens",
            "over max_tokens (4)",
        ),
        (
            body(
                json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                        "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            ),
            "tool_choice",
            "not in tools",
        ),
        (
            body(
                json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                        "tool_choice": "required", "response_format": {"type": "json_object"}}),
            ),
            "tool_choice",
            "cannot be combined",
        ),
        (
            body(json!({"tools": [{"type": "tool"}]})),
            "tools[0].type",
            "\"function\"",
        ),
    ] {
        let (status, text) = post(gw, &b).await;
        assert_eq!(status, 400, "{b}: {text}");
        let v = json_body(&text);
        assert_eq!(v["error"]["param"], param, "{b}: {text}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{b}: {msg:?} lacks {needle:?}");
    }
}

#[tokio::test]
async fn served_and_no_op_values_metadata_and_developer_role_pass_the_checks() {
    let (gw, _dir) = start_gateway(ImageFetcher::new(FetchOptions::deny_all())).await;
    let b = json!({
        "max_tokens": 4,
        "messages": [{"role": "developer", "content": "be brief"},
                     {"role": "user", "content": "hi"}],
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
        "logprobs": true, "top_logprobs": 20, "logit_bias": {"11": -100, "12": 3.5},
        "min_p": 0.05, "top_k": -1, "min_tokens": 2, "stop_token_ids": [7],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "auto", "parallel_tool_calls": false,
        "mm_processor_kwargs": {"min_pixels": 4096, "max_pixels": 200000}, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        "user": "u-1", "metadata": {"team": "a"}, "store": false, "top_logprobs": null,
        "stream": true, "stream_options": {"include_usage": false}
    });
    let (status, text) = post(gw, &b).await;
    // Past every check of the gateway; refused only for want of an LM replica.
    assert_eq!(status, 503, "{text}");
    assert_eq!(json_body(&text)["error"]["param"], serde_json::Value::Null);
}

#[tokio::test]
async fn unknown_routes_and_methods_answer_json() {
    let (gw, _dir) = start_gateway(ImageFetcher::new(FetchOptions::deny_all())).await;
    let (status, text) = request(gw, "POST", "/v1/embeddings", "{}").await;
    assert_eq!(status, 404, "{text}");
    let v = json_body(&text);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("POST /v1/embeddings"),
        "{text}"
    );
    assert_eq!(v["error"]["code"], 404);
    let (status, text) = request(gw, "GET", "/v1/chat/completions", "").await;
    assert_eq!(status, 405, "{text}");
    assert_eq!(json_body(&text)["error"]["code"], 405);
}

/// Before any replica is healthy the model list answers 503, as `/health` does: tools that
/// wait on `/v1/models` do not send their first requests into 503s.
#[tokio::test]
async fn models_are_not_listed_before_the_system_can_serve() {
    let (gw, _dir) = start_gateway(ImageFetcher::new(FetchOptions::deny_all())).await;
    for path in ["/health", "/v1/models", "/v1/models/tiny"] {
        let (status, text) = request(gw, "GET", path, "").await;
        assert_eq!(status, 503, "{path}: {text}");
    }
    let (_, text) = request(gw, "GET", "/v1/models", "").await;
    assert_eq!(json_body(&text)["error"]["type"], "service_unavailable");
}

/// Every parameter of OpenAI's chat-completions reference, one at a time: served (it gets past
/// every check of the gateway, then finds no replica: 503) or refused (400 naming it).
#[tokio::test]
async fn every_chat_completions_parameter_is_served_or_refused_by_name() {
    let (gw, _dir) = start_gateway(ImageFetcher::new(FetchOptions::deny_all())).await;
    let tools = json!([{"type": "function", "function": {"name": "f"}}]);
    let served = [
        ("frequency_penalty", json!(0.5)),
        ("logit_bias", json!({"5": 1})),
        ("logprobs", json!(true)),
        ("max_completion_tokens", json!(3)),
        ("max_tokens", json!(3)),
        ("metadata", json!({"k": "v"})),
        ("modalities", json!(["text"])),
        ("model", json!("")),
        ("n", json!(2)),
        ("presence_penalty", json!(-0.5)),
        ("prompt_cache_key", json!("k")),
        ("response_format", json!({"type": "json_object"})),
        ("safety_identifier", json!("u")),
        ("seed", json!(7)),
        ("service_tier", json!("auto")),
        ("stop", json!(["x"])),
        ("store", json!(false)),
        ("stream", json!(true)),
        ("temperature", json!(0.7)),
        ("tools", tools.clone()),
        ("top_p", json!(0.9)),
        ("user", json!("u")),
    ];
    for (param, v) in served {
        let mut b = body(json!({}));
        b[param] = v;
        let (status, text) = post(gw, &b).await;
        assert_eq!(status, 503, "{param} should be served: {text}");
    }
    // Those that need a companion.
    for b in [
        body(json!({"logprobs": true, "top_logprobs": 2})),
        body(json!({"stream": true, "stream_options": {"include_usage": false}})),
        body(json!({"tools": tools, "tool_choice": "required", "parallel_tool_calls": false})),
    ] {
        let (status, text) = post(gw, &b).await;
        assert_eq!(status, 503, "{b}: {text}");
    }
    let refused = [
        ("audio", json!({"voice": "alloy", "format": "wav"})),
        ("function_call", json!("auto")),
        ("functions", json!([{"name": "f"}])),
        ("modalities", json!(["text", "audio"])),
        ("prediction", json!({"type": "content", "content": "x"})),
        ("reasoning_effort", json!("low")),
        ("service_tier", json!("flex")),
        ("store", json!(true)),
        ("verbosity", json!("low")),
        ("web_search_options", json!({})),
    ];
    for (param, v) in refused {
        let mut b = body(json!({}));
        b[param] = v;
        let (status, text) = post(gw, &b).await;
        assert_eq!(status, 400, "{param} should be refused: {text}");
        assert_eq!(json_body(&text)["error"]["param"], param, "{text}");
    }
}

/// `/tokenize` and `/detokenize` refuse what they would otherwise ignore: a count without the
/// generation prompt, another model.
#[tokio::test]
async fn tokenize_refuses_what_it_would_ignore() {
    let (gw, _dir) = start_gateway(ImageFetcher::new(FetchOptions::deny_all())).await;
    let (status, text) = request(gw, "POST", "/tokenize", r#"{"prompt": "hi"}"#).await;
    assert_eq!(status, 200, "{text}");
    assert!(json_body(&text)["count"].as_u64().unwrap() > 0);
    let body =
        r#"{"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": false}"#;
    let (status, text) = request(gw, "POST", "/tokenize", body).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("add_generation_prompt"), "{text}");
    // A model this server does not serve is OpenAI's 404 model_not_found.
    for (path, body) in [
        ("/tokenize", r#"{"prompt": "hi", "model": "other"}"#),
        ("/detokenize", r#"{"tokens": [1], "model": "other"}"#),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "hi"}], "model": "other"}"#,
        ),
        ("/v1/completions", r#"{"prompt": "hi", "model": "other"}"#),
    ] {
        let (status, text) = request(gw, "POST", path, body).await;
        assert_eq!(status, 404, "{body}: {text}");
        let e = &json_body(&text)["error"];
        assert_eq!(e["code"], "model_not_found", "{text}");
        assert_eq!(e["param"], "model", "{text}");
        assert!(
            e["message"].as_str().unwrap().contains("\"other\""),
            "{text}"
        );
    }
}

/// `/tokenize` takes vLLM's `add_special_tokens` (true or false: Qwen's tokenizer adds nothing,
/// so the ids are the same) and `return_token_strs` (the tokens' strings), and its refusals
/// list its own fields, not the chat route's.
#[tokio::test]
async fn tokenize_serves_vllms_fields_and_lists_its_own() {
    let (gw, _dir) = start_gateway(ImageFetcher::new(FetchOptions::deny_all())).await;
    let tokens = |body: serde_json::Value| async move {
        let (status, text) = request(gw, "POST", "/tokenize", &body.to_string()).await;
        assert_eq!(status, 200, "{body}: {text}");
        json_body(&text)
    };
    let plain = tokens(json!({"prompt": "hello world"})).await;
    assert!(plain["count"].as_u64().unwrap() > 0, "{plain}");
    assert_eq!(plain["token_strs"], serde_json::Value::Null, "{plain}");
    for add in [true, false] {
        let v = tokens(json!({"prompt": "hello world", "add_special_tokens": add})).await;
        assert_eq!(v["tokens"], plain["tokens"], "add_special_tokens {add}");
    }
    let chat = json!([{"role": "user", "content": "hello"}]);
    let counted = tokens(json!({"messages": chat})).await;
    let v = tokens(json!({"messages": chat, "add_special_tokens": false})).await;
    assert_eq!(v["tokens"], counted["tokens"]);

    let v = tokens(json!({"prompt": "hello world", "return_token_strs": true})).await;
    assert_eq!(v["tokens"], plain["tokens"]);
    let strs: Vec<&str> = v["token_strs"]
        .as_array()
        .unwrap_or_else(|| panic!("no token_strs: {v}"))
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert_eq!(strs.len(), plain["tokens"].as_array().unwrap().len());
    // Byte-level strings: the space is "Ġ".
    assert_eq!(strs.concat(), "helloĠworld", "{v}");
    let v = tokens(json!({"messages": chat, "return_token_strs": true})).await;
    assert_eq!(
        v["token_strs"].as_array().map(Vec::len),
        counted["tokens"].as_array().map(Vec::len),
        "{v}"
    );
    assert!(
        v["token_strs"][0]
            .as_str()
            .unwrap()
            .starts_with("<|im_start|>"),
        "{v}"
    );

    for (body, param) in [
        (json!({"prompt": "hi", "temperature": 0.5}), "temperature"),
        (json!({"messages": chat, "bogus": 1}), "bogus"),
    ] {
        let (status, text) = request(gw, "POST", "/tokenize", &body.to_string()).await;
        assert_eq!(status, 400, "{body}: {text}");
        let e = &json_body(&text)["error"];
        assert_eq!(e["param"], param, "{text}");
        let msg = e["message"].as_str().unwrap();
        assert!(msg.contains("return_token_strs"), "{msg}");
        assert!(!msg.contains("max_completion_tokens"), "{msg}");
    }
    let (status, text) = request(
        gw,
        "POST",
        "/tokenize",
        r#"{"prompt": "hi", "add_special_tokens": "yes"}"#,
    )
    .await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("add_special_tokens"), "{text}");
}
