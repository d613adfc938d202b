//! The LM service as a real process (and the real vision service where images are involved),
//! on the tiny golden checkpoint.
mod support;

use futures::future::join_all;
use serde_json::json;
use std::time::{Duration, Instant};
use support::*;
use vlm_proto::{FinishReason, ImageGrid, ImageInput, LmImage, LmInfoRequest, LoadRequest};

fn batching_config() -> serde_json::Value {
    json!({
        "max_seq_len": 512, "kvcache_partition_len": 32,
        "batch_size": 8, "decoder_batch_sizes": [1, 2, 4, 8], "prefill_chunk_size": 64
    })
}

/// Eight prompts of different lengths and budgets.
fn eight_requests() -> Vec<(Vec<u32>, u32)> {
    [
        (5, 30),
        (17, 12),
        (40, 25),
        (64, 40),
        (90, 8),
        (130, 33),
        (7, 45),
        (200, 20),
    ]
    .iter()
    .enumerate()
    .map(|(i, &(n, m))| (text_prompt(n, i as u32 + 1), m))
    .collect()
}

async fn alone_then_together(
    lm: &Proc,
    reqs: &[(Vec<u32>, u32)],
) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let mut client = lm_client(lm).await;
    let mut alone = Vec::new();
    for (ids, max) in reqs {
        let (t, f) = generate(&mut client, request(ids.clone(), vec![], "", greedy(*max)))
            .await
            .unwrap();
        assert_eq!(f, FinishReason::Length);
        assert_eq!(t.len(), *max as usize);
        alone.push(t);
    }
    let futs = reqs.iter().map(|(ids, max)| {
        let mut c = client.clone();
        let r = request(ids.clone(), vec![], "", greedy(*max));
        async move { generate(&mut c, r).await.unwrap().0 }
    });
    let together = join_all(futs).await;
    (alone, together)
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_requests_match_running_alone() {
    let lm = start_lm(&batching_config());
    let (alone, together) = alone_then_together(&lm, &eight_requests()).await;
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(
            a, t,
            "request {i}: batched output differs from running alone"
        );
    }
    // Larger graphs ran while the eight were in flight.
    assert!(
        lm.metric("vlm_lm_decode_steps_total{graph=\"8\"}")
            .unwrap_or(0.0)
            > 0.0,
        "{}",
        lm.metrics_text()
    );
    assert_eq!(lm.metric("vlm_lm_preemptions_total"), Some(0.0));
    // The short prompts' chunks were packed into shared steps (5 + 17 + 40 tokens fit 64).
    assert!(
        lm.metric("vlm_lm_packed_prefill_steps_total")
            .unwrap_or(0.0)
            > 0.0,
        "{}",
        lm.metrics_text()
    );
    let text = lm.metrics_text();
    for name in [
        "vlm_lm_time_to_first_token_seconds_count",
        "vlm_lm_time_per_output_token_seconds_count",
        "vlm_lm_running",
        "vlm_lm_waiting",
        "vlm_lm_kv_blocks_used",
        "vlm_lm_kv_blocks_free",
        "vlm_lm_decode_steps_total{graph=\"1\"}",
        "vlm_lm_embedding_cache_hits_total",
        "vlm_lm_embedding_cache_misses_total",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(&format!("{name} "))),
            "no {name} in\n{text}"
        );
    }
    let generated: f64 = together.iter().chain(&alone).map(|t| t.len() as f64).sum();
    assert_eq!(lm.metric("vlm_lm_generated_tokens_total"), Some(generated));
}

