//! End-to-end video: the three real binaries on the tiny checkpoint. A video given as frames
//! (gRPC) and as an MP4 (OpenAI `video_url`) is sampled, resized, encoded per temporal group
//! by the vision service and laid out with timestamps by the LM exactly as the in-process
//! pipeline does it; bad videos get 400s naming the problem and the stack keeps serving.
#![allow(clippy::await_holding_lock)]
mod support;

use base64::Engine;
use support::*;
use vlm_config::video::{Sampling, VideoGeometry, VideoProcessorConfig};
use vlm_proto::v1 as pb;

/// Frame k of a synthetic clip: a gradient with a square moving right.
fn frame(k: u32, w: u32, h: u32) -> image::RgbImage {
    image::RgbImage::from_fn(w, h, |x, y| {
        let inside = (k * 8..k * 8 + 24).contains(&x) && (16..40).contains(&y);
        if inside {
            image::Rgb([250, 250, 40])
        } else {
            image::Rgb([(x * 2) as u8, (y * 3) as u8, (k * 30) as u8])
        }
    })
}

fn png_of(img: &image::RgbImage) -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

fn video_request(part: pb::VideoPart, text: &str, max_tokens: u32) -> pb::GenerateRequest {
    use pb::content_part::Part;
    pb::GenerateRequest {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: vec![
                pb::ContentPart {
                    part: Some(Part::Video(part)),
                },
                pb::ContentPart {
                    part: Some(Part::Text(text.into())),
                },
            ],
        }],
        sampling: Some(pb::SamplingParams {
            max_tokens,
            temperature: 0.0,
            ..Default::default()
        }),
        model: String::new(),
    }
}

