//! Video and image files as people send them (issue 39), made by the ffmpeg CLI and sent
//! through `/v1/chat/completions` to the three real binaries on the tiny checkpoint: every
//! container and codec of the table is answered with the prompt the same frames make;
//! a clip rotated by its display matrix answers as the clip turned before encoding; a
//! 10-minute clip is answered at the default sampling; several videos at once past the vision
//! queue get a 429 with `Retry-After` naming the vision queue, never a 503.
#![allow(clippy::await_holding_lock)]
mod support;

use serde_json::{json, Value};
use support::*;
use vlm_config::video::{Sampling, VideoGeometry, VideoProcessorConfig};
use vlm_test_support::ffmpeg;
use vlm_tokenizer::{ChatMessage, ChatPart, ChatTokenizer, VisionTokens};

const PROMPT: &str = "What happens in the video?";
/// The gateway's default frame ceiling (`--max-video-frames`).
const MAX_FRAMES: u32 = 128;

fn video_chat(mime: &str, file: &[u8], extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": data_url(mime, file)}},
            {"type": "text", "text": PROMPT}]}],
        "max_tokens": 6, "temperature": 0
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

/// (status, parsed body) of one chat completion.
fn ask(c: &Cluster, body: &Value) -> (u16, Value) {
    let (status, text) = post_json(&c.http(), body);
    let v = serde_json::from_str(&text).unwrap_or(Value::Null);
    (status, v)
}

/// The prompt length a video of these frames makes, as the processor lays it out.
fn prompt_tokens(tok: &ChatTokenizer, w: u32, h: u32, frames: u32, fps: f64, s: Sampling) -> u64 {
    let cfg = VideoProcessorConfig {
        max_frames: VideoProcessorConfig::default().max_frames.min(MAX_FRAMES),
        ..VideoProcessorConfig::default()
    };
    let geo = VideoGeometry::plan(w, h, frames, Some(fps), s, &cfg).unwrap();
    let msg = ChatMessage::user(vec![ChatPart::Video, ChatPart::Text(PROMPT.into())]);
    let vision = [VisionTokens::Video {
        tokens_per_group: geo.group_tokens() as usize,
        timestamps: geo.timestamps.clone(),
    }];
    tok.encode_prompt_vision(&[msg], &[], &vision, usize::MAX)
        .unwrap()
        .len() as u64
}

fn rgb_clip(w: u32, h: u32, n: u32) -> Vec<u8> {
    (0..n)
        .flat_map(|t| ffmpeg::gradient_frame(w, h, t as i64))
        .collect()
}

