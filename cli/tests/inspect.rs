//! `vlm inspect` end to end: the real binary on a golden fixture checkpoint (no tokenizer, so
//! `--input-ids`), checked against the reference's tensors (transformers, see
//! fixtures/README.md). The RGBA 256x256 case needs no resize, so the pixel values of
//! both reference backends agree and the logits can be compared tightly.
use candle_core::{DType, Device, Tensor};
use std::process::Command;

fn fixtures() -> std::path::PathBuf {
    vlm_test_support::fixtures_dir()
}

fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let a = a
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let b = b
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(a.len(), b.len(), "shapes differ");
    let max_ref = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    let max_diff = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    max_diff / max_ref.max(1e-12)
}

#[test]
fn inspect_writes_the_reference_intermediates() {
    let case = fixtures().join("tiny_untied_ds1/rgba_256x256");
    let golden =
        candle_core::safetensors::load(case.join("golden.safetensors"), &Device::Cpu).unwrap();
    let ids: Vec<i64> = golden["input_ids"]
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let ids: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    let out = tempfile::tempdir().unwrap();
    let file = out.path().join("inspect.safetensors");
    let status = Command::new(env!("CARGO_BIN_EXE_vlm"))
        .args(["inspect", "--model"])
        .arg(fixtures().join("tiny_untied_ds1"))
        .arg("--image")
        .arg(case.join("input.png"))
        .args([
            "--input-ids",
            &ids.join(","),
            "--max-new-tokens",
            "8",
            "--ignore-eos",
            "--out",
        ])
        .arg(&file)
        .status()
        .expect("running vlm inspect");
    assert!(status.success(), "vlm inspect failed: {status}");
    let got = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
    for name in [
        "pixel_values",
        "image_grid_thw",
        "image_embeds",
        "deepstack_0",
        "input_ids",
        "position_ids",
        "last_logits",
        "generated_ids",
    ] {
        assert!(
            got.contains_key(name),
            "inspect output lacks {name}: {:?}",
            got.keys()
        );
    }
    let d = rel_diff(&got["pixel_values"], &golden["pixel_values_pil"]);
    assert!(d < 1e-6, "pixel_values differ from the reference by {d}");
    let d = rel_diff(&got["image_embeds"], &golden["vision.merged"]);
    assert!(
        d < 1e-4,
        "image_embeds differ from the reference by {d} (relative)"
    );
    let d = rel_diff(&got["deepstack_0"], &golden["vision.deepstack0"]);
    assert!(
        d < 1e-4,
        "deepstack_0 differs from the reference by {d} (relative)"
    );
    let d = rel_diff(&got["position_ids"], &golden["text.position_ids"]);
    assert_eq!(d, 0.0, "3-D positions differ from the reference");
    let d = rel_diff(&got["last_logits"], &golden["logits_last"]);
    assert!(
        d < 1e-4,
        "last logits differ from the reference by {d} (relative)"
    );
    let ours: Vec<i64> = got["generated_ids"]
        .to_dtype(DType::I64)
        .unwrap()
        .to_vec1()
        .unwrap();
    let reference: Vec<i64> = golden["generated_ids"].to_vec1().unwrap();
    assert_eq!(ours, reference, "greedy tokens differ from the reference");
}
