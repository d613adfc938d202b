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

/// A user message's content: each image as a `data:` URL, then the text.
fn user_parts(images: &[Vec<u8>], text: &str) -> Vec<serde_json::Value> {
    use base64::Engine;
    let mut parts: Vec<serde_json::Value> = images
        .iter()
        .map(|d| {
            let b64 = base64::engine::general_purpose::STANDARD.encode(d);
            serde_json::json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{b64}")}})
        })
        .collect();
    parts.push(serde_json::json!({"type": "text", "text": text}));
    parts
}

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

/// Two loops sending an LM replica long requests (4000 tokens each), one after the other, until
/// stopped: from the moment both have started, one of them is always running.
struct Background {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    loops: Vec<tokio::task::JoinHandle<usize>>,
}

impl Background {
    fn start(lm_addr: &str, tag: &str) -> Background {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let loops = (0..2)
            .map(|j| {
                let (addr, tag, stop) = (lm_addr.to_string(), tag.to_string(), stop.clone());
                tokio::spawn(async move {
                    let mut lm = pb::lm_client::LmClient::new(channel(&addr).await);
                    let mut sent = 0;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let mut s = lm
                            .generate(pb::LmGenerateRequest {
                                request_id: format!("{tag}-load-{j}-{sent}"),
                                input_ids: (100..164).collect(),
                                images: Vec::new(),
                                vision_replica: String::new(),
                                sampling: Some(pb::SamplingParams {
                                    max_tokens: 4000,
                                    temperature: 0.0,
                                    ignore_eos: true,
                                    ..Default::default()
                                }),
                            })
                            .await
                            .unwrap()
                            .into_inner();
                        while s.message().await.unwrap().is_some() {}
                        sent += 1;
                    }
                    sent
                })
            })
            .collect();
        Background { stop, loops }
    }

    /// Stops both loops once their current requests end; how many requests they sent.
    async fn stop(self) -> usize {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut sent = 0;
        for l in self.loops {
            sent += l.await.unwrap();
        }
        sent
    }
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

/// One of two LM replicas dies before the first token: the request is retried on the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_an_lm_replica_before_the_first_token_still_completes() {
    let _g = serial();
    // Polls far apart: the gateway learns of the death only from the failed call.
    let mut c = Cluster::start(2, &["--poll-ms", "600000"]).await;
    // With equal loads the first replica in the list is chosen (the prompt is under one KV
    // block, so it is routed by load, not by prefix): kill that one.
    c.lms[0].kill();
    let out = generate(
        &c.grpc(),
        grpc_request(&[png(64, 64, 9)], "still works?", 6),
    )
    .await
    .unwrap();
    assert_eq!(out.tokens.len(), out.usage.completion_tokens as usize);
    assert!(!out.tokens.is_empty());
    // And again, now that the dead replica is out of rotation.
    generate(&c.grpc(), grpc_request(&[], "again", 3))
        .await
        .unwrap();
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

/// The LM dies after the first token: the stream ends with UNAVAILABLE (no silent retry, since
/// text has already gone out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lm_dying_after_the_first_token_is_unavailable() {
    let _g = serial();
    let mut c = Cluster::start(1, &[]).await;
    let mut req = grpc_request(&[], "keep going", 3000);
    req.sampling.as_mut().unwrap().ignore_eos = true;
    let mut client = pb::gateway_client::GatewayClient::new(channel(&c.grpc()).await);
    let mut stream = client.generate(req).await.unwrap().into_inner();
    stream.message().await.unwrap().unwrap();
    // Stopped first, so that it cannot finish the 3000 tokens (well under a second for the
    // tiny model) between the first token and the kill.
    let _frozen = Frozen::new(c.lms[0].pid());
    c.lms[0].kill();
    let err = loop {
        match stream.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream ended cleanly although the LM died"),
            Err(e) => break e,
        }
    };
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(
        err.message().contains("after the first token"),
        "{}",
        err.message()
    );
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