/// Each file of the table, its MIME type as clients send it, and the encoder
/// arguments after the raw RGB input (`-i -`).
fn table() -> Vec<(&'static str, &'static str, &'static str, Vec<&'static str>)> {
    let x264 = |extra: &[&'static str]| {
        let mut a = vec!["-c:v", "libx264", "-pix_fmt", "yuv420p"];
        a.extend_from_slice(extra);
        a
    };
    let x265 = vec![
        "-c:v",
        "libx265",
        "-x265-params",
        "log-level=none",
        "-pix_fmt",
        "yuv420p",
        "-tag:v",
        "hvc1",
    ];
    let mut with_audio = vec!["-f", "lavfi", "-i", "sine=duration=1", "-shortest"];
    with_audio.extend(x264(&[
        "-bf",
        "2",
        "-c:a",
        "aac",
        "-movflags",
        "+faststart",
    ]));
    let mut opus = vec!["-f", "lavfi", "-i", "sine=duration=1", "-shortest"];
    opus.extend([
        "-c:v",
        "libvpx-vp9",
        "-deadline",
        "realtime",
        "-pix_fmt",
        "yuv420p",
        "-c:a",
        "libopus",
    ]);
    vec![
        (
            "H.264 Baseline, moov at the end",
            "video/mp4",
            "mp4",
            x264(&["-profile:v", "baseline"]),
        ),
        (
            "H.264 High, B-frames, faststart, AAC",
            "video/mp4",
            "mp4",
            with_audio,
        ),
        (
            "H.264 High 10",
            "video/mp4",
            "mp4",
            vec!["-c:v", "libx264", "-pix_fmt", "yuv420p10le"],
        ),
        (
            "H.264 High 4:4:4",
            "video/mp4",
            "mp4",
            vec!["-c:v", "libx264", "-pix_fmt", "yuv444p"],
        ),
        ("HEVC hvc1 in MP4", "video/mp4", "mp4", x265.clone()),
        ("HEVC in MOV", "video/quicktime", "mov", x265),
        (
            "VP8 in WebM",
            "video/webm",
            "webm",
            vec!["-c:v", "libvpx", "-deadline", "realtime"],
        ),
        ("VP9 in WebM with Opus", "video/webm", "webm", opus),
        (
            "AV1 in MP4",
            "video/mp4",
            "mp4",
            vec![
                "-c:v",
                "libaom-av1",
                "-cpu-used",
                "8",
                "-usage",
                "realtime",
                "-pix_fmt",
                "yuv420p",
            ],
        ),
        ("H.264 in MKV", "video/x-matroska", "mkv", x264(&[])),
        (
            "MPEG-4 Part 2",
            "video/mp4",
            "mp4",
            vec!["-c:v", "mpeg4", "-q:v", "3"],
        ),
        (
            "fragmented MP4",
            "video/mp4",
            "mp4",
            x264(&["-movflags", "frag_keyframe+empty_moov"]),
        ),
        ("H.264 as video/x-m4v", "video/x-m4v", "mp4", x264(&[])),
        (
            "H.264 as application/octet-stream",
            "application/octet-stream",
            "mp4",
            x264(&[]),
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_files_people_send_are_answered() {
    let _g = serial();
    if !ffmpeg::available() {
        vlm_test_support::skip!(
            "no ffmpeg CLI to make the files (deploy/ci-install.sh installs it)"
        );
        return;
    }
    let (tok, _) = tiny_oracle();
    let c = Cluster::start(1, &[]).await;
    let (w, h, n, fps) = (96, 64, 8u32, 8u32);
    let rgb = rgb_clip(w, h, n);
    // 8 frames at 8 fps sampled at 4 fps: 4 frames, 2 temporal groups, whatever the file.
    let want = prompt_tokens(&tok, w, h, n, fps as f64, Sampling::Fps(4.0));
    for (name, mime, ext, args) in table() {
        let file = ffmpeg::encode_rgb(&rgb, w, h, fps, &args, ext).expect("ffmpeg");
        let (status, v) = ask(
            &c,
            &video_chat(mime, &file, json!({"mm_processor_kwargs": {"fps": 4}})),
        );
        assert_eq!(status, 200, "{name}: {v}");
        assert_eq!(v["usage"]["prompt_tokens"], want, "{name}: {v}");
    }

    // Images: EXIF-rotated JPEG, BMP, TIFF and AVIF, as `image_url` parts.
    let img = image::RgbImage::from_fn(48, 32, |x, y| {
        image::Rgb([(x * 5) as u8, (y * 7) as u8, 90])
    });
    let encoded = |f: image::ImageFormat| {
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, f).unwrap();
        out.into_inner()
    };
    let jpeg = encoded(image::ImageFormat::Jpeg);
    let avif = std::fs::read(
        vlm_test_support::workspace_dir().join("preprocess/tests/data/lossy420.avif"),
    )
    .unwrap();
    let images = [
        (
            "JPEG, EXIF orientation 6",
            "image/jpeg",
            vlm_test_support::exif::with_exif_orientation(&jpeg, 6),
        ),
        ("BMP", "image/bmp", encoded(image::ImageFormat::Bmp)),
        ("TIFF", "image/tiff", encoded(image::ImageFormat::Tiff)),
        ("AVIF", "image/avif", avif),
    ];
    for (name, mime, bytes) in images {
        let body = json!({
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(mime, &bytes)}},
                {"type": "text", "text": "What is this?"}]}],
            "max_tokens": 4, "temperature": 0
        });
        let (status, v) = ask(&c, &body);
        assert_eq!(status, 200, "{name}: {v}");
        assert!(
            v["usage"]["prompt_tokens"].as_u64().unwrap() > 10,
            "{name}: {v}"
        );
    }

    // A portrait phone clip: the display matrix turns it; lossless 4:4:4, so the frames the
    // model sees are exactly those of the clip turned before encoding, and so is the answer.
    let lossless = ["-c:v", "libx264", "-qp", "0", "-pix_fmt", "yuv444p"];
    let upright_src = ffmpeg::encode_rgb(&rgb, w, h, fps, &lossless, "mp4").expect("ffmpeg");
    // FFmpeg 5.1 sets the matrix from a `rotate` tag on a stream copy only; `rotate=90` asks
    // for a quarter turn counterclockwise (the decoder's rotation reads 270 clockwise).
    let rotated = ffmpeg::make_with_input(
        &[
            "-i",
            "-",
            "-c",
            "copy",
            "-metadata:s:v:0",
            "rotate=90",
            "-f",
            "mp4",
        ],
        "mp4",
        Some(&upright_src),
    )
    .expect("ffmpeg");
    let turned: Vec<u8> = (0..n)
        .flat_map(|t| {
            let f =
                image::RgbImage::from_raw(w, h, ffmpeg::gradient_frame(w, h, t as i64)).unwrap();
            image::imageops::rotate270(&f).into_raw()
        })
        .collect();
    let pre_turned = ffmpeg::encode_rgb(&turned, h, w, fps, &lossless, "mp4").expect("ffmpeg");
    let answers: Vec<Value> = [&rotated, &pre_turned]
        .iter()
        .map(|file| {
            let (status, v) = ask(
                &c,
                &video_chat(
                    "video/mp4",
                    file,
                    json!({"max_tokens": 12, "logprobs": true, "top_logprobs": 3}),
                ),
            );
            assert_eq!(status, 200, "{v}");
            v
        })
        .collect();
    assert_eq!(
        answers[0]["usage"], answers[1]["usage"],
        "the rotated clip is laid out as a {h}x{w} one"
    );
    let logprobs = |v: &Value| v["choices"][0]["logprobs"].clone();
    assert!(
        logprobs(&answers[0])["content"].is_array(),
        "{}",
        answers[0]
    );
    assert_eq!(
        logprobs(&answers[0]),
        logprobs(&answers[1]),
        "the rotated clip answers as the clip turned before encoding"
    );
    let flat = ffmpeg::encode_rgb(&rgb, w, h, fps, &lossless, "mp4").expect("ffmpeg");
    let (_, sideways) = ask(
        &c,
        &video_chat(
            "video/mp4",
            &flat,
            json!({"max_tokens": 12, "logprobs": true, "top_logprobs": 3}),
        ),
    );
    assert_ne!(
        logprobs(&sideways),
        logprobs(&answers[0]),
        "the clip not turned answers otherwise (else the check above is empty)"
    );

    // Ten minutes at 2 fps, sampled at the default 2 fps: 1200 frames, clamped to the
    // 128-frame ceiling (64 temporal groups), answered.
    let (lw, lh) = (64, 48);
    let long = ffmpeg::lavfi_h264(
        "testsrc2=size=64x48:rate=2:duration=600",
        &["-preset", "ultrafast"],
        "mp4",
    )
    .expect("ffmpeg");
    let (status, v) = ask(&c, &video_chat("video/mp4", &long, json!({})));
    assert_eq!(status, 200, "{v}");
    let want = prompt_tokens(&tok, lw, lh, 1200, 2.0, Sampling::Default);
    assert_eq!(v["usage"]["prompt_tokens"], want, "{v}");
    assert!(v["choices"][0]["finish_reason"].is_string(), "{v}");
}

