//! End-to-end: the three real binaries (vision-service, lm-service, gateway) on a tiny random
//! checkpoint, driven through the gateway's gRPC and HTTP APIs.
//!
//! The binaries are taken from the directory of `vlm` (`target/<profile>/`); when one is
//! missing the test builds them with `cargo build -p vlm-vision-service -p vlm-lm-service
//! -p vlm-gateway`. Tests start their own processes on loopback port 0 and run one at a time.
// Each test has its own runtime on its own thread; the std mutex only serialises them.
#![allow(clippy::await_holding_lock)]
mod support;

use std::path::Path;
use std::time::{Duration, Instant};
use support::*;
use vlm_proto::v1 as pb;

// ---------------------------------------------------------------- request helpers (base64)

fn http_body(images: &[Vec<u8>], text: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    let parts = user_parts(images, text);
    serde_json::json!({
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": max_tokens, "temperature": 0, "stream": stream
    })
}

// ---------------------------------------------------------------- tests

/// A greedy request with two images gives the tokens of the in-process pipeline, and the HTTP
/// API answers it identically, streaming and not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_images_greedy_matches_in_process_and_http() {
    let _g = serial();
    let images = vec![png(96, 64, 1), png(200, 150, 2)];
    let prompt = "Compare the two images.";
    let max_tokens = 12;

    // In-process oracle.
    let (tok, pipeline) = tiny_oracle();
    let pre = vlm_preprocess::PreprocessConfig::default();
    let pixels: Vec<_> = images
        .iter()
        .map(|b| vlm_preprocess::preprocess_bytes(b, &pre).unwrap())
        .collect();
    let embeds = pipeline.encode_images(&pixels).unwrap();
    use vlm_tokenizer::{ChatMessage, ChatPart};
    let msg = ChatMessage::user(vec![
        ChatPart::Image,
        ChatPart::Image,
        ChatPart::Text(prompt.into()),
    ]);
    let counts: Vec<usize> = embeds.iter().map(|e| e.tokens()).collect();
    let ids = tok.encode_prompt(&[msg], &counts).unwrap();
    let want = pipeline
        .generate_greedy(&ids, &embeds, max_tokens as usize, tok.eos_ids())
        .unwrap()
        .tokens;
    drop(pipeline);

    let c = Cluster::start(1, &[]).await;
    let got = generate(&c.grpc(), grpc_request(&images, prompt, max_tokens))
        .await
        .unwrap();
    assert_eq!(
        got.tokens, want,
        "gateway tokens differ from the in-process pipeline"
    );
    assert_eq!(got.usage.prompt_tokens as usize, ids.len());
    assert_eq!(
        got.usage.image_tokens as usize,
        counts.iter().sum::<usize>()
    );
    assert_eq!(got.usage.completion_tokens as usize, want.len());
    assert_eq!(got.text, tok.decode_skip_special(&want).unwrap());

    // HTTP, not streaming.
    let (status, body) = post_json(&c.http(), &http_body(&images, prompt, max_tokens, false));
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], got.text.as_str());
    assert_eq!(v["usage"]["completion_tokens"], want.len());
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());

    // HTTP, streaming with stream_options.include_usage: SSE chunks, then the usage as a
    // chunk of its own with "choices": [] (where OpenAI and vLLM put it), then [DONE].
    let mut body = http_body(&images, prompt, max_tokens, true);
    body["stream_options"] = serde_json::json!({"include_usage": true});
    let (status, body) = post_json(&c.http(), &body);
    assert_eq!(status, 200, "{body}");
    let chunks = sse_chunks(&body);
    let (last, content) = chunks.split_last().expect("chunks");
    for v in content {
        assert_eq!(v["object"], "chat.completion.chunk");
        assert!(v.get("usage").is_none(), "usage on a content chunk: {v}");
        assert_eq!(v["choices"].as_array().map(Vec::len), Some(1), "{v}");
    }
    assert_eq!(last["object"], "chat.completion.chunk");
    assert_eq!(last["choices"], serde_json::json!([]), "{last}");
    assert_eq!(sse_text(&chunks), got.text);
    assert_eq!(last["usage"]["completion_tokens"], want.len());
    assert_eq!(last["usage"]["prompt_tokens"], ids.len());

    // Without stream_options (OpenAI's default) and with include_usage: false: the same
    // text, no usage anywhere.
    for opts in [None, Some(serde_json::json!({"include_usage": false}))] {
        let mut body = http_body(&images, prompt, max_tokens, true);
        if let Some(o) = opts {
            body["stream_options"] = o;
        }
        let (status, body) = post_json(&c.http(), &body);
        assert_eq!(status, 200, "{body}");
        let chunks = sse_chunks(&body);
        for v in &chunks {
            assert!(
                v.get("usage").is_none(),
                "usage sent though not asked for: {v}"
            );
        }
        assert_eq!(sse_text(&chunks), got.text);
    }

    let (status, body) = http(&c.http(), "GET", "/v1/models", b"");
    assert_eq!(status, 200, "{body}");
    let listed: serde_json::Value = serde_json::from_str(&body).unwrap();
    let id = listed["data"][0]["id"].as_str().unwrap().to_string();
    // The SDK's models.retrieve: the served model, and OpenAI's 404 for any other.
    let (status, body) = http(&c.http(), "GET", &format!("/v1/models/{id}"), b"");
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap(),
        listed["data"][0]
    );
    let (status, body) = http(&c.http(), "GET", "/v1/models/not-this-one", b"");
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("model_not_found"), "{body}");
    let (status, body) = http(&c.http(), "GET", "/metrics", b"");
    assert_eq!(status, 200);
    for name in [
        "vlm_gateway_requests_total",
        "vlm_gateway_queue_depth",
        "vlm_gateway_in_flight",
        "vlm_gateway_time_to_first_token_seconds",
        "vlm_gateway_request_duration_seconds",
        "vlm_gateway_prompt_tokens_total",
        "vlm_gateway_completion_tokens_total",
    ] {
        assert!(body.contains(name), "/metrics lacks {name}");
    }
}

