//! Vision service throughput over loopback gRPC.
//!
//! 1. A mixed-resolution workload (60% 512x512, 30% 1024x1024, 10% 2048x2048 PNGs, one image
//!    per request, all in flight at once up to a concurrency limit) against buckets
//!    [1024, 4096, 16384] and against a single [16384] bucket: images/s and the wall time.
//! 2. Streaming: one 2048x2048 image (16384 patches) encoded repeatedly; bytes/s of embedding
//!    chunks between the first and the last chunk of each stream (the transfer, not the ViT),
//!    and end to end.
//!
//! Environment: VLM_BENCH_MODEL (checkpoint dir; default: a generated tiny checkpoint),
//! VLM_BENCH_DTYPE (the `visual` dtype: f32 (default) or bf16), VLM_BENCH_DEVICES (default
//! "0"), VLM_BENCH_IMAGES (default 20), VLM_BENCH_STREAM_REPEATS (default 5),
//! VLM_BENCH_CONCURRENCY (default 2 x devices).
//!
//! VLM_BENCH_MIX=latency (for the 2B checkpoint, where a 16384-patch run takes minutes on two
//! cores): instead of a stream of images, one image of each size is encoded alone through the
//! service and the mix's images/s is 1 / (0.6 t512 + 0.3 t1024 + 0.1 t2048) — what a service
//! with one compute device sustains on that mix. VLM_BENCH_SETS (default "bucketed,single")
//! picks the bucket sets; VLM_BENCH_STREAM_REPEATS=0 skips the streaming part.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::transport::Channel;
use vlm_proto::v1 as pb;
use vlm_proto::v1::vision_client::VisionClient;
use vlm_vision_service::{bind, Options};

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn picture_png(w: u32, h: u32, seed: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        let v = x
            .wrapping_mul(2654435761)
            .wrapping_add(y.wrapping_mul(40503))
            .wrapping_add(seed);
        image::Rgb([(x * 255 / w) as u8, (y * 255 / h) as u8, (v >> 13) as u8])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png)
        .expect("png");
    out.into_inner()
}

fn encoded(data: Vec<u8>) -> pb::ImageInput {
    pb::ImageInput {
        source: Some(pb::image_input::Source::Encoded(pb::EncodedImage {
            data,
            mime_type: "image/png".into(),
        })),
        content_hash: vec![],
        expected_grid: None,
        ..Default::default()
    }
}

/// A running in-process service on 127.0.0.1:0.
struct Running {
    client: VisionClient<Channel>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

async fn start(model: &PathBuf, buckets: &[u32], devices: &[u32], capacity: usize) -> Running {
    let mut opts = Options::new(model);
    if std::env::var("VLM_BENCH_DTYPE").is_ok_and(|d| d == "bf16") {
        opts.visual.dtype = vlm_config::Dtype::Bf16;
    }
    opts.visual.max_seq_len = buckets.to_vec();
    opts.visual.device = devices.to_vec();
    opts.visual.num_devices = devices.len() as u32;
    opts.listen = "127.0.0.1:0".parse().unwrap();
    opts.metrics_listen = "127.0.0.1:0".parse().unwrap();
    opts.queue_capacity = capacity;
    let bound = bind(opts).await.expect("bind");
    let addr = bound.grpc_addr;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        bound
            .serve(async {
                let _ = stopped.await;
            })
            .await
            .expect("serve");
    });
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connect");
    let mut client = VisionClient::new(channel)
        .max_decoding_message_size(8 << 20)
        .max_encoding_message_size(64 << 20);
    // Ready when Info answers (UNAVAILABLE while loading).
    while client.info(pb::VisionInfoRequest {}).await.is_err() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Running { client, stop, task }
}

