//! FP8 block checkpoints (Qwen's FP8 release layout: e4m3fn weights, `weight_scale_inv` per
//! 128x128 block; what vLLM loads with `Fp8LinearMethod`) on the CPU backend, against the
//! scheme's PyTorch reference: `scripts/fp8-reference.py` runs transformers' Qwen3-VL with each
//! FP8 linear's weight converted by torch's own float8_e4m3fn and scaled per block, in float32.
//! The golden (`fixtures/fp8/tiny-256-fp8.json`) was made from the directory `vlm quantize
//! --scheme fp8-block` writes for the seed-0 `tiny-256` checkpoint (blocks of 128); the test
//! writes it again and checks its sha256 first, so a writer change cannot pass against a stale
//! golden.
//!
//! Regenerate: `vlm make-model --preset tiny-256 --out T && vlm quantize --scheme fp8-block T
//! T8 && python scripts/fp8-reference.py T T8 fixtures/fp8/tiny-256-fp8.json`.
mod quant_support;

use quant_support::{
    assert_matches_on_both_paths, first_step_diff, golden, refused, refused_by_both, tiny256_pair,
    Rewrites,
};
use std::path::{Path, PathBuf};
use vlm_model::fp8::quantize_checkpoint_fp8;

/// The tiny-256 checkpoint and its FP8 directory (blocks of 128).
fn fp8_pair(dir: &Path) -> (PathBuf, PathBuf) {
    tiny256_pair(dir, "fp8", |src, dst| {
        quantize_checkpoint_fp8(src, dst, 128)
    })
}

/// Tolerances against the reference, of each step's largest |logit|: products in f32 (the
/// scalar path; the decode gemv), measured 1.8e-6..5.1e-6 on the Xeon; the prefill on the
/// bf16 GEMM (the weight and the activations rounded to bf16), measured 1.4e-2..1.7e-2, the
/// level of bf16 itself on this random model (its float checkpoint run in bf16 is 2.1e-2 off
/// its f32 run).
const F32_TOL: f32 = 1e-4;
const BF16_TOL: f32 = 4e-2;

#[test]
fn fp8_logits_match_the_scheme_reference() {
    let dir = tempfile::tempdir().unwrap();
    let (_, q) = fp8_pair(dir.path());
    let g = golden("fp8/tiny-256-fp8.json", &q);
    assert_matches_on_both_paths(&q, &g, F32_TOL, BF16_TOL);
}

#[test]
fn fp8_differs_from_the_float_checkpoint_by_the_quantization_only() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, q) = fp8_pair(dir.path());
    let (diff, scale) = first_step_diff(&ckpt, &q);
    // e4m3 keeps 3 mantissa bits (relative steps of 1/16): more noise than int8 per channel
    // on most weights, far less than 4-bit.
    assert!(
        diff > 1e-3 * scale,
        "the FP8 checkpoint ran in floats? {diff} vs {scale}"
    );
    assert!(diff < 0.5 * scale, "{diff} vs {scale}");
}

#[test]
fn broken_fp8_checkpoints_are_refused_naming_the_tensor_or_key() {
    let dir = tempfile::tempdir().unwrap();
    let (_, q) = fp8_pair(dir.path());
    let r = Rewrites::new(&q, dir.path());
    // A scale dropped.
    let scale = "model.language_model.layers.1.mlp.down_proj.weight_scale_inv";
    let e = refused(&r.write("no-scale", &|n| n != scale, &|_| {}));
    assert!(e.contains(scale) && e.contains("missing"), "{e}");
    // The config's block is not the one the scales were made for.
    let e = refused(&r.write("block-64", &|_| true, &|c| {
        c["quantization_config"]["weight_block_size"] = serde_json::json!([64, 64])
    }));
    assert!(
        e.contains("weight_scale_inv") && e.contains("[64, 64]"),
        "{e}"
    );
    let e = refused(&r.write("static", &|_| true, &|c| {
        c["quantization_config"]["activation_scheme"] = "static".into()
    }));
    assert!(e.contains("activation_scheme"), "{e}");
    // A NaN code (0x7F), in every value of a weight.
    let w = "model.language_model.layers.0.self_attn.q_proj.weight";
    let nan = r.with_tensor(w, safetensors::Dtype::F8_E4M3, 0x7F);
    let e = refused(&r.write_with("nan", &nan, &|_| {}));
    assert!(e.contains(w) && e.contains("NaN"), "{e}");
    // An FP8 tensor in the vision tower: refused by the tower's loader too, by name.
    let qkv = "model.visual.blocks.0.attn.qkv.weight";
    let tower = r.with_tensor(qkv, safetensors::Dtype::F8_E4M3, 0x38);
    for e in refused_by_both(&r.write_with("fp8-tower", &tower, &|_| {})) {
        assert!(e.contains(qkv) && e.contains("FP8"), "{e}");
    }
}
