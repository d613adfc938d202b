//! Video parity with transformers' Qwen3-VL (`fixtures/tiny/video_*`, made by
//! `gen_video.py`): from the source frames, our sampling, resize, timestamps, temporal-group
//! patchify, per-group ViT, prompt layout (positions) and decoder give the reference's
//! indices, pixel values, embeddings, deepstack features, positions, logits and greedy ids.
mod text_support;

use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use text_support::{candle, cpu, fixtures_dir, rel_diff};
use vlm_compute::{PixelValues, PromptLayout, Qwen3VlConfig};
use vlm_config::video::{Sampling, VideoGeometry, VideoProcessorConfig};
use vlm_model::oracle::Oracle;
use vlm_model::Kernels;

struct VideoCase {
    name: String,
    dir: PathBuf,
    json: serde_json::Value,
    golden: HashMap<String, Tensor>,
}

fn cases() -> Vec<VideoCase> {
    let tiny = fixtures_dir().join("tiny");
    let mut out = Vec::new();
    for name in ["video_fps_sampling", "video_odd_frames", "video_downscaled"] {
        let dir = tiny.join(name);
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap())
                .unwrap();
        let golden =
            candle_core::safetensors::load(dir.join("golden.safetensors"), &Device::Cpu).unwrap();
        out.push(VideoCase {
            name: name.into(),
            dir,
            json,
            golden,
        });
    }
    out
}

impl VideoCase {
    fn t(&self, name: &str) -> &Tensor {
        self.golden
            .get(name)
            .unwrap_or_else(|| panic!("{}: no tensor {name}", self.name))
    }
    fn u32s(&self, key: &str) -> Vec<u32> {
        self.json[key]
            .as_array()
            .unwrap_or_else(|| panic!("{}: no {key}", self.name))
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    }
    fn ids(&self, name: &str) -> Vec<u32> {
        let t = self
            .t(name)
            .flatten_all()
            .unwrap()
            .to_dtype(DType::I64)
            .unwrap();
        t.to_vec1::<i64>()
            .unwrap()
            .into_iter()
            .map(|v| v as u32)
            .collect()
    }
    /// The processor config the case was made with (the checkpoint's values, its size).
    fn processor(&self) -> VideoProcessorConfig {
        let p = &self.json["video_processor"];
        VideoProcessorConfig {
            min_pixels: p["size"]["shortest_edge"].as_u64().unwrap(),
            max_pixels: p["size"]["longest_edge"].as_u64().unwrap(),
            fps: p["fps"].as_f64().unwrap(),
            min_frames: p["min_frames"].as_u64().unwrap() as u32,
            max_frames: p["max_frames"].as_u64().unwrap() as u32,
            cap_pixels_per_frame: p["cap_pixels_per_frame"].as_bool().unwrap(),
            max_video_tokens: p["max_video_tokens"].as_u64().unwrap(),
        }
    }
    fn sampling(&self) -> Sampling {
        let s = &self.json["sampling_options_passed"];
        match (s["num_frames"].as_u64(), s["fps"].as_f64()) {
            (Some(n), _) => Sampling::NumFrames(n as u32),
            (None, Some(f)) => Sampling::Fps(f),
            _ => Sampling::Default,
        }
    }
    fn frames(&self) -> Vec<image::RgbImage> {
        self.json["source"]["frame_files"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| load_png(&self.dir.join(f.as_str().unwrap())))
            .collect()
    }
    fn geometry(&self) -> VideoGeometry {
        let s = &self.json["source"];
        VideoGeometry::plan(
            s["width"].as_u64().unwrap() as u32,
            s["height"].as_u64().unwrap() as u32,
            s["total_frames"].as_u64().unwrap() as u32,
            s["fps"].as_f64(),
            self.sampling(),
            &self.processor(),
        )
        .unwrap()
    }
}

fn load_png(p: &Path) -> image::RgbImage {
    image::open(p).unwrap().to_rgb8()
}

/// Our pixel values of each temporal group, from the source frames.
fn group_pixels(c: &VideoCase, g: &VideoGeometry) -> Vec<PixelValues> {
    let frames = c.frames();
    let sampled: Vec<_> = g
        .indices
        .iter()
        .map(|&i| frames[i as usize].clone())
        .collect();
    let pre = vlm_preprocess::PreprocessConfig::default();
    vlm_preprocess::temporal_groups(&sampled, g.resized_width, g.resized_height)
        .unwrap()
        .iter()
        .map(|(a, b)| vlm_preprocess::preprocess_video_group(&[a, b], &pre).unwrap())
        .collect()
}

