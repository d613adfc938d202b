//! The FP8 E4M3 KV cache (`kv_cache_dtype: fp8_e4m3`) on the CPU backend, against its PyTorch
//! reference: `scripts/kv-fp8-reference.py` runs transformers' Qwen3-VL in float32 with every
//! key and value its attention caches converted by torch's own float8_e4m3fn cast (saturated at
//! +-448, vLLM's `--kv-cache-dtype fp8` with scales of 1.0). The golden
//! (`fixtures/fp8/tiny-256-kv-fp8.json`) was made from the seed-0 `tiny-256` checkpoint; the
//! test makes it again and checks its sha256 first.
//!
//! Regenerate: `vlm make-model --preset tiny-256 --out T && python
//! scripts/kv-fp8-reference.py T fixtures/fp8/tiny-256-kv-fp8.json`.
mod quant_support;

use candle_core::DType;
use quant_support::{assert_steps_match, golden, tiny256};
use std::path::Path;
use vlm_backend_cpu::{CpuKernels, CpuOptions};
use vlm_model::oracle::Oracle;

/// Tolerances against the reference, of each step's largest |logit|. f32 attention: measured
/// 1.0e-6 on the first step (Zen 4); the margin is for a key or value computed a few ulps
/// apart that sits near a tie between two codes and rounds to the other (a 1/16 step). The
/// bf16 kernel's chunk attention (q and the probabilities rounded to bf16) adds bf16's own
/// level: measured 1.1e-2. Against the float cache the logits move 8.6% on this random model.
const F32_TOL: f32 = 1e-3;
const BF16_TOL: f32 = 4e-2;

/// A greedy run of `steps` on `ids`: (each step's logits, the tokens).
fn greedy(
    dir: &Path,
    opts: CpuOptions,
    fp8: bool,
    ids: &[u32],
    steps: usize,
) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut o = Oracle::load_text_only(&CpuKernels::new(opts), dir, DType::F32).unwrap();
    if fp8 {
        o.text = o.text.with_fp8_kv_cache();
    }
    assert_eq!(o.text.kv_dtype() == DType::F8E4M3, fp8);
    let out = o.generate_greedy(ids, &[], steps, &[]).unwrap();
    (out.step_logits.to_vec2::<f32>().unwrap(), out.tokens)
}

#[test]
fn fp8_kv_cache_logits_match_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = tiny256(dir.path());
    let g = golden("fp8/tiny-256-kv-fp8.json", &ckpt);
    let ids: Vec<u32> = serde_json::from_value(g["input_ids"].clone()).unwrap();
    let steps = g["step_logits"].as_array().unwrap().len();
    // The chunk's attention on the bf16 kernel where the CPU has it, and in f32 (candle's
    // paged form over the widened cache); decode attention reads the codes in both.
    let bf16 = vlm_backend_cpu::kernels::bf16_gemm::available();
    for bf16_dot in [false, bf16] {
        let mut opts = CpuOptions::detect();
        opts.bf16_dot = bf16_dot;
        let (logits, tokens) = greedy(&ckpt, opts, true, &ids, steps);
        let tol = if bf16_dot { BF16_TOL } else { F32_TOL };
        assert_steps_match(&format!("bf16_dot {bf16_dot}"), &logits, &tokens, &g, tol);
    }
}

#[test]
fn fp8_kv_cache_differs_from_the_float_cache_by_its_rounding_only() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = tiny256(dir.path());
    let ids: Vec<u32> = (0..24).map(|i| (i * 37 % 900) as u32).collect();
    let mut opts = CpuOptions::detect();
    opts.bf16_dot = false;
    let (f32_kv, _) = greedy(&ckpt, opts, false, &ids, 1);
    let (fp8_kv, _) = greedy(&ckpt, opts, true, &ids, 1);
    let scale = f32_kv[0].iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = f32_kv[0]
        .iter()
        .zip(&fp8_kv[0])
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    // More than the tolerance above (the cache really holds codes), far less than the logits.
    assert!(
        diff > 2.0 * F32_TOL * scale,
        "an f32 cache after all? {diff} vs {scale}"
    );
    assert!(diff < 0.3 * scale, "{diff} vs {scale}");
}
