//! The real `vision-service` binary on a tiny random checkpoint, over a real socket: exact
//! embeddings per bucket, every refusal followed by a successful call, cancellation, overload,
//! Info, metrics, SIGTERM drain, dry run.
mod support;

use std::time::{Duration, Instant};
use support::*;
use tonic::Code;
use vlm_compute::HostDtype as DType;
use vlm_proto::v1 as pb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_exactly_what_the_model_computes_in_every_bucket() {
    let server = TestServer::start(SMALL_BUCKETS, &["--max-chunk-bytes", "65536"]).await;
    let oracle = Oracle::new(&[256, 1024, 4096]);
    let mut client = server.client().await;
    // 256x256 -> 256 patches, 512x512 -> 1024, 1024x1024 -> 4096: one image per bucket.
    let images = [(256, 256, 256u32), (512, 512, 1024), (1024, 1024, 4096)];
    let pngs: Vec<Vec<u8>> = images.iter().map(|&(w, h, _)| png(w, h, w)).collect();
    let mut req = request(pngs.iter().cloned().map(encoded).collect());
    for (i, img) in req.images.iter_mut().enumerate() {
        img.content_hash = vec![i as u8; 4];
    }
    let chunks = collect(&mut client, req).await.expect("encode");
    for c in &chunks {
        let bytes = c.embeds.len() + c.deepstack.iter().map(Vec::len).sum::<usize>();
        assert!(
            bytes <= 65536,
            "chunk of {bytes} raw bytes over --max-chunk-bytes"
        );
    }
    for (i, (&(w, h, bucket), bytes)) in images.iter().zip(&pngs).enumerate() {
        let got = reassemble(&chunks, i as u32);
        let (want_bucket, grid, embeds, deepstack) = oracle.encode_bytes(bytes, DType::F32);
        assert_eq!(got.bucket, bucket, "image {i} ({w}x{h})");
        assert_eq!(want_bucket as u32, bucket);
        assert_eq!(got.grid, [grid[0] as u32, grid[1] as u32, grid[2] as u32]);
        assert_eq!(got.total_rows as usize, grid[1] * grid[2] / 4);
        assert_eq!((got.hidden, got.dtype), (64, pb::DType::DtypeF32 as i32));
        assert_eq!(got.content_hash, vec![i as u8; 4]);
        assert_eq!(got.deepstack.len(), 2, "tiny preset has 2 deepstack levels");
        assert!(
            got.embeds == embeds,
            "image {i}: merged embeddings differ from the in-process model"
        );
        assert!(
            got.deepstack == deepstack,
            "image {i}: deepstack features differ from the in-process model"
        );
        if bucket == 4096 {
            assert!(
                got.chunks > 1,
                "a 4096-patch image streams in several 64 KiB chunks"
            );
        }
    }

    // The same picture as already-resized pixels gives the same rows; f16 on the wire on request.
    let img = picture(512, 512, 512);
    let pixels = pb::ImageInput {
        source: Some(pb::image_input::Source::Pixels(pb::ResizedPixels {
            width: 512,
            height: 512,
            rgb8: img.clone().into_raw(),
            ..Default::default()
        })),
        content_hash: vec![],
        expected_grid: Some(pb::ImageGrid { t: 1, h: 32, w: 32 }),
        ..Default::default()
    };
    let chunks = collect(&mut client, request(vec![pixels]))
        .await
        .expect("pixels");
    let got = reassemble(&chunks, 0);
    assert_eq!((got.bucket, got.grid), (1024, [1, 32, 32]));
    assert!(
        got.embeds == oracle.encode_bytes(&pngs[1], DType::F32).2,
        "resized pixels and PNG differ"
    );

    let mut req = request(vec![encoded(pngs[0].clone())]);
    req.dtype = pb::DType::DtypeF16 as i32;
    let got = reassemble(&collect(&mut client, req).await.expect("f16"), 0);
    let (_, _, embeds, deepstack) = oracle.encode_bytes(&pngs[0], DType::F16);
    assert_eq!(got.dtype, pb::DType::DtypeF16 as i32);
    assert!(
        got.embeds == embeds && got.deepstack == deepstack,
        "f16 wire bytes differ"
    );
}

