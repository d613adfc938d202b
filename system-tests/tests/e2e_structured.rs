//! End-to-end: structured output through the three real binaries on the tiny random
//! checkpoint. A random model writes random tokens, so any valid output is the grammar's
//! doing: every answer must parse and validate against its schema (checked here by a small
//! validator of the keywords the schemas use), greedy and sampled, streamed and not.
#![allow(clippy::await_holding_lock)]
mod support;

use serde_json::{json, Value};
use support::*;
use vlm_proto::v1 as pb;

/// The JSON Schema keywords the test schemas use.
fn validate(schema: &Value, v: &Value, defs: &Value) -> Result<(), String> {
    if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
        let name = r.trim_start_matches("#/$defs/");
        return validate(&defs[name], v, defs);
    }
    if let Some(e) = schema.get("enum").and_then(Value::as_array) {
        if !e.contains(v) {
            return Err(format!("{v} not in {e:?}"));
        }
    }
    let ty = schema.get("type").and_then(Value::as_str).unwrap_or("any");
    let ok = match ty {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "integer" => v.is_i64() || v.is_u64(),
        "boolean" => v.is_boolean(),
        _ => true,
    };
    if !ok {
        return Err(format!("{v} is not {ty}"));
    }
    if let Some(n) = v.as_i64() {
        if schema
            .get("minimum")
            .and_then(Value::as_i64)
            .is_some_and(|m| n < m)
            || schema
                .get("maximum")
                .and_then(Value::as_i64)
                .is_some_and(|m| n > m)
        {
            return Err(format!("{n} out of bounds of {schema}"));
        }
    }
    if let (Some(s), Some(m)) = (v.as_str(), schema.get("maxLength").and_then(Value::as_u64)) {
        if s.chars().count() as u64 > m {
            return Err(format!("{s:?} longer than {m}"));
        }
    }
    if let Some(a) = v.as_array() {
        let n = a.len() as u64;
        if schema
            .get("minItems")
            .and_then(Value::as_u64)
            .is_some_and(|m| n < m)
            || schema
                .get("maxItems")
                .and_then(Value::as_u64)
                .is_some_and(|m| n > m)
        {
            return Err(format!("{n} items out of bounds of {schema}"));
        }
        if let Some(items) = schema.get("items") {
            for x in a {
                validate(items, x, defs)?;
            }
        }
    }
    if let Some(o) = v.as_object() {
        let props = schema.get("properties").and_then(Value::as_object);
        for r in schema
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if !o.contains_key(r.as_str().unwrap()) {
                return Err(format!("{r} missing from {v}"));
            }
        }
        for (k, x) in o {
            match props.and_then(|p| p.get(k)) {
                Some(s) => validate(s, x, defs)?,
                None if schema.get("additionalProperties") == Some(&Value::Bool(false)) => {
                    return Err(format!("{k} is not allowed in {v}"))
                }
                None => {}
            }
        }
    }
    Ok(())
}

