//! W4A16 checkpoints (compressed-tensors `pack-quantized`, what llm-compressor writes and vLLM
//! serves) on the CPU backend, against the scheme's PyTorch reference:
//! `scripts/w4a16-reference.py` runs transformers' Qwen3-VL with each packed linear's weight
//! unpacked by compressed-tensors' own `unpack_from_int32` and scaled per group, in float32.
//! The golden (`fixtures/w4a16/tiny-256-w4a16.json`) was made from the directory `vlm quantize
//! --scheme w4a16` writes for the seed-0 `tiny-256` checkpoint (groups of 128); the test writes
//! it again and checks its sha256 first, so a writer change cannot pass against a stale golden.
//!
//! Regenerate: `vlm make-model --preset tiny-256 --out T && vlm quantize --scheme w4a16 T T4 &&
//! python scripts/w4a16-reference.py T T4 fixtures/w4a16/tiny-256-w4a16.json`.
mod quant_support;

use quant_support::{
    assert_matches_on_both_paths, first_step_diff, golden, refused, refused_by_both, tiny256_pair,
    Rewrites,
};
use std::path::{Path, PathBuf};
use vlm_model::w4a16::quantize_checkpoint_w4a16;

/// The tiny-256 checkpoint and its W4A16 directory (groups of 128).
fn w4a16_pair(dir: &Path) -> (PathBuf, PathBuf) {
    tiny256_pair(dir, "w4a16", |src, dst| {
        quantize_checkpoint_w4a16(src, dst, 128)
    })
}

/// Tolerances against the reference, of each step's largest |logit|. The scalar path (every
/// product in f32): measured 1.4e-6..5.4e-6 on the Xeon. Where the CPU has the bf16 GEMM the
/// 24-token prefill runs on it (the weight `(q - 8) * s` and the activations rounded to bf16,
/// as a bf16 model multiplies) and the decode gemv on `vdpbf16ps` (activations in bf16):
/// measured 2.1e-2..3.3e-2, the level of bf16 itself on this random model (its float
/// checkpoint run in bf16 is 2.1e-2 off its f32 run).
const F32_TOL: f32 = 1e-4;
const BF16_TOL: f32 = 4e-2;

#[test]
fn w4a16_logits_match_the_scheme_reference() {
    let dir = tempfile::tempdir().unwrap();
    let (_, q) = w4a16_pair(dir.path());
    let g = golden("w4a16/tiny-256-w4a16.json", &q);
    assert_matches_on_both_paths(&q, &g, F32_TOL, BF16_TOL);
}

#[test]
fn w4a16_differs_from_the_float_checkpoint_by_the_quantization_only() {
    // Not the same logits as the float model (else the 4-bit path would be unused), but close.
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, q) = w4a16_pair(dir.path());
    let (diff, scale) = first_step_diff(&ckpt, &q);
    assert!(
        diff > 2.0 * BF16_TOL * scale,
        "the W4A16 checkpoint ran in floats? {diff} vs {scale}"
    );
    // Measured 62% of the scale: RTN 4-bit noise (~17x the 8-bit scheme's 6.4%) through a
    // random model's layers.
    assert!(diff < 1.5 * scale, "{diff} vs {scale}");
}

#[test]
fn broken_w4a16_checkpoints_are_refused_naming_the_tensor_or_key() {
    let dir = tempfile::tempdir().unwrap();
    let (_, q) = w4a16_pair(dir.path());
    let r = Rewrites::new(&q, dir.path());
    let set_weights = |k: &'static str, v: serde_json::Value| {
        move |c: &mut serde_json::Value| {
            c["quantization_config"]["config_groups"]["group_0"]["weights"][k] = v.clone()
        }
    };
    // A scale dropped.
    let scale = "model.language_model.layers.1.mlp.down_proj.weight_scale";
    let e = refused(&r.write("no-scale", &|n| n != scale, &|_| {}));
    assert!(e.contains(scale) && e.contains("missing"), "{e}");
    // The config's group size is not the one the scales were made for.
    let e = refused(&r.write("group-64", &|_| true, &set_weights("group_size", 64.into())));
    assert!(
        e.contains("weight_scale") && e.contains("groups of 64"),
        "{e}"
    );
    // Asymmetric and act-order checkpoints: the config and the tensors are named.
    let e = refused(&r.write("asym", &|_| true, &set_weights("symmetric", false.into())));
    assert!(e.contains("weights.symmetric"), "{e}");
    let extra = |name: &str| {
        let mut st = r.st.clone();
        st.push((
            name.into(),
            (safetensors::Dtype::I32, vec![4, 2], vec![0u8; 32]),
        ));
        st
    };
    let zp = "model.language_model.layers.0.mlp.up_proj.weight_zero_point";
    let e = refused(&r.write_with("zero-point", &extra(zp), &|_| {}));
    assert!(e.contains(zp) && e.contains("not served"), "{e}");
    // A packed tensor in the vision tower: refused by the tower's loader too, by name.
    let packed = "model.visual.blocks.0.attn.qkv.weight_packed";
    for e in refused_by_both(&r.write_with("packed-tower", &extra(packed), &|_| {})) {
        assert!(e.contains(packed) && e.contains("4-bit"), "{e}");
    }
}