/// A vision service with one queue slot and a line of 4 images. The test holds the slot (an
/// image whose embedding stream it does not read), a video of 4 temporal groups takes the whole
/// line, and the next video gets a 429 with `Retry-After` that names the vision queue. Once
/// the slot is let go the waiting video is served. A video over the line's whole length is a
/// 400 (waiting would never help).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_videos_past_the_vision_queue_get_429_naming_it() {
    use vlm_proto::v1 as pb;
    let _g = serial();
    if !ffmpeg::available() {
        vlm_test_support::skip!(
            "no ffmpeg CLI to make the clips (deploy/ci-install.sh installs it)"
        );
        return;
    }
    let env = [
        ("VLM_VISION_QUEUE_CAPACITY", "1"),
        ("VLM_VISION_MAX_WAITING_IMAGES", "4"),
        // Small chunks: an unread stream fills the transport window and keeps its slot.
        ("VLM_VISION_MAX_CHUNK_BYTES", "4096"),
    ]
    .map(|(k, v)| (k.to_string(), v.to_string()));
    let c = Cluster::start_env(1, &[], &env).await;
    let vision = pb::vision_client::VisionClient::new(channel(&c.vision.addr("grpc")).await);
    let info = |mut v: pb::vision_client::VisionClient<tonic::transport::Channel>| async move {
        v.info(pb::VisionInfoRequest {}).await.unwrap().into_inner()
    };
    let wait_for = |what: &'static str, ok: fn(&pb::VisionInfo) -> bool| {
        let v = vision.clone();
        async move {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            loop {
                let now = info(v.clone()).await;
                if ok(&now) {
                    return;
                }
                assert!(std::time::Instant::now() < deadline, "{what}: {now:?}");
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    };
    let big = pb::ImageInput {
        source: Some(pb::image_input::Source::Encoded(pb::EncodedImage {
            data: png(1024, 1024, 9),
            mime_type: String::new(),
        })),
        ..Default::default()
    };
    // Its own connection with 64 KiB windows, which the image's ~800 KB of embeddings overrun.
    let small_window =
        tonic::transport::Endpoint::from_shared(format!("http://{}", c.vision.addr("grpc")))
            .unwrap()
            .initial_stream_window_size(65_535)
            .initial_connection_window_size(65_535)
            .connect()
            .await
            .unwrap();
    let held = pb::vision_client::VisionClient::new(small_window)
        .encode(pb::EncodeRequest {
            request_id: "held".into(),
            images: vec![big],
            dtype: 0,
        })
        .await
        .expect("encode")
        .into_inner();
    wait_for("the held image takes the slot", |i| i.queue_depth == 1).await;

    let (w, h, fps) = (160, 128, 8u32);
    let x264 = ["-c:v", "libx264", "-pix_fmt", "yuv420p"];
    let clip = ffmpeg::encode_rgb(&rgb_clip(w, h, 8), w, h, fps, &x264, "mp4").expect("ffmpeg");
    // 8 frames, all used: 4 temporal groups, the whole line.
    let body = video_chat(
        "video/mp4",
        &clip,
        json!({"mm_processor_kwargs": {"num_frames": 8}}),
    );
    let addr = c.http();
    let bytes = body.to_string().into_bytes();
    let waiting = {
        let (addr, bytes) = (addr.clone(), bytes.clone());
        std::thread::spawn(move || http_full(&addr, "POST", "/v1/chat/completions", &bytes, ""))
    };
    wait_for("the video's 4 groups wait", |i| i.images_waiting == 4).await;
    let (status, head, text) = http_full(&addr, "POST", "/v1/chat/completions", &bytes, "");
    assert_eq!(status, 429, "{text}");
    assert!(
        head.to_ascii_lowercase().contains("retry-after:"),
        "no Retry-After: {head}"
    );
    assert!(text.contains("vision queue is full"), "{text}");

    drop(held);
    let (status, _, text) = waiting.join().unwrap();
    assert_eq!(
        status, 200,
        "the waiting video is served once the slot is free: {text}"
    );

    // 16 frames all used: 8 groups, over the line of 4 on its own.
    let clip16 = ffmpeg::encode_rgb(&rgb_clip(w, h, 16), w, h, fps, &x264, "mp4").expect("ffmpeg");
    let (status, v) = ask(
        &c,
        &video_chat(
            "video/mp4",
            &clip16,
            json!({"mm_processor_kwargs": {"num_frames": 16}}),
        ),
    );
    assert_eq!(status, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("8 images") && msg.contains("--max-waiting-images"),
        "{v}"
    );
}