#[tokio::test(flavor = "multi_thread")]
async fn preemption_keeps_outputs_identical() {
    // 256-token pool (the minimum: one full-length sequence) for eight sequences of up to 245.
    let lm = start_lm(&json!({
        "max_seq_len": 256, "kvcache_partition_len": 16, "kvcache_num_blocks": 16,
        "batch_size": 8, "decoder_batch_sizes": [1, 2, 4, 8], "prefill_chunk_size": 64
    }));
    let reqs: Vec<(Vec<u32>, u32)> = eight_requests()
        .into_iter()
        .map(|(ids, m)| (ids[..ids.len().min(70)].to_vec(), m + 20))
        .collect();
    let (alone, together) = alone_then_together(&lm, &reqs).await;
    let preemptions = lm.metric("vlm_lm_preemptions_total").unwrap_or(0.0);
    assert!(preemptions > 0.0, "the pool was meant to force preemption");
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(
            a, t,
            "request {i}: output differs after {preemptions} preemptions"
        );
    }
    let mut client = lm_client(&lm).await;
    let load = client.load(LoadRequest {}).await.unwrap().into_inner();
    assert_eq!(
        (
            load.running,
            load.waiting,
            load.free_kv_blocks,
            load.total_kv_blocks
        ),
        (0, 0, 16, 16)
    );
}