fn schemas() -> Vec<Value> {
    vec![
        json!({"type": "object",
               "properties": {"name": {"type": "string", "maxLength": 10},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": false}),
        json!({"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
               "minItems": 1, "maxItems": 4}),
        json!({"type": "object",
               "properties": {
                   "ok": {"type": "boolean"},
                   "point": {"type": "object",
                             "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                            "y": {"type": "integer", "minimum": -5, "maximum": 5}},
                             "required": ["x", "y"], "additionalProperties": false}},
               "required": ["ok", "point"], "additionalProperties": false}),
        // pydantic's shape: definitions under $defs, referenced.
        json!({"$defs": {"Item": {"type": "object",
                                  "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
                                  "required": ["id"], "additionalProperties": false}},
               "type": "object",
               "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "maxItems": 2}},
               "required": ["items"], "additionalProperties": false}),
    ]
}

fn chat(extra: Value) -> Value {
    let mut b = json!({
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "max_tokens": 200,
    });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// The answer's text and finish reason, streamed or not.
fn answer(addr: &str, body: &Value) -> (String, String) {
    let (status, text) = post_json(addr, body);
    assert_eq!(status, 200, "{body}: {text}");
    if body["stream"] == true {
        let chunks = sse_chunks(&text);
        let finish = chunks
            .iter()
            .find_map(|c| c["choices"][0]["finish_reason"].as_str())
            .unwrap()
            .to_string();
        return (sse_text(&chunks), finish);
    }
    let v: Value = serde_json::from_str(&text).unwrap();
    (
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string(),
        v["choices"][0]["finish_reason"]
            .as_str()
            .unwrap()
            .to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_output_always_parses_and_validates() {
    let _g = serial();
    let c = Cluster::start(1, &[]).await;
    let http = c.http();
    for (i, schema) in schemas().into_iter().enumerate() {
        let defs = schema.get("$defs").cloned().unwrap_or(Value::Null);
        let rf = json!({"type": "json_schema", "json_schema": {"name": "s", "strict": true, "schema": schema}});
        for (mode, extra) in [
            ("greedy", json!({"temperature": 0, "response_format": rf})),
            (
                "sampled",
                json!({"temperature": 1, "seed": i, "response_format": rf}),
            ),
            (
                "streamed",
                json!({"temperature": 1, "seed": 9, "stream": true, "response_format": rf}),
            ),
            (
                "vllm spelling",
                json!({"temperature": 1, "seed": 5, "structured_outputs": {"json": schema}}),
            ),
        ] {
            let (text, finish) = answer(&http, &chat(extra));
            let v: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("schema {i} {mode}: {text:?} is not JSON: {e}"));
            validate(&schema, &v, &defs)
                .unwrap_or_else(|e| panic!("schema {i} {mode}: {text}: {e}"));
            assert_eq!(finish, "stop", "schema {i} {mode}: {text}");
        }
    }
    // Any JSON object: a random model may write one key forever, so the answer is a JSON
    // object, or (cut by max_tokens) the start of one.
    let (text, finish) = answer(
        &http,
        &chat(json!({"temperature": 1, "seed": 3, "response_format": {"type": "json_object"}})),
    );
    if finish == "stop" {
        assert!(
            serde_json::from_str::<Value>(&text).unwrap().is_object(),
            "{text:?}"
        );
    } else {
        assert!(text.starts_with('{'), "{text:?}");
        let e = serde_json::from_str::<Value>(&text).unwrap_err();
        assert!(
            e.is_eof(),
            "{text:?} is not the start of a JSON object: {e}"
        );
    }
    // A regex and a choice (vLLM's extras), and a Lark grammar.
    let (text, _) = answer(
        &http,
        &chat(json!({"temperature": 1, "seed": 1, "guided_regex": "[0-9]{4}-[0-9]{2}"})),
    );
    assert!(
        text.len() == 7
            && text.as_bytes()[4] == b'-'
            && text.replace('-', "").bytes().all(|b| b.is_ascii_digit()),
        "{text:?}"
    );
    let choices = ["cat", "dog", "a bird"];
    for seed in 0..3 {
        let (text, finish) = answer(
            &http,
            &chat(json!({"temperature": 1, "seed": seed, "guided_choice": choices})),
        );
        assert!(choices.contains(&text.as_str()), "{text:?}");
        assert_eq!(finish, "stop");
    }
    let (text, _) = answer(
        &http,
        &chat(
            json!({"temperature": 1, "structured_outputs": {"grammar": "start: \"yes\" | \"no\""}}),
        ),
    );
    assert!(text == "yes" || text == "no", "{text:?}");

    // The gRPC API takes the same constraint.
    let mut req = grpc_request(&[], "pick", 50);
    req.sampling.as_mut().unwrap().structured = Some(pb::StructuredOutput {
        kind: Some(pb::structured_output::Kind::Choice(pb::ChoiceList {
            choices: vec!["left".into(), "right".into()],
        })),
    });
    let out = generate(&c.grpc(), req).await.unwrap();
    assert!(out.text == "left" || out.text == "right", "{:?}", out.text);
    assert_eq!(out.finish, pb::FinishReason::Stop as i32);

    // A grammar that cannot compile is a 400 naming the problem; the server keeps serving.
    for (extra, needle) in [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "no-such-type"}}}}),
            "no-such-type",
        ),
        (json!({"guided_regex": "("}), "cannot be compiled"),
        (
            json!({"structured_outputs": {"grammar": "start: ("}}),
            "cannot be compiled",
        ),
    ] {
        let (status, text) = post_json(&http, &chat(extra.clone()));
        assert_eq!(status, 400, "{extra}: {text}");
        assert!(text.contains(needle), "{extra}: {text}");
    }
    let (status, text) = post_json(
        &http,
        &chat(json!({"guided_choice": ["a"], "guided_regex": "b"})),
    );
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("one structured-output constraint"), "{text}");
    answer(&http, &chat(json!({"guided_choice": ["still", "here"]})));
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
            "parameters": {"type": "object",
                           "properties": {"city": {"type": "string", "maxLength": 12},
                                          "unit": {"type": "string", "enum": ["c", "f"]}},
                           "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "now"}},
    ])
}