impl Running {
    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

/// Streams one request; returns (raw bytes received, time of first chunk, time of last chunk).
async fn stream_one(
    client: &mut VisionClient<Channel>,
    image: pb::ImageInput,
) -> (usize, Instant, Instant) {
    let req = pb::EncodeRequest {
        request_id: "bench".into(),
        images: vec![image],
        dtype: 0,
    };
    let mut s = client.encode(req).await.expect("encode").into_inner();
    let (mut bytes, mut first, mut last) = (0usize, None, Instant::now());
    while let Some(c) = s.message().await.expect("stream") {
        let now = Instant::now();
        first.get_or_insert(now);
        last = now;
        bytes += c.embeds.len() + c.deepstack.iter().map(Vec::len).sum::<usize>();
    }
    (bytes, first.unwrap_or(last), last)
}

struct MixResult {
    images: usize,
    seconds: f64,
}

async fn mixed(
    model: &PathBuf,
    buckets: &[u32],
    devices: &[u32],
    workload: &Arc<Vec<Vec<u8>>>,
    concurrency: usize,
) -> MixResult {
    let running = start(model, buckets, devices, workload.len().max(1)).await;
    // Warm-up: one small image.
    stream_one(&mut running.client.clone(), encoded(workload[0].clone())).await;
    let sem = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..workload.len() {
        let permit = Arc::clone(&sem).acquire_owned().await.unwrap();
        let mut client = running.client.clone();
        let workload = Arc::clone(workload);
        tasks.push(tokio::spawn(async move {
            let r = stream_one(&mut client, encoded(workload[i].clone())).await;
            drop(permit);
            r
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    let seconds = started.elapsed().as_secs_f64();
    running.stop().await;
    MixResult {
        images: workload.len(),
        seconds,
    }
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async_main());
}

async fn async_main() {
    let _tmp;
    let model = match std::env::var("VLM_BENCH_MODEL") {
        Ok(dir) => PathBuf::from(dir),
        Err(_) => {
            let dir = tempfile::tempdir().expect("tempdir");
            let opts = vlm_make_model::MakeOptions::new(vlm_make_model::Preset::Tiny);
            vlm_make_model::make_model(dir.path(), &opts).expect("tiny checkpoint");
            let p = dir.path().to_path_buf();
            _tmp = dir;
            p
        }
    };
    let devices: Vec<u32> = std::env::var("VLM_BENCH_DEVICES")
        .unwrap_or_else(|_| "0".into())
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .expect("VLM_BENCH_DEVICES: comma-separated ids")
        })
        .collect();
    let n: usize = env_or("VLM_BENCH_IMAGES", 20);
    let repeats: usize = env_or("VLM_BENCH_STREAM_REPEATS", 5);
    let concurrency: usize = env_or("VLM_BENCH_CONCURRENCY", 2 * devices.len());
    println!(
        "model {} | devices {devices:?} | {n} images | concurrency {concurrency}",
        model.display()
    );

    // 60% 512x512, 30% 1024x1024, 10% 2048x2048, interleaved.
    let sizes: Vec<u32> = (0..n)
        .map(|i| match i % 10 {
            0..=5 => 512,
            6..=8 => 1024,
            _ => 2048,
        })
        .collect();
    let workload = Arc::new(
        sizes
            .iter()
            .enumerate()
            .map(|(i, &s)| picture_png(s, s, i as u32))
            .collect::<Vec<_>>(),
    );
    let count = |s: u32| sizes.iter().filter(|&&x| x == s).count();
    println!(
        "mix: {} x 512^2, {} x 1024^2, {} x 2048^2",
        count(512),
        count(1024),
        count(2048)
    );

    println!();
    println!(
        "{:<28} {:>8} {:>10} {:>10}",
        "buckets", "images", "seconds", "images/s"
    );
    let latency_mode = std::env::var("VLM_BENCH_MIX").is_ok_and(|m| m == "latency");
    let sets = std::env::var("VLM_BENCH_SETS").unwrap_or_else(|_| "bucketed,single".into());
    let sets: Vec<Vec<u32>> = sets
        .split(',')
        .map(|s| match s.trim() {
            "single" => vec![16384],
            _ => vec![1024, 4096, 16384],
        })
        .collect();
    for buckets in sets {
        if latency_mode {
            let running = start(&model, &buckets, &devices, 4).await;
            stream_one(&mut running.client.clone(), encoded(workload[0].clone())).await;
            let mut per_size = Vec::new();
            for (size, share) in [(512u32, 0.6), (1024, 0.3), (2048, 0.1)] {
                // (Padded runs differ too: padding rows attend only to the last frame's keys.)
                let t = Instant::now();
                stream_one(
                    &mut running.client.clone(),
                    encoded(picture_png(size, size, 7)),
                )
                .await;
                let s = t.elapsed().as_secs_f64();
                println!("  {buckets:?}: one {size}x{size} image alone: {s:.2} s");
                per_size.push(share * s);
            }
            running.stop().await;
            let per_image: f64 = per_size.iter().sum();
            println!(
                "{:<28} {:>8} {:>10.2} {:>10.3}",
                format!("{buckets:?}"),
                "60/30/10",
                per_image,
                1.0 / per_image
            );
            continue;
        }
        let r = mixed(&model, &buckets, &devices, &workload, concurrency).await;
        println!(
            "{:<28} {:>8} {:>10.2} {:>10.2}",
            format!("{buckets:?}"),
            r.images,
            r.seconds,
            r.images as f64 / r.seconds
        );
    }

    if repeats == 0 {
        return;
    }
    // Streaming: a side x side image (VLM_BENCH_STREAM_SIZE, default 2048) as already-resized
    // pixels (no decode), encoded `repeats` times.
    let side: u32 = env_or("VLM_BENCH_STREAM_SIZE", 2048);
    let running = start(&model, &[1024, 4096, 16384], &devices, 4).await;
    let img = image::RgbImage::from_fn(side, side, |x, y| {
        image::Rgb([x as u8, y as u8, (x ^ y) as u8])
    });
    let pixels = pb::ImageInput {
        source: Some(pb::image_input::Source::Pixels(pb::ResizedPixels {
            width: side,
            height: side,
            rgb8: img.into_raw(),
            ..Default::default()
        })),
        content_hash: vec![0; 32],
        expected_grid: None,
        ..Default::default()
    };
    let mut client = running.client.clone();
    let (mut bytes, mut transfer, mut total) = (0usize, 0f64, 0f64);
    for _ in 0..repeats {
        let t0 = Instant::now();
        let (b, first, last) = stream_one(&mut client, pixels.clone()).await;
        bytes += b;
        transfer += (last - first).as_secs_f64();
        total += t0.elapsed().as_secs_f64();
    }
    running.stop().await;
    println!();
    println!(
        "{:<28} {:>12} {:>14} {:>16}",
        format!("streaming ({side}^2)"),
        "MiB/image",
        "MiB/s stream",
        "MiB/s end-to-end"
    );
    let mib = bytes as f64 / (1 << 20) as f64;
    println!(
        "{:<28} {:>12.2} {:>14.1} {:>16.1}",
        format!("{repeats} repeats"),
        mib / repeats.max(1) as f64,
        mib / transfer.max(1e-9),
        mib / total.max(1e-9)
    );
}