/// True (and says the test is skipped) when this process may use fewer than 2 cores.
fn fewer_than_two_cores() -> bool {
    let few = vlm_service_kit::affinity::allowed_cores().len() < 2;
    if few {
        vlm_test_support::skip!("this machine lets the process use fewer than 2 cores");
    }
    few
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_of_two_devices_streams_the_same_rows() {
    if fewer_than_two_cores() {
        return;
    }
    let server = TestServer::start(SMALL_BUCKETS, &["--device", "0,1"]).await;
    assert_eq!(server.info().await.device, vec![0, 1]);
    let oracle = Oracle::new(&[256, 1024, 4096]);
    let pngs: Vec<Vec<u8>> = [(512, 512), (256, 256), (512, 256), (256, 512)]
        .iter()
        .map(|&(w, h)| png(w, h, w + h))
        .collect();
    let mut client = server.client().await;
    let chunks = collect(
        &mut client,
        request(pngs.iter().cloned().map(encoded).collect()),
    )
    .await
    .expect("encode");
    for (i, bytes) in pngs.iter().enumerate() {
        let got = reassemble(&chunks, i as u32);
        let (bucket, _, embeds, deepstack) = oracle.encode_bytes(bytes, DType::F32);
        assert_eq!(got.bucket as usize, bucket);
        assert!(
            got.embeds == embeds && got.deepstack == deepstack,
            "image {i} differs on a two-device pool"
        );
    }
    // The same images one request at a time: each is alone in the pool, runs on both cores,
    // and streams the same rows.
    assert!(server.info().await.spread_lone_images);
    let spread_before = spread_images(&server);
    for (i, bytes) in pngs.iter().enumerate() {
        let chunks = collect(&mut client, request(vec![encoded(bytes.clone())]))
            .await
            .expect("encode");
        let got = reassemble(&chunks, 0);
        let (_, _, embeds, deepstack) = oracle.encode_bytes(bytes, DType::F32);
        assert!(
            got.embeds == embeds && got.deepstack == deepstack,
            "image {i} differs when spread over the pool"
        );
    }
    assert_eq!(
        spread_images(&server) - spread_before,
        pngs.len() as f64,
        "every lone image ran on the whole pool"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_spreading_off_a_lone_image_stays_on_one_device() {
    if fewer_than_two_cores() {
        return;
    }
    let server = TestServer::start(
        SMALL_BUCKETS,
        &["--device", "0,1", "--spread-lone-images", "false"],
    )
    .await;
    assert!(!server.info().await.spread_lone_images);
    let mut client = server.client().await;
    collect(&mut client, request(vec![encoded(png(256, 256, 7))]))
        .await
        .expect("encode");
    assert_eq!(spread_images(&server), 0.0);
}

/// `vlm_vision_spread_images_total` (0 before the first).
fn spread_images(server: &TestServer) -> f64 {
    server
        .metrics_text()
        .lines()
        .find_map(|l| l.strip_prefix("vlm_vision_spread_images_total "))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// `code`, and a message containing every one of `words`.
fn assert_refused(
    result: Result<Vec<pb::EmbeddingChunk>, tonic::Status>,
    code: Code,
    words: &[&str],
) {
    let status = result.expect_err("the call should be refused");
    assert_eq!(status.code(), code, "{status:?}");
    for w in words {
        assert!(
            status.message().contains(w),
            "{:?} does not mention {w:?}",
            status.message()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_image_is_invalid_argument_and_the_service_keeps_serving() {
    let server = TestServer::start(SMALL_BUCKETS, &["--max-decode-pixels", "16777216"]).await;
    let mut client = server.client().await;
    let good = || encoded(png(256, 256, 7));
    let still_serves = |chunks: Result<Vec<pb::EmbeddingChunk>, tonic::Status>| {
        let chunks = chunks.expect("a good image after a bad one");
        assert_eq!(reassemble(&chunks, 0).bucket, 256);
    };

    // Corrupt: a valid PNG header over truncated data (fails in the decoder, mid-stream).
    let mut corrupt = png(64, 64, 3);
    corrupt.truncate(corrupt.len() / 2);
    let r = collect(&mut client, request(vec![good(), encoded(corrupt)])).await;
    assert_refused(r, Code::InvalidArgument, &["image 1", "corrupt"]);
    still_serves(collect(&mut client, request(vec![good()])).await);

    // Garbage bytes, and a format this build does not decode (QOI).
    let r = collect(
        &mut client,
        request(vec![encoded(b"definitely not an image".to_vec())]),
    )
    .await;
    assert_refused(
        r,
        Code::InvalidArgument,
        &["image 0", "PNG, JPEG, WebP, GIF"],
    );
    still_serves(collect(&mut client, request(vec![good()])).await);
    let mut qoi = b"qoif".to_vec();
    qoi.extend_from_slice(&[0u8; 64]);
    let r = collect(&mut client, request(vec![good(), encoded(qoi)])).await;
    assert_refused(r, Code::InvalidArgument, &["image 1", "unsupported"]);
    let mut declared = good();
    if let Some(pb::image_input::Source::Encoded(e)) = &mut declared.source {
        e.mime_type = "image/heic".into();
    }
    let r = collect(&mut client, request(vec![declared])).await;
    assert_refused(r, Code::InvalidArgument, &["image 0", "image/heic"]);
    still_serves(collect(&mut client, request(vec![good()])).await);

    // A decompression bomb: the header claims 100000 x 100000 pixels.
    let r = collect(
        &mut client,
        request(vec![encoded(png_claiming(100_000, 100_000))]),
    )
    .await;
    assert_refused(
        r,
        Code::InvalidArgument,
        &["image 0", "100000x100000", "10000000000 pixels", "16777216"],
    );
    still_serves(collect(&mut client, request(vec![good()])).await);

    // Over the largest bucket under `oversize: reject`: 2048x2048 = 16384 patches > 4096.
    let r = collect(
        &mut client,
        request(vec![good(), encoded(png(2048, 2048, 1))]),
    )
    .await;
    assert_refused(
        r,
        Code::InvalidArgument,
        &["image 1", "16384 patches", "4096"],
    );
    still_serves(collect(&mut client, request(vec![good()])).await);

    // A caller whose expected grid is not what the image resizes to.
    let mut wrong = good();
    wrong.expected_grid = Some(pb::ImageGrid { t: 1, h: 8, w: 8 });
    let r = collect(&mut client, request(vec![wrong])).await;
    assert_refused(
        r,
        Code::InvalidArgument,
        &["image 0", "expected grid", "[1, 16, 16]"],
    );
    still_serves(collect(&mut client, request(vec![good()])).await);

    let info = server.info().await;
    assert_eq!(
        (info.queue_depth, info.images_in_flight),
        (0, 0),
        "refusals leak no queue slot"
    );
}

/// A server with one queue slot and small chunks, so an unread stream holds its slot.
async fn one_slot_server() -> TestServer {
    TestServer::start(
        SMALL_BUCKETS,
        &["--queue-capacity", "1", "--max-chunk-bytes", "4096"],
    )
    .await
}

async fn wait_idle(server: &TestServer) -> pb::VisionInfo {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let info = server.info().await;
        if info.queue_depth == 0 && info.images_in_flight == 0 {
            return info;
        }
        assert!(Instant::now() < deadline, "queue never drained: {info:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_stream_mid_way_frees_the_queue_slot() {
    let server = one_slot_server().await;
    let mut client = server.client().await;
    let big = png(1024, 1024, 5);
    let mut stream = client
        .encode(request(vec![encoded(big.clone())]))
        .await
        .expect("encode")
        .into_inner();
    let first = stream
        .message()
        .await
        .expect("first chunk")
        .expect("a chunk");
    assert_eq!((first.row_start, first.total_rows), (0, 1024));
    drop(stream); // the caller goes away mid-stream (1024 rows in 4 KiB chunks: far from done)

    wait_idle(&server).await;
    let chunks = collect(&mut client, request(vec![encoded(big)]))
        .await
        .expect("capacity 1: the slot is free again");
    assert_eq!(reassemble(&chunks, 0).total_rows, 1024);

    // Cancelling a multi-image request before its images ran frees every slot too.
    let server2 = TestServer::start(
        SMALL_BUCKETS,
        &["--queue-capacity", "3", "--max-chunk-bytes", "4096"],
    )
    .await;
    let mut client2 = server2.client().await;
    let three = request(vec![
        encoded(png(1024, 1024, 1)),
        encoded(png(1024, 1024, 2)),
        encoded(png(1024, 1024, 3)),
    ]);
    let stream = client2.encode(three).await.expect("encode").into_inner();
    drop(stream);
    let info = wait_idle(&server2).await;
    assert_eq!(info.queue_capacity, 3);
}

/// Images that find every slot taken wait their turn (a request larger than the capacity too);
/// past the wait line's length a request is RESOURCE_EXHAUSTED naming the limit, and a request
/// that waits past `--max-queue-wait-ms` is RESOURCE_EXHAUSTED naming that one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_makes_requests_wait_in_a_bounded_line() {
    let server = TestServer::start(
        SMALL_BUCKETS,
        &[
            "--queue-capacity",
            "1",
            "--max-chunk-bytes",
            "4096",
            "--max-waiting-images",
            "2",
        ],
    )
    .await;
    let mut client = server.client().await;
    let big = png(1024, 1024, 9);
    // Not read: its 4 KiB chunks fill the transport window and the image keeps its slot.
    let mut held = client
        .encode(request(vec![encoded(big.clone())]))
        .await
        .expect("first call")
        .into_inner();
    assert_eq!(server.info().await.queue_depth, 1);

    // Two images, more than the capacity of 1: they wait, taking the whole line.
    let two = request(vec![encoded(png(256, 256, 1)), encoded(png(256, 256, 2))]);
    let mut second = server.client().await;
    let waiting = tokio::spawn(async move { collect(&mut second, two).await });
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.info().await.images_waiting != 2 {
        assert!(Instant::now() < deadline, "{:?}", server.info().await);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let info = server.info().await;
    assert_eq!((info.max_waiting_images, info.queue_depth), (2, 1));
    let mut other = server.client().await;
    let r = collect(&mut other, request(vec![encoded(png(256, 256, 3))])).await;
    assert_refused(
        r,
        Code::ResourceExhausted,
        &[
            "1 image(s) requested",
            "2 already waiting",
            "--max-waiting-images",
        ],
    );

    let mut rows = 0;
    while let Some(c) = held.message().await.expect("held stream") {
        rows += c.row_end - c.row_start;
    }
    assert_eq!(rows, 1024);
    let chunks = waiting
        .await
        .unwrap()
        .expect("the waiting request is served");
    assert_eq!(reassemble(&chunks, 0).bucket, 256);
    assert_eq!(reassemble(&chunks, 1).bucket, 256);
    let info = wait_idle(&server).await;
    assert_eq!(info.images_waiting, 0);

    // A queue-wait limit of 50 ms: a request behind a held slot gives up with the limit named.
    let server = TestServer::start(
        SMALL_BUCKETS,
        &[
            "--queue-capacity",
            "1",
            "--max-chunk-bytes",
            "4096",
            "--max-queue-wait-ms",
            "50",
        ],
    )
    .await;
    let mut client = server.client().await;
    let _held = client
        .encode(request(vec![encoded(big)]))
        .await
        .expect("first call")
        .into_inner();
    let mut other = server.client().await;
    let r = collect(&mut other, request(vec![encoded(png(256, 256, 4))])).await;
    assert_refused(
        r,
        Code::ResourceExhausted,
        &["--max-queue-wait-ms", "50 ms"],
    );
    assert_eq!(server.info().await.images_waiting, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passed_deadline_stops_the_work_and_frees_the_slot() {
    let server = one_slot_server().await;
    let mut client = server.client().await;
    let mut req = tonic::Request::new(request(vec![encoded(png(1024, 1024, 4))]));
    req.set_timeout(Duration::from_millis(1));
    let r = async {
        let mut s = client.encode(req).await?.into_inner();
        while s.message().await?.is_some() {}
        Ok::<_, tonic::Status>(())
    }
    .await;
    let status = r.expect_err("a 1 ms deadline passes");
    assert!(
        matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{status:?}"
    );
    wait_idle(&server).await;
    let chunks = collect(&mut client, request(vec![encoded(png(256, 256, 4))]))
        .await
        .expect("still serving");
    assert_eq!(reassemble(&chunks, 0).bucket, 256);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_health_and_metrics_describe_the_replica() {
    let server =
        TestServer::start(SMALL_BUCKETS, &["--queue-capacity", "5", "--device", "0"]).await;
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    assert_eq!(server.health("").await, Some(serving));
    assert_eq!(server.health("vlm.v1.Vision").await, Some(serving));

    let info = server.info().await;
    assert_eq!(info.buckets, vec![256, 1024, 4096]);
    assert_eq!(
        (
            info.patch_size,
            info.spatial_merge_size,
            info.temporal_patch_size
        ),
        (16, 2, 2)
    );
    assert_eq!((info.out_hidden_size, info.deepstack_levels), (64, 2));
    assert_eq!(info.dtype, pb::DType::DtypeF32 as i32);
    assert_eq!(info.device, vec![0]);
    assert_eq!((info.min_pixels, info.max_pixels), (65_536, 16_777_216));
    assert_eq!(info.oversize, "reject");
    assert_eq!(
        (info.queue_capacity, info.queue_depth, info.images_in_flight),
        (5, 0, 0)
    );
    assert!(!info.model_id.is_empty());
    // The compute backend as it reported itself at load: the CPU engine for f32 on core 0, and
    // its kernel choices.
    let backend = info.backend.expect("Vision.Info names its backend");
    assert_eq!(backend.backend, "cpu");
    assert_eq!(backend.device, "cpu core 0");
    let kernels: Vec<&str> = backend.kernels.iter().map(|k| k.name.as_str()).collect();
    assert!(
        kernels.contains(&"bf16_products") && kernels.contains(&"vit_attention_tiles"),
        "{kernels:?}"
    );

    let mut client = server.client().await;
    collect(&mut client, request(vec![encoded(png(256, 256, 2))]))
        .await
        .expect("encode");
    let _ = collect(&mut client, request(vec![encoded(b"junk".to_vec())])).await;
    let text = server.metrics_text();
    for name in [
        "vlm_vision_encode_seconds_bucket{bucket=\"256\"",
        "vlm_vision_images_total{bucket=\"256\",kind=\"image\"}",
        "vlm_vision_padding_fraction",
        "vlm_vision_queue_depth",
        "vlm_vision_images_in_flight",
        "vlm_vision_requests_total{status=\"ok\"}",
        "vlm_vision_requests_total{status=\"invalid\"}",
    ] {
        assert!(text.contains(name), "metrics lack {name}:\n{text}");
    }
    // Reflection is served.
    let mut refl = tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient::new(
        server.channel().await,
    );
    let req = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            tonic_reflection::pb::v1::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            ),
        ),
    };
    let mut stream = refl
        .server_reflection_info(futures::stream::iter(vec![req]))
        .await
        .expect("reflection")
        .into_inner();
    let reply = format!("{:?}", stream.message().await.expect("reply"));
    assert!(reply.contains("vlm.v1.Vision"), "{reply}");
    // Only what this server serves: the other vlm services are not listed.
    assert!(reply.contains("grpc.health.v1.Health"), "{reply}");
    assert!(
        !reply.contains("vlm.v1.Lm") && !reply.contains("vlm.v1.Gateway"),
        "{reply}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_downscale_fits_the_largest_bucket() {
    let server = TestServer::start(
        r#"{"visual": {"max_seq_len": [256, 1024], "oversize": "downscale"}}"#,
        &[],
    )
    .await;
    let mut client = server.client().await;
    let chunks = collect(&mut client, request(vec![encoded(png(1024, 768, 3))]))
        .await
        .expect("downscaled");
    let got = reassemble(&chunks, 0);
    assert_eq!(got.bucket, 1024);
    assert!(got.grid[1] * got.grid[2] <= 1024, "{:?}", got.grid);
    assert!(
        got.grid[2] > got.grid[1],
        "keeps the aspect ratio: {:?}",
        got.grid
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_work_then_exits_cleanly() {
    let mut server = TestServer::start(
        SMALL_BUCKETS,
        &["--max-chunk-bytes", "65536", "--drain-delay-ms", "3000"],
    )
    .await;
    let mut client = server.client().await;
    let mut stream = client
        .encode(request(vec![encoded(png(1024, 1024, 8))]))
        .await
        .expect("encode")
        .into_inner();
    server.terminate();
    // NOT_SERVING first (while the drain delay keeps the port open)...
    let not_serving = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;
    let deadline = Instant::now() + Duration::from_secs(3);
    while server.health("vlm.v1.Vision").await != Some(not_serving) {
        assert!(
            Instant::now() < deadline,
            "health never went NOT_SERVING after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // ...then the in-flight call completes, then the process exits 0.
    let mut rows = 0;
    while let Some(c) = stream
        .message()
        .await
        .expect("in-flight call completes during the drain")
    {
        rows += c.row_end - c.row_start;
    }
    assert_eq!(rows, 1024);
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = server.child.try_wait().expect("wait") {
            break s;
        }
        assert!(Instant::now() < deadline, "did not exit after SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "exit status {status:?}");
    assert!(
        server
            .stdout
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains("drain")),
        "the drain is logged"
    );
}

#[test]
fn create_runtimes_false_is_a_dry_run() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(
        dir.path(),
        r#"{"visual": {"max_seq_len": [256, 1024], "create_runtimes": false}}"#,
    );
    let out = command(&cfg, &[])
        .stdout(std::process::Stdio::piped())
        .output()
        .expect("run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("dry run") && text.contains("bucket 256") && text.contains("bucket 1024"),
        "{text}"
    );
    assert!(
        !text.contains("listening"),
        "a dry run serves nothing: {text}"
    );
}

#[test]
fn a_device_the_machine_lacks_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), SMALL_BUCKETS);
    let out = command(&cfg, &["--device", "0,100000"])
        .stderr(std::process::Stdio::piped())
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("device 100000 does not exist") && err.contains("visual.device"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_sent_again_is_served_from_the_embedding_cache() {
    let server = TestServer::start(SMALL_BUCKETS, &[]).await;
    let oracle = Oracle::new(&[256, 1024, 4096]);
    let mut client = server.client().await;
    let a = png(512, 512, 21);
    let first = reassemble(
        &collect(&mut client, request(vec![encoded(a.clone())]))
            .await
            .expect("first"),
        0,
    );
    let info = server.info().await;
    assert_eq!(info.embed_cache_bytes, 256 << 20);
    assert_eq!((info.embed_cache_hits, info.embed_cache_misses), (0, 1));
    assert!(info.embed_cache_used_bytes > 0);

    // The same bytes again, in f16 on the wire: a hit, the rows the model computes.
    let mut req = request(vec![encoded(a.clone())]);
    req.dtype = pb::DType::DtypeF16 as i32;
    let again = reassemble(&collect(&mut client, req).await.expect("again"), 0);
    let (_, _, embeds, deepstack) = oracle.encode_bytes(&a, DType::F16);
    assert!(again.embeds == embeds && again.deepstack == deepstack);
    assert_eq!((again.bucket, again.grid), (first.bucket, first.grid));
    let info = server.info().await;
    assert_eq!((info.embed_cache_hits, info.embed_cache_misses), (1, 1));

    // Another picture, or the same one resized to another budget, is another key.
    collect(&mut client, request(vec![encoded(png(512, 512, 22))]))
        .await
        .expect("other");
    let mut small = encoded(a.clone());
    small.max_pixels = 256 * 256;
    let resized = reassemble(
        &collect(&mut client, request(vec![small]))
            .await
            .expect("smaller budget"),
        0,
    );
    assert_eq!(resized.bucket, 256);
    let info = server.info().await;
    assert_eq!((info.embed_cache_hits, info.embed_cache_misses), (1, 3));
    assert!(server
        .metrics_text()
        .contains("vlm_vision_embed_cache_total{result=\"hit\"} 1"));

    // Off: nothing kept, nothing counted.
    let off = TestServer::start(SMALL_BUCKETS, &["--embed-cache-mib", "0"]).await;
    let mut c = off.client().await;
    for _ in 0..2 {
        collect(&mut c, request(vec![encoded(a.clone())]))
            .await
            .expect("uncached");
    }
    let info = off.info().await;
    assert_eq!(
        (
            info.embed_cache_bytes,
            info.embed_cache_hits,
            info.embed_cache_used_bytes
        ),
        (0, 0, 0)
    );
}
