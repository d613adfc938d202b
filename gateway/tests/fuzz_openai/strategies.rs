//! The bodies the OpenAI parser's properties draw: any JSON near the real fields, valid requests,
//! and sampling values out of their documented ranges.
use base64::Engine;
use proptest::prelude::*;
use serde_json::{json, Map, Value};

pub fn png(w: u32, h: u32, seed: u8) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([(x as u8).wrapping_mul(seed), y as u8, seed])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

pub fn data_url(bytes: &[u8], mime: &str) -> String {
    format!(
        "data:{mime};base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

/// Text with what the tokenizer and template care about, special-token text included.
pub fn text() -> impl Strategy<Value = String> {
    let atom = prop_oneof![
        3 => prop::sample::select(vec![
            "hi", " the", "word", "é", "日本", "🦀", " ", "\n", "\t", "{", "}", "\"", "\\", "'s",
            "<|im_start|>", "<|im_end|>", "<|image_pad|>", "<|vision_start|>", "<|endoftext|>",
            "<tool_call>", "</think>", "<|", "|>", "{%", "{{", "\u{0}", "\u{feff}", "\u{FDD0}",
        ])
        .prop_map(str::to_string),
        1 => "\\PC{0,8}",
    ];
    prop::collection::vec(atom, 0..12).prop_map(|v| v.concat())
}

/// Numbers where limits are: 0, 1, -1, the ends of u32 / i64 / u64, past them, fractions, huge.
pub fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        prop::sample::select(vec![
            json!(0),
            json!(1),
            json!(-1),
            json!(2),
            json!(16),
            json!(17),
            json!(20),
            json!(21),
            json!(100),
            json!(101),
            json!(4095),
            json!(4096),
            json!(u32::MAX),
            json!(u32::MAX as u64 + 1),
            json!(i64::MIN),
            json!(u64::MAX),
            json!(0.5),
            json!(-0.5),
            json!(1.5),
            json!(2.5),
            json!(-2.5),
            json!(1e300),
            json!(-1e300),
            json!(1e39),
            json!(5e-324),
        ]),
        (-300i64..5000).prop_map(Value::from),
        (-3.0f64..3.0).prop_map(Value::from),
    ]
}

pub fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number(),
        text().prop_map(Value::String),
        prop::sample::select(vec![
            "auto",
            "none",
            "required",
            "text",
            "json_object",
            "json_schema",
            "low",
            "high",
            "user",
            "function",
        ])
        .prop_map(|s| Value::String(s.to_string())),
    ]
}