/// Every refusal is INVALID_ARGUMENT / HTTP 400 with a message naming the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_name_their_limit() {
    let _g = serial();
    let c = Cluster::start(1, &["--max-images", "2", "--max-body-bytes", "3000000"]).await;
    let small = png(64, 64, 3);
    let cases: Vec<(pb::GenerateRequest, &str)> = vec![
        (
            grpc_request(&[small.clone(), small.clone(), small.clone()], "x", 4),
            "limit of 2 images",
        ),
        (grpc_request(&[], "x", 5000), "context limit of 4096"),
        (grpc_request(&[png_flat(4096, 4096)], "x", 4), "16384"),
        (grpc_request(&[b"not an image".to_vec()], "x", 4), "image 0"),
        (grpc_request(&[vec![0u8; 3_100_000]], "x", 4), "3000000"),
    ];
    for (req, needle) in cases {
        let e = generate(&c.grpc(), req)
            .await
            .err()
            .unwrap_or_else(|| panic!("expected a refusal naming {needle}"));
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(
            e.message().contains(needle),
            "message {:?} lacks {needle:?}",
            e.message()
        );
    }
    let http_cases = vec![
        (
            http_body(
                &[small.clone(), small.clone(), small.clone()],
                "x",
                4,
                false,
            ),
            "limit of 2 images",
        ),
        (http_body(&[], "x", 5000, true), "context limit of 4096"),
        (http_body(&[vec![7u8; 2_400_000]], "x", 4, false), "3000000"),
    ];
    for (body, needle) in http_cases {
        let (status, text) = post_json(&c.http(), &body);
        assert_eq!(status, 400, "{text}");
        assert!(text.contains(needle), "{text} lacks {needle:?}");
    }
    let (status, text) = post_json(
        &c.http(),
        &serde_json::json!({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}),
    );
    assert_eq!(status, 400);
    assert!(text.contains("--allow-image-host"), "{text}");
    // The gateway still serves after every refusal.
    generate(&c.grpc(), grpc_request(&[], "still there?", 2))
        .await
        .unwrap();
}

