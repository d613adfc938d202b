//! End-to-end: logprobs and the sampling parameters through the three real binaries on the
//! tiny random checkpoint. Each parameter is checked against what it must do to greedy
//! output; the expectations come from the run's own raw logprobs (the LM computes them before
//! any bias or penalty, so they give the margins a bias or a penalty has to beat).
#![allow(clippy::await_holding_lock)]
mod support;

use serde_json::{json, Value};
use support::*;
use vlm_proto::v1 as pb;

const N: u32 = 16;
const TOP: usize = 5;
const PROMPT: &str = "Tell me a story about a cat and a dog.";

/// Greedy, N tokens whatever EOS does, logprobs with TOP alternatives; then `f`.
fn request(f: impl FnOnce(&mut pb::SamplingParams)) -> pb::GenerateRequest {
    let mut r = grpc_request(&[], PROMPT, N);
    let s = r.sampling.as_mut().unwrap();
    s.ignore_eos = true;
    s.logprobs = true;
    s.top_logprobs = TOP as u32;
    f(s);
    r
}

fn http_request(extra: Value) -> Value {
    let mut b = json!({
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": N, "temperature": 0, "ignore_eos": true,
        "logprobs": true, "top_logprobs": TOP,
    });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// The first position whose token was already generated and where a `penalty` (per use, or
/// once when `per_use` is false) must change the greedy choice: an alternative in the top
/// logprobs beats the penalized token by a clear margin.
fn forced_change(base: &Output, penalty: f32, per_use: bool) -> Option<usize> {
    let uses = |t: u32, p: usize| {
        let c = base.tokens[..p].iter().filter(|&&x| x == t).count() as f32;
        if per_use {
            c
        } else {
            c.min(1.0)
        }
    };
    (0..base.tokens.len()).find(|&p| {
        let t = base.tokens[p];
        let lp = &base.logprobs[p];
        let penalized = lp.logprob - penalty * uses(t, p);
        uses(t, p) > 0.0
            && lp.top_logprobs.iter().any(|u| {
                u.token_id != t && u.logprob - penalty * uses(u.token_id, p) > penalized + 1e-3
            })
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_and_sampling_parameters_act_as_documented() {
    let _g = serial();
    let c = Cluster::start(1, &[]).await;
    let gw = c.grpc();

    // Logprobs: one per token, the token's own first among its alternatives (greedy picks the
    // raw argmax), sorted, a probability mass of at most 1, and texts filled by the gateway.
    let base = generate(&gw, request(|_| {})).await.unwrap();
    assert_eq!(base.tokens.len(), N as usize);
    assert_eq!(base.logprobs.len(), N as usize);
    for (p, (lp, &t)) in base.logprobs.iter().zip(&base.tokens).enumerate() {
        assert_eq!(lp.token_id, t, "position {p}");
        assert_eq!(lp.top_logprobs.len(), TOP, "position {p}");
        assert_eq!(lp.top_logprobs[0].token_id, t, "position {p}");
        assert!((lp.top_logprobs[0].logprob - lp.logprob).abs() < 1e-6);
        assert_eq!(lp.top_logprobs[0].token, lp.token);
        assert!(lp
            .top_logprobs
            .windows(2)
            .all(|w| w[0].logprob >= w[1].logprob));
        let mass: f32 = lp.top_logprobs.iter().map(|t| t.logprob.exp()).sum();
        assert!(mass <= 1.0 + 1e-4, "position {p}: mass {mass}");
        assert!(lp.logprob <= 0.0);
    }

    // The same through HTTP, not streamed and streamed, in OpenAI's shapes.
    let (status, text) = post_json(&c.http(), &http_request(json!({})));
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), N as usize);
    for (e, lp) in content.iter().zip(&base.logprobs) {
        assert_eq!(e["token"], lp.token.as_str());
        assert!((e["logprob"].as_f64().unwrap() - lp.logprob as f64).abs() < 1e-5);
        let bytes: Vec<u8> = e["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(String::from_utf8_lossy(&bytes), lp.token);
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), TOP);
        assert_eq!(top[1]["token"], lp.top_logprobs[1].token.as_str());
    }
    assert_eq!(v["choices"][0]["message"]["content"], base.text.as_str());
    let (status, text) = post_json(&c.http(), &http_request(json!({"stream": true})));
    assert_eq!(status, 200, "{text}");
    let streamed: Vec<String> = sse_chunks(&text)
        .iter()
        .filter_map(|ch| ch["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .map(|e| e["token"].as_str().unwrap().to_string())
        .collect();
    let want: Vec<String> = base.logprobs.iter().map(|l| l.token.clone()).collect();
    assert_eq!(streamed, want);
    // Without logprobs, none.
    let (_, text) = post_json(
        &c.http(),
        &http_request(json!({"logprobs": false, "top_logprobs": 0})),
    );
    let v: Value = serde_json::from_str(&text).unwrap();
    assert!(v["choices"][0]["logprobs"].is_null(), "{text}");

    // logit_bias +100 on the 5th most likely first token: every token is it, and its logprob
    // is still the raw one.
    let x = base.logprobs[0].top_logprobs[TOP - 1].clone();
    let biased = generate(
        &gw,
        request(|s| {
            s.logit_bias.insert(x.token_id, 100.0);
        }),
    )
    .await
    .unwrap();
    assert!(
        biased.tokens.iter().all(|&t| t == x.token_id),
        "{:?}",
        biased.tokens
    );
    assert!((biased.logprobs[0].logprob - x.logprob).abs() < 1e-5);
    // -100 on the greedy first token: the runner-up comes first.
    let banned = generate(
        &gw,
        request(|s| {
            s.logit_bias.insert(base.tokens[0], -100.0);
        }),
    )
    .await
    .unwrap();
    assert_eq!(banned.tokens[0], base.logprobs[0].top_logprobs[1].token_id);

    // A stop token id ends the output at its first occurrence; min_tokens masks it until then
    // (the runner-up takes its place).
    let s = base.tokens[2];
    let p = base.tokens.iter().position(|&t| t == s).unwrap();
    let stopped = generate(&gw, request(|r| r.stop_token_ids = vec![s]))
        .await
        .unwrap();
    assert_eq!(stopped.tokens, base.tokens[..=p]);
    assert_eq!(stopped.finish, pb::FinishReason::Stop as i32);
    let min = p as u32 + 2;
    let held = generate(
        &gw,
        request(|r| {
            r.stop_token_ids = vec![s];
            r.min_tokens = min;
        }),
    )
    .await
    .unwrap();
    assert!(held.tokens.len() >= min as usize, "{:?}", held.tokens);
    assert!(
        !held.tokens[..min as usize].contains(&s),
        "{:?}",
        held.tokens
    );
    assert_eq!(held.tokens[..p], base.tokens[..p]);
    assert_eq!(held.tokens[p], base.logprobs[p].top_logprobs[1].token_id);

    // Penalties: identical output up to the first repeat they must overturn, then a
    // different token there.
    for (name, per_use) in [("frequency_penalty", true), ("presence_penalty", false)] {
        let q = forced_change(&base, 2.0, per_use).unwrap_or_else(|| {
            panic!(
                "no position of {:?} where {name} 2 must change the choice",
                base.tokens
            )
        });
        let out = generate(
            &gw,
            request(|r| {
                if per_use {
                    r.frequency_penalty = 2.0;
                } else {
                    r.presence_penalty = 2.0;
                }
            }),
        )
        .await
        .unwrap();
        assert_eq!(out.tokens[..q], base.tokens[..q], "{name}");
        assert_ne!(out.tokens[q], base.tokens[q], "{name} at {q}");
    }
    // A repetition penalty changes a greedy output that repeats itself.
    let out = generate(&gw, request(|r| r.repetition_penalty = 2.0))
        .await
        .unwrap();
    assert_ne!(out.tokens, base.tokens);

    // The LM checks token ids against its vocabulary (the internal API trusts no caller).
    let e = generate(
        &gw,
        request(|r| {
            r.logit_bias.insert(10_000_000, 1.0);
        }),
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("vocabulary"), "{e:?}");
    // Still serving.
    generate(&gw, request(|_| {})).await.unwrap();
}

fn post_path(addr: &str, path: &str, v: &Value) -> (u16, Value) {
    let (status, text) = http(addr, "POST", path, v.to_string().as_bytes());
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {text}: {e}"));
    (status, v)
}

/// `/v1/completions` with a text or id prompt, logprobs, echo and streaming; `/tokenize` and
/// `/detokenize` agree with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_tokenize_and_detokenize() {
    let _g = serial();
    let c = Cluster::start(1, &[]).await;
    let h = c.http();
    let prompt = "Once upon a time";
    let base = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    let (status, v) = post_path(&h, "/v1/completions", &base);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(v["usage"]["completion_tokens"], 8);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert!(v["choices"][0]["logprobs"].is_null());

    // The same prompt as ids (from /tokenize) gives the same greedy text; /detokenize inverts.
    let (status, t) = post_path(&h, "/tokenize", &json!({"prompt": prompt}));
    assert_eq!(status, 200, "{t}");
    assert_eq!(t["count"], v["usage"]["prompt_tokens"]);
    let (_, d) = post_path(&h, "/detokenize", &json!({"tokens": t["tokens"]}));
    assert_eq!(d["prompt"], prompt);
    let mut by_ids = base.clone();
    by_ids["prompt"] = t["tokens"].clone();
    let (_, v2) = post_path(&h, "/v1/completions", &by_ids);
    assert_eq!(v2["choices"][0]["text"], text.as_str());

    // Legacy logprobs: one per token, alternatives as token -> logprob maps.
    let mut lp = base.clone();
    lp["logprobs"] = json!(3);
    let (_, v3) = post_path(&h, "/v1/completions", &lp);
    let l = &v3["choices"][0]["logprobs"];
    assert_eq!(l["tokens"].as_array().unwrap().len(), 8, "{v3}");
    assert_eq!(l["text_offset"][0], 0);
    for (k, top) in l["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 3, "{top:?}");
        let chosen = l["token_logprobs"][k].as_f64().unwrap();
        assert!(chosen <= 0.0);
        // Greedy: the chosen token is the most likely one.
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!((best - chosen).abs() < 1e-5, "{top:?} vs {chosen}");
    }

    // echo puts the prompt first; streaming adds up to the same text.
    let mut echo = base.clone();
    echo["echo"] = json!(true);
    let (_, v4) = post_path(&h, "/v1/completions", &echo);
    assert_eq!(v4["choices"][0]["text"], format!("{prompt}{text}"));
    let mut st = base.clone();
    st["stream"] = json!(true);
    st["stream_options"] = json!({"include_usage": true});
    let (status, body) = http(&h, "POST", "/v1/completions", st.to_string().as_bytes());
    assert_eq!(status, 200, "{body}");
    let chunks = sse_chunks(&body);
    let streamed: String = chunks
        .iter()
        .filter_map(|ch| ch["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, text);
    let last = chunks.last().unwrap();
    assert_eq!(
        last["choices"],
        json!([]),
        "the usage chunk has no choices: {last}"
    );
    assert_eq!(last["object"], "text_completion");
    assert!(last["usage"]["completion_tokens"] == 8);

    // /tokenize of messages counts what the chat route sends to the LM.
    let messages = json!([{"role": "user", "content": "hello there"}]);
    let (_, t) = post_path(&h, "/tokenize", &json!({"messages": messages}));
    let (_, chat) = post_path(
        &h,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 1}),
    );
    assert_eq!(t["count"], chat["usage"]["prompt_tokens"], "{t} {chat}");

    // Refusals name their parameter.
    for (body, param) in [
        (json!({"prompt": "a", "echo": true, "logprobs": 1}), "echo"),
        (json!({"prompt": ["a", "b"]}), "prompt"),
        (json!({"prompt": "a", "suffix": "z"}), "suffix"),
        (json!({"prompt": "a", "best_of": 2}), "best_of"),
        (json!({"prompt": "a", "max_tokens": 0}), "max_tokens"),
        (json!({"prompt": "a", "logprobs": 21}), "logprobs"),
    ] {
        let (status, v) = post_path(&h, "/v1/completions", &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    let (status, v) = post_path(&h, "/detokenize", &json!({"tokens": [999_999_999u32]}));
    assert_eq!(status, 400, "{v}");
}

/// n = 3: three choices from one prompt, each with its own generator; the prompt's full KV
/// blocks are computed once (the LM's prefill counter) and read by the other two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_share_one_prefill() {
    let _g = serial();
    let c = Cluster::start(1, &[]).await;
    let h = c.http();
    let lm = c.lms[0].addr("metrics");
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(60);
    let body = json!({"messages": [{"role": "user", "content": long}], "n": 3,
                      "max_tokens": 8, "temperature": 1, "seed": 11, "ignore_eos": true,
                      "logprobs": true});
    let before = scrape(&lm);
    let (status, text) = post_json(&h, &body);
    assert_eq!(status, 200, "{text}");
    let after = scrape(&lm);
    let v: Value = serde_json::from_str(&text).unwrap();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{text}");
    for (i, ch) in choices.iter().enumerate() {
        assert_eq!(ch["index"], i);
        assert_eq!(ch["finish_reason"], "length");
        assert_eq!(ch["logprobs"]["content"].as_array().unwrap().len(), 8);
    }
    let texts: Vec<&str> = choices
        .iter()
        .map(|ch| ch["message"]["content"].as_str().unwrap())
        .collect();
    assert!(texts[0] != texts[1] || texts[1] != texts[2], "{texts:?}");
    assert_eq!(v["usage"]["completion_tokens"], 24);
    let prompt = v["usage"]["prompt_tokens"].as_f64().unwrap();
    assert!(
        prompt > 256.0,
        "the prompt must fill a 256-token block: {prompt}"
    );
    let delta = |name: &str| after.sum(name).unwrap_or(0.0) - before.sum(name).unwrap_or(0.0);
    let prefilled = delta("vlm_lm_prefill_tokens_total");
    let hits = delta("vlm_lm_prefix_cache_hit_tokens_total");
    assert!(
        prefilled < 2.0 * prompt,
        "{prefilled} prefill tokens for 3 choices of a {prompt}-token prompt"
    );
    assert!(
        hits >= 2.0 * 256.0,
        "{hits} prompt tokens read from the cache"
    );

    // The same seed gives the same choices again; streamed, each choice ends once.
    let (_, again) = post_json(&h, &body);
    let again: Value = serde_json::from_str(&again).unwrap();
    assert_eq!(again["choices"], v["choices"]);
    let mut st = body.clone();
    st["stream"] = json!(true);
    st["stream_options"] = json!({"include_usage": true});
    let (status, text) = post_json(&h, &st);
    assert_eq!(status, 200, "{text}");
    let chunks = sse_chunks(&text);
    let mut ends = [0; 3];
    let mut streamed = vec![String::new(); 3];
    let (usage, chunks) = chunks.split_last().unwrap();
    assert_eq!(usage["choices"], json!([]), "{usage}");
    for ch in chunks {
        let i = ch["choices"][0]["index"].as_u64().unwrap() as usize;
        if let Some(t) = ch["choices"][0]["delta"]["content"].as_str() {
            streamed[i].push_str(t);
        }
        if ch["choices"][0]["finish_reason"].is_string() {
            ends[i] += 1;
        }
    }
    assert_eq!(ends, [1, 1, 1]);
    assert_eq!(streamed, texts);
    assert_eq!(usage["usage"]["completion_tokens"], 24);
    // Completions take n too.
    let (status, v) = post_path(
        &h,
        "/v1/completions",
        &json!({"prompt": "hi", "n": 2, "max_tokens": 3, "ignore_eos": true}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    let (status, v) = post_path(&h, "/v1/completions", &json!({"prompt": "hi", "n": 17}));
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("n")),
        "{v}"
    );
}