/// Any JSON value, nested a few levels (keys sometimes the body's own).
pub fn any_value() -> impl Strategy<Value = Value> {
    let key = prop_oneof![
        prop::sample::select(FIELDS.to_vec()).prop_map(str::to_string),
        prop::sample::select(vec![
            "type",
            "function",
            "name",
            "url",
            "text",
            "image_url",
            "role",
            "content"
        ])
        .prop_map(str::to_string),
        "[a-z_]{1,8}",
    ];
    scalar().prop_recursive(4, 40, 5, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec((key.clone(), inner), 0..5)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// Every top-level field the chat route reads, and some it refuses or accepts as no-ops.
pub const FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "ignore_eos",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "stop_token_ids",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "mm_processor_kwargs",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "user",
    "metadata",
    "store",
    "functions",
    "echo",
];

/// A plausible value for a top-level field: the right type often, any other sometimes.
pub fn field_value(key: &'static str) -> BoxedStrategy<Value> {
    let typed: BoxedStrategy<Value> = match key {
        "model" => prop_oneof![Just(json!("tiny")), Just(json!("")), text().prop_map(Value::String)].boxed(),
        "stop" => prop_oneof![
            text().prop_map(Value::String),
            prop::collection::vec(text().prop_map(Value::String), 0..10).prop_map(Value::Array),
        ]
        .boxed(),
        "stream_options" => (any::<bool>(), prop::option::of(scalar()))
            .prop_map(|(u, x)| {
                let mut o = json!({"include_usage": u});
                if let Some(x) = x {
                    o["continuous_usage_stats"] = x;
                }
                o
            })
            .boxed(),
        "logit_bias" => prop::collection::vec(
            (prop_oneof![(0u32..1100).prop_map(|i| i.to_string()), text()], number()),
            0..4,
        )
        .prop_map(|kv| Value::Object(kv.into_iter().collect()))
        .boxed(),
        "stop_token_ids" => prop::collection::vec(number(), 0..4).prop_map(Value::Array).boxed(),
        "tools" => prop::collection::vec(
            (text(), any_value()).prop_map(|(name, params)| {
                json!({"type": "function", "function": {"name": name, "parameters": params}})
            }),
            0..3,
        )
        .prop_map(Value::Array)
        .boxed(),
        "tool_choice" => prop_oneof![
            prop::sample::select(vec!["none", "auto", "required"]).prop_map(|s| json!(s)),
            text().prop_map(|n| json!({"type": "function", "function": {"name": n}})),
        ]
        .boxed(),
        "mm_processor_kwargs" => (prop::option::of(number()), prop::option::of(number()))
            .prop_map(|(a, b)| json!({"min_pixels": a, "max_pixels": b}))
            .boxed(),
        "response_format" => prop_oneof![
            prop::sample::select(vec!["text", "json_object", "json_schema", "bogus"])
                .prop_map(|t| json!({"type": t})),
            any_value().prop_map(|s| json!({"type": "json_schema", "json_schema": {"name": "x", "schema": s}})),
        ]
        .boxed(),
        "structured_outputs" => prop::sample::select(vec![
            json!({"regex": "a+"}),
            json!({"choice": ["a", "b"]}),
            json!({"choice": []}),
            json!({"json_object": true}),
            json!({"json": {"type": "object"}}),
            json!({"grammar": ""}),
            json!({"regex": 5}),
            json!({"bogus": 1}),
        ])
        .boxed(),
        "guided_choice" => prop::collection::vec(text().prop_map(Value::String), 0..3)
            .prop_map(Value::Array)
            .boxed(),
        "guided_regex" | "guided_grammar" | "user" => text().prop_map(Value::String).boxed(),
        // Unsigned counts.
        "max_tokens" | "max_completion_tokens" | "n" | "min_tokens" | "top_logprobs" => prop_oneof![
            4 => prop_oneof![0u32..8, 0u32..5000].prop_map(Value::from),
            1 => number(),
        ]
        .boxed(),
        "top_k" => prop_oneof![4 => (-3i64..200).prop_map(Value::from), 1 => number()].boxed(),
        "seed" => prop_oneof![4 => any::<u64>().prop_map(Value::from), 1 => number()].boxed(),
        "stream" | "ignore_eos" | "logprobs" | "parallel_tool_calls" | "store" | "echo" => {
            prop_oneof![4 => any::<bool>().prop_map(Value::Bool), 1 => scalar()].boxed()
        }
        // Floats.
        _ => prop_oneof![
            4 => prop_oneof![-0.5f64..2.5, Just(0.0), Just(1.0)].prop_map(Value::from),
            1 => number(),
        ]
        .boxed(),
    };
    prop_oneof![12 => typed, 1 => scalar(), 1 => any_value()].boxed()
}

pub fn part() -> impl Strategy<Value = Value> {
    let small_png = (1u32..48, 1u32..48, any::<u8>())
        .prop_map(|(w, h, s)| data_url(&png(w, h, s), "image/png"));
    let url = prop_oneof![
        3 => small_png,
        1 => Just("data:image/png;base64,iVBORw0KGgo=".to_string()),
        1 => Just("data:image/png,notbase64".to_string()),
        1 => Just("data:;base64,".to_string()),
        1 => Just("http://example.com/a.png".to_string()),
        1 => Just("file:///etc/passwd".to_string()),
        1 => text(),
    ];
    prop_oneof![
        12 => text().prop_map(|t| json!({"type": "text", "text": t})),
        2 => (url, prop::option::of(prop::sample::select(vec!["auto", "low", "high", "medium"])))
            .prop_map(|(u, d)| match d {
                Some(d) => json!({"type": "image_url", "image_url": {"url": u, "detail": d}}),
                None => json!({"type": "image_url", "image_url": u}),
            }),
        1 => any_value(),
    ]
}

pub fn message() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        30 => prop::sample::select(vec!["system", "user", "assistant", "tool", "developer"])
            .prop_map(|r| json!(r)),
        1 => scalar(),
    ];
    let content = prop_oneof![
        12 => text().prop_map(Value::String),
        12 => prop::collection::vec(part(), 0..4).prop_map(Value::Array),
        1 => scalar(),
        1 => any_value(),
    ];
    let calls = prop::option::weighted(
        0.15,
        prop::collection::vec(
            prop_oneof![
                (text(), prop_oneof![text().prop_map(Value::String), any_value()])
                    .prop_map(|(n, a)| json!({"type": "function", "function": {"name": n, "arguments": a}})),
                any_value(),
            ],
            0..3,
        ),
    );
    let extra = prop::option::weighted(
        0.1,
        (
            prop::sample::select(vec!["name", "tool_call_id", "refusal", "audio"]),
            scalar(),
        ),
    );
    (role, prop::option::weighted(0.95, content), calls, extra).prop_map(
        |(role, content, calls, extra)| {
            let mut m = Map::new();
            m.insert("role".into(), role);
            if let Some(c) = content {
                m.insert("content".into(), c);
            }
            if let Some(c) = calls {
                m.insert("tool_calls".into(), Value::Array(c));
            }
            if let Some((k, v)) = extra {
                m.insert(k.into(), v);
            }
            Value::Object(m)
        },
    )
}