#[test]
fn sampling_resize_and_timestamps_match_the_processor() {
    for c in cases() {
        let g = c.geometry();
        assert_eq!(g.indices, c.u32s("frames_indices"), "{}", c.name);
        assert_eq!(
            (g.resized_height, g.resized_width),
            (
                c.json["resized_height"].as_u64().unwrap() as u32,
                c.json["resized_width"].as_u64().unwrap() as u32
            ),
            "{}",
            c.name
        );
        let texts: Vec<String> = g
            .timestamps
            .iter()
            .map(|&t| vlm_tokenizer::timestamp_text(t))
            .collect();
        let want: Vec<String> = c.json["timestamp_texts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        assert_eq!(texts, want, "{}", c.name);
        let grid = c.ids("video_grid_thw");
        assert_eq!(grid[0] as usize, g.groups(), "{}", c.name);
        assert_eq!(&grid[1..], &g.group_grid()[1..], "{}", c.name);
        assert_eq!(
            g.group_tokens(),
            c.json["tokens_per_group"].as_u64().unwrap(),
            "{}",
            c.name
        );
        // Our source frames after sampling are the processor's.
        let frames = c.frames();
        let sampled = c.t("sampled_frames_u8");
        for (k, &i) in g.indices.iter().enumerate() {
            let want = sampled.get(k).unwrap().flatten_all().unwrap();
            let want = want.to_vec1::<u8>().unwrap();
            assert_eq!(frames[i as usize].as_raw(), &want, "{} frame {k}", c.name);
        }
    }
}

#[test]
fn temporal_group_pixels_match_pixel_values_videos() {
    for c in cases() {
        let g = c.geometry();
        let ours: Vec<f32> = group_pixels(&c, &g)
            .into_iter()
            .flat_map(|p| p.values)
            .collect();
        let want = c
            .t("pixel_values_videos")
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(ours.len(), want.len(), "{}", c.name);
        let max = ours
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!("{}: pixel values max abs diff {max:.2e}", c.name);
        // PIL-exact bicubic against torchvision's antialiased kernel: at most 1 level when
        // frames are resized, the normalisation arithmetic (~6e-8) when they are not.
        let resized = c.json["source"]["width"].as_u64().unwrap() as u32 != g.resized_width
            || c.json["source"]["height"].as_u64().unwrap() as u32 != g.resized_height;
        let tol = if resized { 1.01 / 127.5 } else { 1e-6 };
        assert!(max <= tol, "{}: {max}", c.name);
    }
}

#[test]
fn per_group_vit_prompt_and_decoder_match_the_reference() {
    check(&cpu());
    check(&candle());
}

fn check<K: Kernels>(k: &K) {
    for c in cases() {
        let ckpt = c.dir.parent().unwrap().to_path_buf();
        let cfg = Qwen3VlConfig::from_dir(&ckpt).unwrap();
        let p = Oracle::load(k, &ckpt, DType::F32)
            .unwrap()
            .with_prefill_chunk_size(64);
        let g = c.geometry();
        // The reference's own pixel values, so the ViT is compared on the same input.
        let fed = c.t("pixel_values_videos");
        let rows = g.group_patches() as usize;
        let grid = [1, g.group_grid()[1] as usize, g.group_grid()[2] as usize];
        let pixels: Vec<PixelValues> = (0..g.groups())
            .map(|k| PixelValues {
                values: fed
                    .narrow(0, k * rows, rows)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
                grid_thw: grid,
            })
            .collect();
        let groups = p.encode_images(&pixels).unwrap();
        let cat = |f: &dyn Fn(&vlm_compute::ImageEmbeds) -> &vlm_compute::HostTensor| {
            let parts: Vec<Tensor> = groups.iter().map(|e| text_support::tensor(f(e))).collect();
            Tensor::cat(&parts, 0).unwrap()
        };
        let d = rel_diff(&cat(&|e| &e.embeds), c.t("vision.merged"));
        assert!(d < 1e-4, "{} merged: {d}", c.name);
        for level in 0..groups[0].deepstack.len() {
            let d = rel_diff(
                &cat(&|e| &e.deepstack[level]),
                c.t(&format!("vision.deepstack{level}")),
            );
            assert!(d < 1e-4, "{} deepstack{level}: {d}", c.name);
        }

        // The prompt: the reference's ids (random text ids stand for the timestamps); our
        // layout finds the video runs and gives the reference's positions.
        let ids = c.ids("input_ids");
        let grids = vec![grid; g.groups()];
        let layout = PromptLayout::infer(&ids, &grids, &cfg).unwrap();
        let pos = c
            .t("text.position_ids")
            .to_dtype(DType::I64)
            .unwrap()
            .to_vec2::<i64>()
            .unwrap();
        for (i, ours) in layout.positions.iter().enumerate() {
            assert_eq!(
                *ours,
                [pos[0][i], pos[1][i], pos[2][i]],
                "{} position {i}",
                c.name
            );
        }
        let delta = c.ids("text.rope_deltas")[0] as i32 as i64;
        assert_eq!(layout.rope_delta, delta, "{}", c.name);

        let want = c.ids("generated_ids");
        let out = p.generate_greedy(&ids, &groups, want.len(), &[]).unwrap();
        assert_eq!(out.tokens, want, "{}", c.name);
        let d = rel_diff(&out.step_logits, c.t("generate_step_logits"));
        eprintln!(
            "{} ({} backend): per-group ViT + decoder per-step logits max rel diff {d:.2e}",
            c.name,
            k.name()
        );
        assert!(d < 1e-4, "{}: {d}", c.name);
    }
}