/// Waits (at most 30 s) until the gateway's gauge `name` reads `value`.
async fn wait_for_gauge(http: &str, name: &str, value: f64) {
    let t = Instant::now();
    loop {
        let got = scrape(http).sum(name);
        if got == Some(value) {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{name} is {got:?}, not {value}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Beyond in-flight + queue: RESOURCE_EXHAUSTED / 429 at once, while admitted requests finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_refused_at_once_and_admitted_requests_complete() {
    let _g = serial();
    let c = Cluster::start(1, &["--max-in-flight", "1", "--max-queue", "1"]).await;
    let long = |n| {
        let mut r = grpc_request(&[], "count", n);
        r.sampling.as_mut().unwrap().ignore_eos = true;
        r
    };
    // One running, one queued. The LM is frozen (SIGSTOP) meanwhile, so the running one stays
    // in flight waiting for its first token however fast the model is (the tiny one decodes its
    // 4000 tokens in well under a second). The freeze is far shorter than the gateway's 2 s poll
    // timeout, so the LM stays in rotation.
    let lm = Frozen::new(c.lms[0].pid());
    let addr = c.grpc();
    let running = tokio::spawn(async move {
        let mut client = pb::gateway_client::GatewayClient::new(channel(&addr).await);
        let mut stream = client.generate(long(4000)).await?.into_inner();
        let (mut n, mut finish) = (0, 0);
        while let Some(m) = stream.message().await? {
            n += m.token_ids.len();
            finish = m.finish_reason;
        }
        Ok::<_, tonic::Status>((n, finish))
    });
    wait_for_gauge(&c.http(), "vlm_gateway_in_flight", 1.0).await;
    let addr = c.grpc();
    let queued = tokio::spawn(async move { generate(&addr, long(50)).await });
    wait_for_gauge(&c.http(), "vlm_gateway_queue_depth", 1.0).await;

    let t = Instant::now();
    let e = generate(&c.grpc(), long(10))
        .await
        .expect_err("over the queue: refused");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("--max-queue"), "{}", e.message());
    // Both say when to retry: RetryInfo on RESOURCE_EXHAUSTED, Retry-After on 429.
    use tonic_types::StatusExt;
    let wait = e.get_details_retry_info().and_then(|r| r.retry_delay);
    assert_eq!(wait, Some(Duration::from_secs(1)), "{e:?}");
    let mut b = http_body(&[], "count", 10, false);
    b["ignore_eos"] = true.into();
    let (status, head, text) = http_full(
        &c.http(),
        "POST",
        "/v1/chat/completions",
        b.to_string().as_bytes(),
        "",
    );
    assert_eq!(status, 429, "{text}");
    assert!(text.contains("queue"), "{text}");
    assert!(
        head.lines()
            .any(|l| l.eq_ignore_ascii_case("retry-after: 1")),
        "{head}"
    );
    assert!(t.elapsed() < Duration::from_secs(30));

    drop(lm); // the LM runs again: both admitted requests complete
    let (n, finish) = running.await.unwrap().unwrap();
    assert_eq!(n, 4000);
    assert_eq!(finish, pb::FinishReason::Length as i32);
    let q = queued.await.unwrap().unwrap();
    assert_eq!(q.tokens.len(), 50);
    let (_, metrics) = http(&c.http(), "GET", "/metrics", b"");
    assert!(
        metrics.contains("vlm_gateway_admission_refusals_total{reason=\"queue_full\"}"),
        "{metrics}"
    );
}

/// A client that goes away mid-stream frees the LM's KV blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_frees_lm_blocks() {
    let _g = serial();
    let c = Cluster::start(1, &[]).await;
    let lm_addr = c.lms[0].addr("grpc");
    let mut lm = pb::lm_client::LmClient::new(channel(&lm_addr).await);
    let idle = lm.load(pb::LoadRequest {}).await.unwrap().into_inner();
    assert_eq!(idle.free_kv_blocks, idle.total_kv_blocks);

    // The tiny model makes the 3000 tokens in well under a second: a request that finished
    // before the LM's load was read is tried again.
    let mut seen_busy = false;
    for _ in 0..5 {
        let mut req = grpc_request(&[png(128, 128, 4)], "go on forever", 3000);
        req.sampling.as_mut().unwrap().ignore_eos = true;
        let mut client = pb::gateway_client::GatewayClient::new(channel(&c.grpc()).await);
        let mut stream = client.generate(req).await.unwrap().into_inner();
        stream.message().await.unwrap().unwrap();
        stream.message().await.unwrap().unwrap();
        let busy = lm.load(pb::LoadRequest {}).await.unwrap().into_inner();
        if busy.running == 1 {
            assert!(busy.free_kv_blocks < busy.total_kv_blocks, "{busy:?}");
            seen_busy = true;
            // Dropping the stream and the client: the caller goes away.
            break;
        }
        while stream.message().await.unwrap().is_some() {}
    }
    assert!(seen_busy, "the 3000-token request was never seen running");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let l = lm.load(pb::LoadRequest {}).await.unwrap().into_inner();
        if l.free_kv_blocks == l.total_kv_blocks && l.running == 0 && l.waiting == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the LM still holds blocks after the client left: {l:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// With an API key configured, both APIs want it; /health does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_required_on_both_apis() {
    let _g = serial();
    let keys = Path::new(env!("CARGO_TARGET_TMPDIR")).join("e2e-api-keys");
    std::fs::write(&keys, "# keys\nsecret-1\n").unwrap();
    let c = Cluster::start(1, &["--api-key-file", keys.to_str().unwrap()]).await;

    let e = generate(&c.grpc(), grpc_request(&[], "hi", 2))
        .await
        .expect_err("no key: refused");
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    let mut client = pb::gateway_client::GatewayClient::new(channel(&c.grpc()).await);
    let mut req = tonic::Request::new(grpc_request(&[], "hi", 2));
    req.metadata_mut()
        .insert("authorization", "Bearer secret-1".parse().unwrap());
    let mut s = client.generate(req).await.unwrap().into_inner();
    while s.message().await.unwrap().is_some() {}

    let body = http_body(&[], "hi", 2, false).to_string();
    let (status, _) = http(&c.http(), "POST", "/v1/chat/completions", body.as_bytes());
    assert_eq!(status, 401);
    let (status, text) = http_with(
        &c.http(),
        "POST",
        "/v1/chat/completions",
        body.as_bytes(),
        "Authorization: Bearer secret-1\r\n",
    );
    assert_eq!(status, 200, "{text}");
    let (status, _) = http(&c.http(), "GET", "/health", b"");
    assert_eq!(status, 200);
}

/// SIGTERM to the gateway: a running stream still finishes, then the process exits cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_the_gateway() {
    let _g = serial();
    let mut c = Cluster::start(1, &[]).await;
    let mut req = grpc_request(&[], "drain me", 400);
    req.sampling.as_mut().unwrap().ignore_eos = true;
    let mut client = pb::gateway_client::GatewayClient::new(channel(&c.grpc()).await);
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let mut n = stream.message().await.unwrap().unwrap().token_ids.len();
    unsafe {
        libc::kill(c.gateway.child.id() as libc::pid_t, libc::SIGTERM);
    }
    let mut finish = 0;
    while let Some(m) = stream.message().await.unwrap() {
        n += m.token_ids.len();
        finish = m.finish_reason;
    }
    assert_eq!((n, finish), (400, pb::FinishReason::Length as i32));
    drop(stream);
    drop(client);
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = c.gateway.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the gateway did not exit after draining"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status}");
}