/// A random body: mostly an object of known fields (with messages), sometimes anything.
pub fn body() -> impl Strategy<Value = Value> {
    let fields = prop::collection::vec(
        prop::sample::select(FIELDS.to_vec())
            .prop_flat_map(|k| field_value(k).prop_map(move |v| (k, v))),
        0..6,
    );
    let messages = prop_oneof![
        24 => prop::collection::vec(message(), 0..5).prop_map(Value::Array),
        1 => scalar(),
        1 => any_value(),
    ];
    let object = (
        fields,
        prop::option::weighted(0.95, messages),
        prop::option::weighted(0.1, ("[a-z_]{1,12}", scalar())),
    )
        .prop_map(|(fields, messages, unknown)| {
            let mut m = Map::new();
            if let Some(msgs) = messages {
                m.insert("messages".into(), msgs);
            }
            for (k, v) in fields {
                m.insert(k.into(), v);
            }
            if let Some((k, v)) = unknown {
                m.insert(k, v);
            }
            Value::Object(m)
        });
    prop_oneof![30 => object, 1 => any_value()]
}

// ---- valid requests ----

#[derive(Debug, Clone)]
pub struct ValidBody {
    pub body: Value,
    pub max_tokens: Option<u32>,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub n: u32,
    pub images: usize,
}

pub fn valid_body() -> impl Strategy<Value = ValidBody> {
    let plain = "[a-zA-Z0-9 .,!?\n]{0,40}";
    let user_content = prop_oneof![
        plain.prop_map(Value::String),
        prop::collection::vec(
            prop_oneof![
                3 => plain.prop_map(|t| json!({"type": "text", "text": t})),
                1 => (16u32..80, 16u32..80, any::<u8>(), prop::sample::select(vec!["auto", "low", "high"]))
                    .prop_map(|(w, h, s, d)| json!({"type": "image_url",
                        "image_url": {"url": data_url(&png(w, h, s), "image/png"), "detail": d}})),
            ],
            1..4,
        )
        .prop_map(Value::Array),
    ];
    let turn = prop_oneof![
        user_content.prop_map(|c| json!({"role": "user", "content": c})),
        plain.prop_map(|t| json!({"role": "assistant", "content": t})),
        plain.prop_map(|t| json!({"role": "tool", "content": t, "tool_call_id": "c1"})),
    ];
    let system = prop::option::of((prop::sample::select(vec!["system", "developer"]), plain));
    let sampling = (
        (
            prop::option::of(1u32..1500),
            0.0f32..2.0,
            0.0f32..=1.0,
            -1i64..100,
            1u32..=16,
            0.0f32..=1.0,
        ),
        (
            -2.0f32..=2.0,
            -2.0f32..=2.0,
            prop_oneof![Just(1.0f32), 0.01f32..=2.0],
            prop::option::of(0u32..=20),
            prop::collection::btree_map(0u32..1024, -100.0f32..=100.0, 0..5),
            prop::collection::vec("[a-z!.]{1,12}", 0..=8),
            prop::option::of(any::<u64>()),
            any::<bool>(),
        ),
    );
    (system, prop::collection::vec(turn, 1..5), sampling).prop_map(|(system, turns, sampling)| {
        let ((max_tokens, temperature, top_p, top_k, n, min_p), (pp, fp, rp, top_lp, bias, stop, seed, stream)) =
            sampling;
        let mut messages: Vec<Value> = system
            .into_iter()
            .map(|(r, t)| json!({"role": r, "content": t}))
            .collect();
        messages.extend(turns);
        // At most two images (the server's --max-images here): later ones become text.
        let mut images = 0;
        for m in &mut messages {
            if let Some(parts) = m["content"].as_array_mut() {
                for p in parts {
                    if p["type"] == "image_url" {
                        images += 1;
                        if images > 2 {
                            *p = json!({"type": "text", "text": "an image no more"});
                        }
                    }
                }
            }
        }
        let images = images.min(2);
        let mut body = json!({
            "model": "tiny", "messages": messages, "temperature": temperature, "top_p": top_p,
            "top_k": top_k, "n": n, "min_p": min_p, "presence_penalty": pp,
            "frequency_penalty": fp, "repetition_penalty": rp,
            "logit_bias": bias.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<Map<_, _>>(),
            "stop": stop, "stream": stream,
        });
        if let Some(m) = max_tokens {
            body["max_tokens"] = json!(m);
            body["min_tokens"] = json!(m / 2);
        }
        if let Some(k) = top_lp {
            body["logprobs"] = json!(true);
            body["top_logprobs"] = json!(k);
        }
        if let Some(s) = seed {
            body["seed"] = json!(s);
        }
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        ValidBody {
            body,
            max_tokens,
            temperature,
            top_p,
            top_k: top_k.max(0) as u32,
            n,
            images,
        }
    })
}