fn chat(content: serde_json::Value, extra: serde_json::Value) -> serde_json::Value {
    let mut body = serde_json::json!({
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8, "temperature": 0
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_video_is_served_as_the_in_process_pipeline_encodes_it() {
    let _g = serial();
    let (w, h, n, fps) = (96, 64, 5u32, 4.0);
    let frames: Vec<image::RgbImage> = (0..n).map(|k| frame(k, w, h)).collect();
    let files: Vec<Vec<u8>> = frames.iter().map(png_of).collect();
    let prompt = "What happens in the video?";
    let max_tokens = 10;

    // In-process oracle: sample, resize, pair, encode each temporal group, lay out the prompt.
    let (tok, pipeline) = tiny_oracle();
    let geo = VideoGeometry::plan(
        w,
        h,
        n,
        Some(fps),
        Sampling::NumFrames(n),
        &VideoProcessorConfig::default(),
    )
    .unwrap();
    assert_eq!(geo.groups(), 3, "5 frames make 3 temporal groups");
    let sampled: Vec<_> = geo
        .indices
        .iter()
        .map(|&i| frames[i as usize].clone())
        .collect();
    let pre = vlm_preprocess::PreprocessConfig::default();
    let pixels: Vec<_> =
        vlm_preprocess::temporal_groups(&sampled, geo.resized_width, geo.resized_height)
            .unwrap()
            .iter()
            .map(|(a, b)| vlm_preprocess::preprocess_video_group(&[a, b], &pre).unwrap())
            .collect();
    let embeds = pipeline.encode_images(&pixels).unwrap();
    use vlm_tokenizer::{ChatMessage, ChatPart, VisionTokens};
    let msg = ChatMessage::user(vec![ChatPart::Video, ChatPart::Text(prompt.into())]);
    let vision = [VisionTokens::Video {
        tokens_per_group: geo.group_tokens() as usize,
        timestamps: geo.timestamps.clone(),
    }];
    let ids = tok
        .encode_prompt_vision(&[msg], &[], &vision, usize::MAX)
        .unwrap();
    let text = tok.decode(&ids).unwrap();
    assert!(
        text.contains("<0.1 seconds><|vision_start|><|video_pad|>"),
        "{text}"
    );
    let want = pipeline
        .generate_greedy(&ids, &embeds, max_tokens as usize, tok.eos_ids())
        .unwrap()
        .tokens;
    drop(pipeline);

    let c = Cluster::start(1, &[]).await;
    let part = pb::VideoPart {
        frames: files.clone(),
        frames_fps: fps,
        ..Default::default()
    };
    let got = generate(&c.grpc(), video_request(part, prompt, max_tokens))
        .await
        .unwrap();
    assert_eq!(
        got.tokens, want,
        "gateway tokens differ from the in-process pipeline"
    );
    assert_eq!(got.usage.prompt_tokens as usize, ids.len());
    assert_eq!(got.usage.video_tokens as u64, geo.tokens());
    assert_eq!(got.usage.image_tokens, 0);

    // The same frames over the OpenAI API (qwen-vl-utils' "video" part) give the same text.
    let urls: Vec<String> = files.iter().map(|f| data_url("image/png", f)).collect();
    let body = chat(
        serde_json::json!([{"type": "video", "video": urls, "fps": fps}, {"type": "text", "text": prompt}]),
        serde_json::json!({"max_tokens": max_tokens}),
    );
    let (status, body) = post_json(&c.http(), &body);
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], got.text.as_str());

    // An MP4 (H.264) through `video_url`, sampled by fps: served, its frame count from the file.
    let rgb: Vec<u8> = (0..8).flat_map(|k| frame(k, w, h).into_raw()).collect();
    let h264 = ["-c:v", "libx264", "-pix_fmt", "yuv420p", "-f", "mp4"];
    let Some(mp4) = vlm_test_support::ffmpeg::encode_rgb(&rgb, w, h, 8, &h264, "mp4") else {
        vlm_test_support::skip!("no ffmpeg CLI to make the MP4 (deploy/ci-install.sh installs it)");
        return;
    };
    let body = chat(
        serde_json::json!([{"type": "video_url", "video_url": {"url": data_url("video/mp4", &mp4)}},
                           {"type": "text", "text": prompt}]),
        serde_json::json!({"mm_processor_kwargs": {"fps": 4}}),
    );
    let (status, body) = post_json(&c.http(), &body);
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    // 8 frames at 8 fps, 4 fps wanted -> 4 frames -> 2 groups of 6 tokens.
    let mp4_geo = VideoGeometry::plan(
        w,
        h,
        8,
        Some(8.0),
        Sampling::Fps(4.0),
        &VideoProcessorConfig::default(),
    )
    .unwrap();
    let text_only = {
        let msg = ChatMessage::user(vec![ChatPart::Video, ChatPart::Text(prompt.into())]);
        let vision = [VisionTokens::Video {
            tokens_per_group: mp4_geo.group_tokens() as usize,
            timestamps: mp4_geo.timestamps.clone(),
        }];
        tok.encode_prompt_vision(&[msg], &[], &vision, usize::MAX)
            .unwrap()
            .len()
    };
    assert_eq!(v["usage"]["prompt_tokens"], text_only, "{v}");

    // The same clip as VP9 in WebM and as a MOV: the MIME type is a hint, the bytes decide.
    let vp9 = [
        "-c:v",
        "libvpx-vp9",
        "-deadline",
        "realtime",
        "-pix_fmt",
        "yuv420p",
        "-f",
        "webm",
    ];
    let webm = vlm_test_support::ffmpeg::encode_rgb(&rgb, w, h, 8, &vp9, "webm").expect("ffmpeg");
    let mov =
        vlm_test_support::ffmpeg::encode_rgb(&rgb, w, h, 8, &h264[..4], "mov").expect("ffmpeg");
    for (mime, file) in [
        ("application/octet-stream", &webm),
        ("video/webm", &webm),
        ("video/quicktime", &mov),
    ] {
        let body = chat(
            serde_json::json!([{"type": "video_url", "video_url": {"url": data_url(mime, file)}},
                               {"type": "text", "text": prompt}]),
            serde_json::json!({"mm_processor_kwargs": {"fps": 4}}),
        );
        let (status, body) = post_json(&c.http(), &body);
        assert_eq!(status, 200, "{mime}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["usage"]["prompt_tokens"], text_only, "{mime}: {v}");
    }

    // vLLM's pre-sampled frames: data:video/jpeg;base64,<frame>,<frame>,... (all of them used).
    let jpegs: Vec<String> = (0..4)
        .map(|k| {
            let mut out = std::io::Cursor::new(Vec::new());
            frame(k, w, h)
                .write_to(&mut out, image::ImageFormat::Jpeg)
                .unwrap();
            base64::engine::general_purpose::STANDARD.encode(out.into_inner())
        })
        .collect();
    let url = format!("data:video/jpeg;base64,{}", jpegs.join(","));
    let body = chat(
        serde_json::json!([{"type": "video_url", "video_url": {"url": url}},
                           {"type": "text", "text": prompt}]),
        serde_json::json!({}),
    );
    let (status, body) = post_json(&c.http(), &body);
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    // 4 frames given, no rate: every one used, as the gateway plans frames.
    let jpeg_geo = VideoGeometry::plan(
        w,
        h,
        4,
        None,
        Sampling::NumFrames(4),
        &VideoProcessorConfig::default(),
    )
    .unwrap();
    let msg = ChatMessage::user(vec![ChatPart::Video, ChatPart::Text(prompt.into())]);
    let vision = [VisionTokens::Video {
        tokens_per_group: jpeg_geo.group_tokens() as usize,
        timestamps: jpeg_geo.timestamps.clone(),
    }];
    let want = tok
        .encode_prompt_vision(&[msg], &[], &vision, usize::MAX)
        .unwrap()
        .len();
    assert_eq!(v["usage"]["prompt_tokens"], want, "{v}");

    // Bad videos: 400 naming the problem; the stack keeps serving.
    let mut corrupt = mp4.clone();
    corrupt.truncate(mp4.len() / 3);
    let cases: Vec<(serde_json::Value, serde_json::Value, &str)> = vec![
        (
            serde_json::json!([{"type": "video_url", "video_url": {"url": data_url("video/mp4", &corrupt)}}]),
            serde_json::json!({}),
            "video 0",
        ),
        (
            serde_json::json!([{"type": "video_url", "video_url": {"url": data_url("image/png", b"\x1a\x45\xdf\xa3")}}]),
            serde_json::json!({}),
            "unsupported video type",
        ),
        (
            serde_json::json!([{"type": "video", "video": []}]),
            serde_json::json!({}),
            "no frames",
        ),
        (
            serde_json::json!([{"type": "video", "video": urls.clone()}]),
            serde_json::json!({"mm_processor_kwargs": {"num_frames": 100000}}),
            "limit of 128 frames",
        ),
        (
            serde_json::json!([{"type": "video", "video": [urls[0].clone()]}]),
            serde_json::json!({}),
            "at least 2",
        ),
        (
            serde_json::json!([{"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}]),
            serde_json::json!({}),
            "data: URL",
        ),
    ];
    for (content, extra, needle) in cases {
        let (status, body) = post_json(&c.http(), &chat(content.clone(), extra));
        assert_eq!(status, 400, "{content}: {body}");
        assert!(body.contains(needle), "{needle:?} not in {body}");
    }
    let three = serde_json::json!([
        {"type": "video", "video": urls.clone()},
        {"type": "video", "video": urls.clone()},
        {"type": "video", "video": urls.clone()}
    ]);
    let (status, body) = post_json(&c.http(), &chat(three, serde_json::json!({})));
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("3 videos") && body.contains("--max-videos"),
        "{body}"
    );
    let got2 = generate(&c.grpc(), grpc_request(&[], "still there?", 4))
        .await
        .unwrap();
    assert!(!got2.tokens.is_empty());
}