// ---------------------------------------------------------------- prefix-aware routing

/// `detail` and `mm_processor_kwargs` set an image's resolution end to end: the vision service
/// resizes to the grid the gateway planned (it refuses a mismatch), the image costs fewer
/// tokens at `low`, and the same bytes at two resolutions are two cache entries, not one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_detail_and_pixel_budgets_set_the_resolution() {
    let _g = serial();
    let c = Cluster::start(1, &[]).await;
    let img = png(1024, 768, 9);
    let ask = |detail: &str, extra: serde_json::Value| {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD.encode(&img);
        let mut b = serde_json::json!({
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{b64}"), "detail": detail}},
                {"type": "text", "text": "what is it?"}]}],
            "max_tokens": 2, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let (status, text) = post_json(&c.http(), &b);
        assert_eq!(status, 200, "{detail} {extra}: {text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let auto = ask("auto", serde_json::json!({}));
    let low = ask("low", serde_json::json!({}));
    let tiny = ask(
        "auto",
        serde_json::json!({"mm_processor_kwargs": {"max_pixels": 128 * 128}}),
    );
    let high = ask("high", serde_json::json!({}));
    assert!(low < auto, "low {low} vs auto {auto}");
    assert!(tiny < low, "max_pixels 128x128 {tiny} vs low {low}");
    assert!(high >= auto, "high {high} vs auto {auto}");
    // 1024x768 at low: 512*512 pixels at most -> 16x12 patches of 32 = 192 image tokens; the
    // text around it is the same in both, so the difference is the image's.
    assert_eq!(
        auto - low,
        (1024 * 768 - 576 * 416) / 1024,
        "auto {auto} low {low}"
    );
    // Asking again at each resolution hits the LM's embedding cache for that resolution.
    let hits = |c: &Cluster| {
        scrape(&c.lms[0].addr("metrics"))
            .sum("vlm_lm_embedding_cache_hits_total")
            .unwrap_or(0.0)
    };
    let before = hits(&c);
    assert_eq!(ask("low", serde_json::json!({})), low);
    assert_eq!(ask("auto", serde_json::json!({})), auto);
    assert_eq!(hits(&c) - before, 2.0);
}