// ---- out-of-range sampling parameters ----

/// (field, a value outside its documented range, the param named, text the message holds).
pub fn out_of_range() -> impl Strategy<Value = (Vec<(&'static str, Value)>, &'static str)> {
    let neg = -1e30f64..-0.001;
    prop_oneof![
        neg.clone()
            .prop_map(|t| (vec![("temperature", json!(t))], "temperature")),
        Just((vec![("temperature", json!(1e39))], "temperature")),
        prop_oneof![neg.clone(), 1.001f64..1e30].prop_map(|t| (vec![("top_p", json!(t))], "top_p")),
        prop_oneof![neg.clone(), 1.001f64..1e30].prop_map(|t| (vec![("min_p", json!(t))], "min_p")),
        prop_oneof![-1e30f64..-2.001, 2.001f64..1e30]
            .prop_map(|t| (vec![("presence_penalty", json!(t))], "presence_penalty")),
        prop_oneof![-1e30f64..-2.001, 2.001f64..1e30]
            .prop_map(|t| (vec![("frequency_penalty", json!(t))], "frequency_penalty")),
        prop_oneof![-1e30f64..-0.001, 0.0001f64..0.0099, 2.001f64..1e30]
            .prop_map(|t| (vec![("repetition_penalty", json!(t))], "repetition_penalty")),
        prop_oneof![i64::MIN..-1, (u32::MAX as i64 + 1)..i64::MAX]
            .prop_map(|k| (vec![("top_k", json!(k))], "top_k")),
        prop_oneof![Just(0u32), 17u32..=u32::MAX].prop_map(|n| (vec![("n", json!(n))], "n")),
        Just((vec![("max_tokens", json!(0))], "max_tokens")),
        (4096u32..=u32::MAX).prop_map(|m| (vec![("max_tokens", json!(m))], "max_tokens")),
        Just((
            vec![("max_completion_tokens", json!(0))],
            "max_completion_tokens"
        )),
        // max_completion_tokens past the context: see regression_max_completion_tokens_past_the_context.
        (21u32..=u32::MAX).prop_map(|k| (
            vec![("logprobs", json!(true)), ("top_logprobs", json!(k))],
            "top_logprobs"
        )),
        (1u32..=20).prop_map(|k| (vec![("top_logprobs", json!(k))], "top_logprobs")),
        (1u32..1000).prop_map(|m| (
            vec![("max_tokens", json!(m)), ("min_tokens", json!(m + 1))],
            "min_tokens"
        )),
        prop_oneof![-1e30f64..-100.001, 100.001f64..1e30]
            .prop_map(|b| (vec![("logit_bias", json!({"7": b}))], "logit_bias")),
        Just((vec![("logit_bias", json!({"seven": 1}))], "logit_bias")),
        (9usize..20).prop_map(|k| (vec![("stop", json!(vec!["x"; k]))], "stop")),
        (257usize..400).prop_map(|k| (vec![("stop", json!(["y".repeat(k)]))], "stop")),
        Just((vec![("stop", json!([""]))], "stop")),
        Just((
            vec![("stream_options", json!({"include_usage": true}))],
            "stream_options"
        )),
    ]
}