/// An LM replica named through a DNS source (`dns:///localhost:PORT`) dies: requests fail while
/// it is down (no other replica), and once it is back on the same address the gateway's health
/// poll puts it back in rotation without a restart of the gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovered_lm_replica_is_put_back_in_rotation() {
    let _g = serial();
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let lm_args = || {
        let mut a = service_args(true);
        let i = a.iter().position(|x| x == "--listen").unwrap();
        a[i + 1] = format!("127.0.0.1:{port}");
        a
    };
    let vision = Proc::spawn("vision", &bin("vision-service"), &service_args(true));
    let mut lm = Proc::spawn("lm", &bin("lm-service"), &lm_args());
    wait_serving(&vision.addr("grpc")).await;
    wait_serving(&lm.addr("grpc")).await;
    let args: Vec<String> = [
        "--model",
        &tiny_model().display().to_string(),
        "--config",
        &config_file().display().to_string(),
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--vision",
        &vision.addr("grpc"),
        "--lm",
        &format!("dns:///localhost:{port}"),
        "--poll-ms",
        "100",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let gw = Proc::spawn("gateway", &bin("gateway"), &args);
    wait_serving(&gw.addr("grpc")).await;
    let addr = gw.addr("grpc");
    generate(&addr, grpc_request(&[], "before", 3))
        .await
        .expect("served through the DNS-named replica");

    lm.kill();
    let deadline = Instant::now() + Duration::from_secs(30);
    let err = loop {
        match generate(&addr, grpc_request(&[], "while down", 3)).await {
            Err(e) => break e,
            Ok(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Ok(_) => panic!("still served 30 s after the only LM replica was killed"),
        }
    };
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");

    let lm2 = Proc::spawn("lm-again", &bin("lm-service"), &lm_args());
    wait_serving(&lm2.addr("grpc")).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match generate(&addr, grpc_request(&[], "after", 3)).await {
            Ok(out) => {
                assert!(!out.tokens.is_empty());
                break;
            }
            Err(e) if Instant::now() < deadline => {
                assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the recovered replica was not put back within 30 s: {e:?}"),
        }
    }
}

// ---------------------------------------------------------------- prefix-aware routing

/// The harness's config with KV blocks of 32 tokens (a short conversation spans several) and
/// room for them.
fn prefix_config() -> String {
    let c = support::CONFIG
        .replace("kvcache_partition_len: 256", "kvcache_partition_len: 32")
        .replace("kvcache_num_blocks: 64", "kvcache_num_blocks: 1024");
    assert!(c.contains("partition_len: 32") && c.contains("num_blocks: 1024"));
    c + "prefix_caching: true\n"
}

/// Requests each LM replica has started (its time-to-first-token count).
fn lm_requests(lm_metrics: &[String]) -> Vec<f64> {
    lm_metrics
        .iter()
        .map(|a| {
            scrape(a)
                .sum("vlm_lm_time_to_first_token_seconds_count")
                .unwrap_or(0.0)
        })
        .collect()
}

/// The one replica whose count rose by exactly one from `before` to `after`.
fn served_by(before: &[f64], after: &[f64], what: &str) -> usize {
    let rose: Vec<usize> = (0..before.len())
        .filter(|&i| after[i] != before[i])
        .collect();
    assert_eq!(
        rose.len(),
        1,
        "{what}: expected exactly one LM replica to start a request, counts {before:?} -> {after:?}"
    );
    assert_eq!(
        after[rose[0]] - before[rose[0]],
        1.0,
        "{what}: {before:?} -> {after:?}"
    );
    rose[0]
}

/// POST /v1/chat/completions with `messages`, greedy: (answer, usage), streamed or not.
fn chat(addr: &str, messages: &serde_json::Value, stream: bool) -> (String, serde_json::Value) {
    let mut body = serde_json::json!({
        "messages": messages, "max_tokens": 8, "temperature": 0, "stream": stream
    });
    if stream {
        body["stream_options"] = serde_json::json!({"include_usage": true});
    }
    let (status, text) = post_json(addr, &body);
    assert_eq!(status, 200, "{text}");
    if !stream {
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let answer = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        return (answer, v["usage"].clone());
    }
    let chunks = sse_chunks(&text);
    let usage = chunks
        .iter()
        .rev()
        .find(|v| !v["usage"].is_null())
        .map(|v| v["usage"].clone())
        .unwrap_or_else(|| panic!("no usage chunk in the stream: {text}"));
    (sse_text(&chunks), usage)
}

/// Two LM replicas behind one gateway, KV blocks of 32 tokens. Turn 2 of a conversation (turn
/// 1's messages, the answer, a new question) goes to the LM replica that served turn 1, where
/// its prefix is cached, even while the other replica is less loaded (a request sent straight
/// to the first one holds KV blocks there, so routing by load alone would pick the other); and
/// turn 2 reports the prompt tokens read from that cache. Once with text only, once with an
/// image in the first block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_stays_on_the_lm_replica_holding_its_prefix() {
    let _g = serial();
    let config = write_config("e2e-prefix-routing.yaml", &prefix_config());
    // Fast polls: the gateway sees the other requests' blocks before turn 2.
    let c = Cluster::start_config(&config, 2, &["--poll-ms", "100"], &[]).await;
    let lm_metrics: Vec<String> = c.lms.iter().map(|l| l.addr("metrics")).collect();
    let routes = |route: &str| {
        scrape(&c.http())
            .samples
            .get("vlm_gateway_lm_routes_total")
            .and_then(|v| {
                v.iter()
                    .find(|(l, _)| l.contains(&format!("route=\"{route}\"")))
                    .map(|(_, x)| *x)
            })
            .unwrap_or(0.0)
    };
    let question = "Here is a long description of a quiet harbour town at dawn: fishing boats \
        rocking at their moorings, gulls circling over the market square, bakers opening their \
        shutters, a lighthouse keeper walking home along the pier, and fog lifting slowly from \
        the hills behind the church. Summarise it in one short sentence.";
    let mut cached_turn2 = Vec::new();
    for (variant, images, stream) in [
        ("text", Vec::new(), false),
        ("image", vec![png(64, 64, 5)], true),
    ] {
        let parts = user_parts(&images, &format!("({variant}) {question}"));
        let mut messages = serde_json::json!([
            {"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": parts},
        ]);

        let prefix_before = routes("prefix");
        let before = lm_requests(&lm_metrics);
        let (answer, usage1) = chat(&c.http(), &messages, stream);
        let p = served_by(
            &before,
            &lm_requests(&lm_metrics),
            &format!("{variant} turn 1"),
        );
        let prompt1 = usage1["prompt_tokens"].as_u64().unwrap();
        assert!(
            prompt1 >= 64,
            "{variant}: turn 1 is {prompt1} tokens, under two 32-token blocks"
        );

        // Load the replica that holds the prefix with long requests sent to it directly (not
        // through the gateway), holding KV blocks while turn 2 is routed. The tiny model
        // decodes 4000 tokens in well under a second, so two loops keep sending them until turn
        // 2 is done: one of them is always running.
        let mut lm = pb::lm_client::LmClient::new(channel(&c.lms[p].addr("grpc")).await);
        let load = Background::start(&c.lms[p].addr("grpc"), variant);
        while lm
            .load(pb::LoadRequest {})
            .await
            .unwrap()
            .into_inner()
            .running
            < 2
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let idle = pb::lm_client::LmClient::new(channel(&c.lms[1 - p].addr("grpc")).await)
            .load(pb::LoadRequest {})
            .await
            .unwrap()
            .into_inner();
        let busy = lm.load(pb::LoadRequest {}).await.unwrap().into_inner();
        assert!(
            busy.free_kv_blocks < idle.free_kv_blocks && busy.waiting == 0,
            "{variant}: by load the other replica should win: {busy:?} vs {idle:?}"
        );
        tokio::time::sleep(Duration::from_millis(400)).await; // a few polls

        messages
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({"role": "assistant", "content": answer}));
        messages
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({"role": "user", "content": "And what happens next?"}));
        let before = lm_requests(&lm_metrics);
        let (_, usage2) = chat(&c.http(), &messages, stream);
        let q = served_by(
            &before,
            &lm_requests(&lm_metrics),
            &format!("{variant} turn 2"),
        );
        // The long requests outlived turn 2: by load, replica `p` was the worse choice
        // throughout.
        let sent = load.stop().await;
        assert!(sent >= 2, "{variant}: {sent} long requests");
        assert_eq!(
            q, p,
            "{variant}: turn 2 went to LM replica {q}, turn 1 to {p} (its prefix is cached there)"
        );
        assert_eq!(
            routes("prefix") - prefix_before,
            2.0,
            "{variant}: both turns routed by prefix"
        );
        let prompt2 = usage2["prompt_tokens"].as_u64().unwrap();
        assert!(prompt2 > prompt1, "{variant}: {usage1} then {usage2}");
        let cached = usage2["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or_else(|| {
                panic!("{variant}: no prompt_tokens_details.cached_tokens in {usage2}")
            });
        cached_turn2.push((variant, cached, prompt1, prompt2));
    }
    // Needs the LM's prefix cache (issue 20): turn 2 reuses turn 1's full blocks. Checked after
    // both variants, so that a routing failure in either shows first.
    for (variant, cached, prompt1, prompt2) in cached_turn2 {
        assert!(
            cached > 0 && cached <= prompt2,
            "{variant}: turn 2 read {cached} of its {prompt2} prompt tokens from the LM's prefix \
             cache; expected some of turn 1's {prompt1}"
        );
    }
}

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
