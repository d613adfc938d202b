//! W8A8 checkpoints (compressed-tensors `int-quantized`, what llm-compressor writes and vLLM
//! serves) on the CPU backend, against the scheme's PyTorch reference:
//! `scripts/w8a8-reference.py` runs transformers' Qwen3-VL with each int8 linear replaced by
//! the scheme (per-token int8 activations, exact integer sums, both scales). The golden
//! (`fixtures/w8a8/tiny-256-w8a8.json`) was made from the directory `vlm quantize --scheme
//! w8a8` writes for the seed-0 `tiny-256` checkpoint; the test writes it again and checks its
//! sha256 first, so a writer change cannot pass against a stale golden.
//!
//! Regenerate: `vlm make-model --preset tiny-256 --out T && vlm quantize --scheme w8a8 T T8 &&
//! python scripts/w8a8-reference.py T T8 fixtures/w8a8/tiny-256-w8a8.json`.
mod quant_support;

use candle_core::DType;
use quant_support::{
    assert_matches_on_both_paths, cpu, first_step_diff, golden, read_tensors, refused,
    refused_by_both, tiny256_pair, write_dir, Rewrites, Tensors,
};
use std::path::{Path, PathBuf};
use vlm_model::oracle::Oracle;
use vlm_model::w8a8::quantize_checkpoint_w8a8;

/// The tiny-256 checkpoint and its W8A8 directory.
fn w8a8_pair(dir: &Path) -> (PathBuf, PathBuf) {
    tiny256_pair(dir, "w8a8", quantize_checkpoint_w8a8)
}

#[test]
fn w8a8_logits_match_the_scheme_reference() {
    let dir = tempfile::tempdir().unwrap();
    let (_, q) = w8a8_pair(dir.path());
    let g = golden("w8a8/tiny-256-w8a8.json", &q);
    // Measured within 8e-7 of the scale on both paths here: the products are exact, only the
    // float ops around them differ. On another CPU those ops may round an activation across a
    // .5 tie (one quantum of one value), which can move the logits by up to ~1% of the scale
    // (as in gguf_golden.rs). The integer sums are exact on both instruction paths.
    assert_matches_on_both_paths(&q, &g, 3e-2, 3e-2);
}

#[test]
fn w8a8_differs_from_the_float_checkpoint_by_the_quantization_only() {
    // Not the same logits as the float model (else the int8 path would be unused), but close.
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, q) = w8a8_pair(dir.path());
    let (diff, scale) = first_step_diff(&ckpt, &q);
    // Measured 6.4% of the scale: twice the golden test's tolerance, which so tells the scheme
    // from the float model.
    assert!(
        diff > 3e-2 * scale,
        "the W8A8 checkpoint ran in floats? {diff} vs {scale}"
    );
    assert!(diff < 0.2 * scale, "{diff} vs {scale}");
}

#[test]
fn broken_w8a8_checkpoints_are_refused_naming_the_tensor_or_key() {
    let dir = tempfile::tempdir().unwrap();
    let (_, q) = w8a8_pair(dir.path());
    let r = Rewrites::new(&q, dir.path());
    // A scale dropped.
    let scale = "model.language_model.layers.1.mlp.down_proj.weight_scale";
    let e = refused(&r.write("no-scale", &|n| n != scale, &|_| {}));
    assert!(e.contains(scale) && e.contains("missing"), "{e}");
    let e = refused(&r.write("group", &|_| true, &|c| {
        c["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "group".into()
    }));
    assert!(e.contains("weights.strategy") && e.contains("group"), "{e}");
    let e = refused(&r.write("awq", &|_| true, &|c| {
        c["quantization_config"] = serde_json::json!({"quant_method": "awq"})
    }));
    assert!(e.contains("quant_method") && e.contains("awq"), "{e}");
    // An int8 tensor in the vision tower: refused by the tower's loader too, by name.
    let qkv = "model.visual.blocks.0.attn.qkv.weight";
    let tower = r.with_tensor(qkv, safetensors::Dtype::I8, 1);
    for e in refused_by_both(&r.write_with("int8-tower", &tower, &|_| {})) {
        assert!(e.contains(qkv) && e.contains("int8"), "{e}");
    }
}

/// A W8A8 directory that keeps one decoder linear in floats (as a checkpoint whose `ignore`
/// lists it) loads and generates, and the LM's weight bytes are what its tensors take in
/// memory: counted here from the file (f32 floats and scales as stored, int8 at a byte), plus
/// the 4-byte row sums the int8 product keeps per output row.
#[test]
fn a_linear_kept_in_floats_loads_and_is_counted_as_floats() {
    let dir = tempfile::tempdir().unwrap();
    let (_, q) = w8a8_pair(dir.path());
    let kept = "model.language_model.layers.0.mlp.down_proj";
    let (weight, scale) = (format!("{kept}.weight"), format!("{kept}.weight_scale"));
    let st = read_tensors(&q);
    let scales: Vec<f32> = st
        .iter()
        .find(|(n, _)| *n == scale)
        .map(|(_, (_, _, b))| {
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        })
        .unwrap();
    let mixed: Tensors = st
        .into_iter()
        .filter(|(n, _)| *n != scale)
        .map(|(n, (dt, sh, data))| {
            if n != weight {
                return (n, (dt, sh, data));
            }
            let k = sh[1];
            let floats: Vec<u8> = data
                .iter()
                .enumerate()
                .flat_map(|(i, &v)| (v as i8 as f32 * scales[i / k]).to_le_bytes())
                .collect();
            (n, (safetensors::Dtype::F32, sh, floats))
        })
        .collect();
    let d = write_dir(&q, &dir.path().join("mixed"), &mixed, &|_| {});
    let lm = |n: &str| n.starts_with("model.language_model.") || n.starts_with("lm_head.");
    let (stored, int8_rows) =
        mixed
            .iter()
            .filter(|(n, _)| lm(n))
            .fold((0, 0), |(bytes, rows), (_, (dt, sh, data))| {
                let r = if *dt == safetensors::Dtype::I8 {
                    sh[0]
                } else {
                    0
                };
                (bytes + data.len(), rows + r)
            });
    assert!(
        mixed.iter().all(|(n, (dt, _, _))| !lm(n)
            || matches!(dt, safetensors::Dtype::F32 | safetensors::Dtype::I8)),
        "the tiny checkpoint stores its floats in f32"
    );
    let model = vlm_model::text::TextModel::load(&cpu(), &d, DType::F32).unwrap();
    assert_eq!(model.weight_bytes(), stored + 4 * int8_rows);
    let o = Oracle::load_text_only(&cpu(), &d, DType::F32).unwrap();
    let out = o.generate_greedy(&[1, 2, 3, 4], &[], 2, &[]).unwrap();
    let logits = out.step_logits.to_vec2::<f32>().unwrap();
    assert!(logits.iter().flatten().all(|v| v.is_finite()));
}