/// The gateway's children started to decode a video (`gateway --media-worker decode`).
fn decode_workers(gateway: u32) -> Vec<i32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // pid (comm) state ppid ...: the fields after the last ')'.
        let ppid = stat
            .rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if ppid == Some(gateway) && cmdline.ends_with(b"--media-worker\0decode\0") {
            out.push(pid);
        }
    }
    out
}

/// FFmpeg runs in a child per video: one that dies on a file (here killed with SIGSEGV, as a
/// fault in a parser would) ends that request with a 400 naming it; the gateway keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_crash_ends_only_its_request() {
    let _g = serial();
    if !ffmpeg::available() {
        vlm_test_support::skip!(
            "no ffmpeg CLI to make the clip (deploy/ci-install.sh installs it)"
        );
        return;
    }
    let c = Cluster::start(1, &[]).await;
    // Long enough to decode that the test finds the worker at work: 7200 frames of 320x240.
    let clip = ffmpeg::lavfi_h264(
        "testsrc2=size=320x240:rate=30:duration=240",
        &["-preset", "veryfast", "-crf", "35"],
        "mp4",
    )
    .expect("ffmpeg");
    let addr = c.http();
    // Four frames sampled, the last at the end: every frame is decoded to reach it.
    let body = video_chat(
        "video/mp4",
        &clip,
        json!({"mm_processor_kwargs": {"num_frames": 4}}),
    )
    .to_string();
    let asked = std::thread::spawn(move || {
        http_full(&addr, "POST", "/v1/chat/completions", body.as_bytes(), "")
    });
    let gateway = c.gateway.pid();
    let started = std::time::Instant::now();
    let worker = loop {
        if let Some(&pid) = decode_workers(gateway).first() {
            break pid;
        }
        if asked.is_finished() {
            panic!(
                "answered before a decode worker was seen: {:?}",
                asked.join().unwrap()
            );
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "no decode worker seen"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    // SAFETY: kill(2) of the worker found above.
    assert_eq!(unsafe { libc::kill(worker, libc::SIGSEGV) }, 0);
    let (status, _, text) = asked.join().unwrap();
    assert_eq!(status, 400, "{text}");
    assert!(
        text.contains("video 0")
            && text.contains("the media decoder stopped on this file (signal 11)"),
        "{text}"
    );
    // The gateway is the same process and answers the next request.
    let (status, text) = post_json(
        &c.http(),
        &json!({"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 3}),
    );
    assert_eq!(status, 200, "{text}");
    assert!(std::path::Path::new(&format!("/proc/{gateway}")).exists());
    assert!(
        decode_workers(gateway).is_empty(),
        "a worker was left behind"
    );
}

/// Hostile and broken files through the API: each a 400 naming the problem, the gateway's
/// memory back near where it was (FFmpeg runs in its children), and the gateway serving after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_files_are_clear_400s_and_the_gateway_keeps_its_memory() {
    let _g = serial();
    if !ffmpeg::available() {
        vlm_test_support::skip!(
            "no ffmpeg CLI to make the files (deploy/ci-install.sh installs it)"
        );
        return;
    }
    let c = Cluster::start(1, &[]).await;
    let x264 = ["-c:v", "libx264", "-pix_fmt", "yuv420p"];
    let good = ffmpeg::encode_rgb(&rgb_clip(64, 48, 8), 64, 48, 8, &x264, "mp4").expect("ffmpeg");
    // A VP8 frame and its WebM track declaring 16383x16383 (VP8's largest), from a 256x256 one.
    let mut huge = ffmpeg::make(
        &[
            "-f",
            "lavfi",
            "-i",
            "testsrc2=size=256x256:rate=4:duration=0.25",
            "-frames:v",
            "1",
            "-c:v",
            "libvpx",
            "-deadline",
            "realtime",
        ],
        "webm",
    )
    .expect("ffmpeg");
    for (from, to) in [
        (&b"\xb0\x82\x01\x00"[..], &b"\xb0\x82\x3f\xff"[..]),
        (b"\xba\x82\x01\x00", b"\xba\x82\x3f\xff"),
        (
            b"\x9d\x01\x2a\x00\x01\x00\x01",
            b"\x9d\x01\x2a\xff\x3f\xff\x3f",
        ),
    ] {
        let at = huge
            .windows(from.len())
            .position(|w| w == from)
            .expect("the field");
        huge[at..at + to.len()].copy_from_slice(to);
    }
    // Ten hours at 1 fps: 36,000 frames, the sampled ones reaching past the decode budget.
    let ten_hours = ffmpeg::lavfi_h264(
        "color=gray:size=16x16:rate=1:duration=36000",
        &["-preset", "ultrafast"],
        "mp4",
    )
    .expect("ffmpeg");
    let bomb =
        std::fs::read(vlm_test_support::fixtures_dir().join("video_codecs/hostile/index-bomb.mp4"))
            .unwrap();
    let noise = vlm_test_support::noise(200_000);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("zero-length", Vec::new(), "empty"),
        ("truncated", good[..good.len() / 3].to_vec(), "video 0"),
        ("random bytes", noise, "video 0"),
        ("16383x16383", huge, "over the limit"),
        ("ten hours", ten_hours, "--max-video-source-frames"),
        ("index bomb", bomb, "more than FFmpeg may allocate at once"),
    ];
    let gateway = c.gateway.pid();
    // One good request first, so the baseline holds what serving a video costs.
    let (status, v) = ask(&c, &video_chat("video/mp4", &good, json!({})));
    assert_eq!(status, 200, "{v}");
    let before = vm_rss(gateway);
    for round in 0..3 {
        for (name, file, needle) in &cases {
            let (status, v) = ask(&c, &video_chat("video/mp4", file, json!({})));
            let msg = v["error"]["message"].as_str().unwrap_or("");
            assert_eq!(status, 400, "{name}: {v}");
            assert!(msg.contains(needle), "{name}: {needle:?} not in {msg:?}");
            if round == 0 {
                eprintln!("{name}: {msg}");
            }
        }
    }
    let grown = vm_rss(gateway).saturating_sub(before);
    assert!(grown < 64 << 20, "the gateway grew by {grown} bytes");
    let (status, v) = ask(&c, &video_chat("video/mp4", &good, json!({})));
    assert_eq!(status, 200, "{v}");
}