async fn wait_idle(
    client: &mut vlm_proto::lm_client::LmClient<tonic::transport::Channel>,
) -> vlm_proto::LoadReport {
    let t0 = Instant::now();
    loop {
        let l = client.load(LoadRequest {}).await.unwrap().into_inner();
        if l.running == 0 && l.waiting == 0 && l.free_kv_blocks == l.total_kv_blocks {
            return l;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "blocks never came back: {l:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn cancelled_stream_and_deadline_free_their_blocks() {
    // A context of 4096 so that a request runs long enough to be seen running: the tiny
    // model made all 480 tokens of a request inside a 30 ms deadline on a fast machine.
    let lm = start_lm(&json!({
        "max_seq_len": 4096, "kvcache_partition_len": 32,
        "batch_size": 8, "decoder_batch_sizes": [1, 2, 4, 8], "prefill_chunk_size": 64
    }));
    let mut client = lm_client(&lm).await;
    // Caller goes away after two events. A slow reader gets the tokens merged into few
    // messages: when a loaded machine let it finish before the load was read, it is tried
    // again.
    let (stream, busy) = 'caught: {
        for _ in 0..5 {
            let mut stream = client
                .generate(request(text_prompt(100, 9), vec![], "", greedy(3900)))
                .await
                .unwrap()
                .into_inner();
            for _ in 0..2 {
                stream.message().await.unwrap().unwrap();
            }
            let busy = client.load(LoadRequest {}).await.unwrap().into_inner();
            if busy.running == 1 {
                break 'caught (stream, busy);
            }
            wait_idle(&mut client).await;
        }
        panic!("the 3900-token request was never seen running");
    };
    assert!(busy.free_kv_blocks < busy.total_kv_blocks);
    assert!(busy.tokens_in_flight > 100);
    drop(stream);
    let idle = wait_idle(&mut client).await;
    assert_eq!(idle.tokens_in_flight, 0);

    // A deadline (grpc-timeout) that passes mid-stream: the engine drops the sequence at its
    // next step, frees its blocks and ends the stream with CANCELLED. A fast machine makes the
    // 3900 tokens inside 30 ms, so a request that finished first is tried with a shorter one.
    let mut cancelled = None;
    for ms in [30, 10, 3, 1] {
        let mut req = tonic::Request::new(request(text_prompt(30, 10), vec![], "", greedy(3900)));
        req.set_timeout(Duration::from_millis(ms));
        let mut s = client.generate(req).await.unwrap().into_inner();
        let mut tokens = 0;
        let mut finish = 0;
        while let Some(ev) = s.message().await.unwrap() {
            tokens += ev.token_ids.len();
            finish = ev.finish_reason;
        }
        if finish == FinishReason::Cancelled as i32 {
            cancelled = Some(tokens);
            break;
        }
        assert_eq!(
            (finish, tokens),
            (FinishReason::Length as i32, 3900),
            "a {ms} ms deadline neither cancelled nor let the request finish"
        );
        wait_idle(&mut client).await;
    }
    let tokens = cancelled.expect("no deadline down to 1 ms passed before 3900 tokens");
    assert!(tokens < 3900);
    wait_idle(&mut client).await;
    // Still serving.
    let (t, _) = generate(
        &mut client,
        request(text_prompt(10, 1), vec![], "", greedy(3)),
    )
    .await
    .unwrap();
    assert_eq!(t.len(), 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_requests_get_clear_statuses_and_the_service_keeps_serving() {
    // Its one vision replica has nothing listening.
    let lm = start_lm_for(&batching_config(), "127.0.0.1:1");
    let mut client = lm_client(&lm).await;
    let info = client.info(LmInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.max_seq_len, 512);
    assert_eq!(info.decoder_batch_sizes, vec![1, 2, 4, 8]);
    assert_eq!(
        info.kvcache_num_blocks,
        8 * 512 / 32,
        "automatic on this machine: capped at batch_size full-length sequences"
    );
    assert_eq!(info.vocab_size, 1000);
    assert_eq!(info.image_token_id, 993);
    assert!(info.prefix_caching, "on by default");
    // The compute backend as it reported itself at load, with its kernel choices.
    let backend = info.backend.expect("Lm.Info names its backend");
    assert_eq!(backend.backend, "cpu");
    let kernels: Vec<(&str, &str)> = backend
        .kernels
        .iter()
        .map(|k| (k.name.as_str(), k.value.as_str()))
        .collect();
    assert!(kernels.contains(&("kv_cache", "f32")), "{kernels:?}");
    assert!(kernels.iter().any(|(k, _)| *k == "gemv"), "{kernels:?}");

    let e = generate(
        &mut client,
        request(text_prompt(600, 1), vec![], "", greedy(4)),
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(
        e.message().contains("max_seq_len is 512") && e.message().contains("600"),
        "{}",
        e.message()
    );

    let e = generate(&mut client, request(vec![5, 1000], vec![], "", greedy(4)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("vocabulary"), "{}", e.message());

    // An image whose grid does not match the placeholders.
    let mut ids = vec![5, 990];
    ids.extend(std::iter::repeat_n(993, 10));
    ids.extend([991, 7]);
    let img = LmImage {
        content_hash: vec![1; 32],
        grid: Some(ImageGrid { t: 1, h: 4, w: 4 }),
        input: None,
        video: false,
    };
    let e = generate(
        &mut client,
        request(ids.clone(), vec![img], "http://127.0.0.1:1", greedy(4)),
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("image"), "{}", e.message());

    // A cache miss on an unreachable vision endpoint: UNAVAILABLE naming it.
    let img = LmImage {
        content_hash: vec![2; 32],
        grid: Some(ImageGrid { t: 1, h: 4, w: 10 }), // 10 tokens
        input: Some(ImageInput {
            source: None,
            content_hash: vec![],
            expected_grid: None,
            ..Default::default()
        }),
        video: false,
    };
    let e = generate(
        &mut client,
        request(
            ids.clone(),
            vec![img.clone()],
            "http://127.0.0.1:1",
            greedy(4),
        ),
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    assert!(e.message().contains("127.0.0.1:1"), "{}", e.message());

    // A replica outside the LM's --vision: refused, never dialled (a listener here sees no
    // connection).
    let outsider = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    outsider.set_nonblocking(true).unwrap();
    let addr = outsider.local_addr().unwrap().to_string();
    let e = generate(
        &mut client,
        request(ids.clone(), vec![img.clone()], &addr, greedy(4)),
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("--vision"), "{}", e.message());
    assert!(
        outsider.accept().is_err(),
        "the LM dialled a caller-named address"
    );

    let (t, f) = generate(
        &mut client,
        request(text_prompt(20, 3), vec![], "", greedy(5)),
    )
    .await
    .unwrap();
    assert_eq!((t.len(), f), (5, FinishReason::Length));
    // max_tokens 0, or over the context, = the rest of the context.
    let (t, f) = generate(
        &mut client,
        request(text_prompt(500, 3), vec![], "", greedy(0)),
    )
    .await
    .unwrap();
    assert_eq!((t.len(), f), (12, FinishReason::Length));
    let (t, f) = generate(
        &mut client,
        request(text_prompt(505, 3), vec![], "", greedy(100_000)),
    )
    .await
    .unwrap();
    assert_eq!((t.len(), f), (7, FinishReason::Length));
}

#[tokio::test(flavor = "multi_thread")]
async fn sampling_is_reproducible_with_a_seed() {
    let lm = start_lm(&batching_config());
    let mut client = lm_client(&lm).await;
    let sampling = |seed| vlm_proto::SamplingParams {
        max_tokens: 20,
        // The tiny random model's logits are very peaked: a high temperature makes draws vary.
        temperature: 50.0,
        top_p: 0.95,
        top_k: 200,
        seed: Some(seed),
        ignore_eos: true,
        ..Default::default()
    };
    let ids = text_prompt(30, 4);
    let a = generate(&mut client, request(ids.clone(), vec![], "", sampling(7)))
        .await
        .unwrap()
        .0;
    let b = generate(&mut client, request(ids.clone(), vec![], "", sampling(7)))
        .await
        .unwrap()
        .0;
    assert_eq!(a, b);
    let mut others = Vec::new();
    for seed in 8..12 {
        others.push(
            generate(
                &mut client,
                request(ids.clone(), vec![], "", sampling(seed)),
            )
            .await
            .unwrap()
            .0,
        );
    }
    assert!(others.iter().any(|o| *o != a), "other seeds all gave {a:?}");
    // A stop token id ends the stream with STOP, the token included.
    let greedy_out = generate(&mut client, request(ids.clone(), vec![], "", greedy(10)))
        .await
        .unwrap()
        .0;
    let stop = greedy_out[3];
    let first = greedy_out.iter().position(|&t| t == stop).unwrap();
    let mut s = greedy(10);
    s.stop_token_ids = vec![stop];
    let (t, f) = generate(&mut client, request(ids, vec![], "", s))
        .await
        .unwrap();
    assert_eq!(f, FinishReason::Stop);
    assert_eq!(t, greedy_out[..=first]);
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_drains_running_streams_then_exits() {
    // A long stream (the tiny model decodes a token in ~0.1 ms): it must still be running when
    // the drain is observed.
    let mut lm = start_lm(&json!({
        "max_seq_len": 4096, "kvcache_partition_len": 256,
        "batch_size": 8, "decoder_batch_sizes": [1, 2, 4, 8], "prefill_chunk_size": 64
    }));
    let mut client = lm_client(&lm).await;
    let mut stream = client
        .generate(request(text_prompt(50, 2), vec![], "", greedy(4000)))
        .await
        .unwrap()
        .into_inner();
    let mut got = stream.message().await.unwrap().unwrap().token_ids.len();
    let status = std::process::Command::new("kill")
        .args(["-TERM", &lm.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    // Draining: reported in Load, new work refused, the running stream completes.
    let t0 = Instant::now();
    loop {
        let l = client.load(LoadRequest {}).await.unwrap().into_inner();
        if l.draining {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "never reported draining"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let e = generate(
        &mut client,
        request(text_prompt(5, 2), vec![], "", greedy(2)),
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    assert!(e.message().contains("draining"), "{}", e.message());
    let mut finish = 0;
    while let Some(ev) = stream.message().await.unwrap() {
        got += ev.token_ids.len();
        finish = ev.finish_reason;
    }
    assert_eq!((got, finish), (4000, FinishReason::Length as i32));
    let t0 = Instant::now();
    let code = loop {
        if let Some(st) = lm.child.try_wait().unwrap() {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "did not exit after draining"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(code.success(), "{code:?}");
}

#[test]
fn dry_run_prints_what_it_would_hold_and_exits() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("deploy.json");
    std::fs::write(
        &cfg,
        r#"{"create_runtimes": false, "max_seq_len": 512, "kvcache_partition_len": 32, "batch_size": 2}"#,
    )
    .unwrap();
    let out = std::process::Command::new(lm_bin())
        .args([
            "--model",
            tiny_dir().to_str().unwrap(),
            "--config",
            cfg.to_str().unwrap(),
        ])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("dry run") && text.contains("32 blocks x 32 tokens"),
        "{text}"
    );
}