/// Each call is one of the tools, with arguments valid for it.
fn check_calls(calls: &[Value]) {
    let defs = tools();
    assert!(!calls.is_empty());
    for c in calls {
        assert!(c["id"].as_str().unwrap().starts_with("call_"), "{c}");
        assert_eq!(c["type"], "function");
        let name = c["function"]["name"].as_str().unwrap();
        let args: Value =
            serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap();
        let def = defs
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["function"]["name"] == name)
            .unwrap_or_else(|| panic!("{name} is not a tool"));
        let schema = def["function"]
            .get("parameters")
            .cloned()
            .unwrap_or(json!({"type": "object", "additionalProperties": false}));
        validate(&schema, &args, &Value::Null).unwrap_or_else(|e| panic!("{c}: {e}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_and_named_tool_calls_parse_into_tool_calls() {
    let _g = serial();
    let c = Cluster::start(1, &[]).await;
    let http = c.http();
    let ask = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}],
                           "tools": tools(), "max_tokens": 300, "temperature": 1});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let mut first = Value::Null;
    for seed in 0..3 {
        let (status, text) = post_json(
            &http,
            &ask(json!({"tool_choice": "required", "parallel_tool_calls": false, "seed": seed})),
        );
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{text}");
        let calls = choice["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{text}");
        check_calls(calls);
        if seed == 0 {
            first = v;
        }
    }
    // A named function: only that one.
    let (_, text) = post_json(
        &http,
        &ask(
            json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "seed": 4}),
        ),
    );
    let v: Value = serde_json::from_str(&text).unwrap();
    let calls = v["choices"][0]["message"]["tool_calls"]
        .as_array()
        .unwrap()
        .clone();
    check_calls(&calls);
    assert!(
        calls.iter().all(|c| c["function"]["name"] == "get_weather"),
        "{text}"
    );
    // Streamed: the calls come as tool-call deltas on the last chunk.
    let (status, text) = post_json(
        &http,
        &ask(
            json!({"tool_choice": "required", "parallel_tool_calls": false, "seed": 1, "stream": true}),
        ),
    );
    assert_eq!(status, 200, "{text}");
    let chunks = sse_chunks(&text);
    let last = chunks
        .iter()
        .find(|ch| ch["choices"][0]["finish_reason"].is_string())
        .unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls", "{text}");
    let calls = last["choices"][0]["delta"]["tool_calls"]
        .as_array()
        .unwrap();
    assert_eq!(calls[0]["index"], 0);
    check_calls(calls);
    // The call and its result go back into the conversation; the template renders both.
    let call = first["choices"][0]["message"].clone();
    let id = call["tool_calls"][0]["id"].as_str().unwrap().to_string();
    let (status, text) = post_json(
        &http,
        &json!({"messages": [
            {"role": "user", "content": "Weather in Paris?"},
            call,
            {"role": "tool", "tool_call_id": id, "content": "18 C and sunny"}],
            "tools": tools(), "max_tokens": 5, "temperature": 0}),
    );
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert!(
        v["usage"]["prompt_tokens"].as_u64().unwrap()
            > first["usage"]["prompt_tokens"].as_u64().unwrap() + 10,
        "{text}"
    );
    // auto: whatever the model says, a well-formed answer.
    let (status, text) = post_json(&http, &ask(json!({"tool_choice": "auto", "max_tokens": 8})));
    assert_eq!(status, 200, "{text}");
}
