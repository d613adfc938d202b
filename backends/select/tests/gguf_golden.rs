//! GGUF checkpoints (what llama.cpp loads) on the CPU backend, against their scheme's PyTorch
//! reference: `scripts/gguf-reference.py` dequantizes the file with llama.cpp's own code (the
//! `gguf` package) and quantizes activations as ggml's matmul does, in transformers' Qwen3-VL.
//! The goldens (`fixtures/gguf/*.json`) were made from the files `vlm quantize`
//! writes for the seed-0 `tiny-256` checkpoint; the test writes them again and checks their
//! sha256 before comparing, so a writer change cannot pass against stale goldens.
//!
//! Regenerate: `vlm make-model --preset tiny-256 --out T && vlm quantize --scheme q4_k_m T
//! T.gguf && python scripts/gguf-reference.py T T.gguf fixtures/gguf/tiny-256-q4_k_m.json`.
mod quant_support;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use quant_support::{assert_steps_match, cpu, sha256};
use std::path::{Path, PathBuf};
use vlm_make_model::{make_model, MakeOptions, Preset};
use vlm_model::gguf::{materialize, quantize_checkpoint, Scheme};
use vlm_model::oracle::Oracle;
use vlm_model::vision::VisionModel;

fn fixture(name: &str) -> serde_json::Value {
    let p = vlm_test_support::fixtures_dir().join("gguf").join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

struct Pair {
    _dir: tempfile::TempDir,
    ckpt: PathBuf,
    lm: PathBuf,
    served: PathBuf,
}

fn quantized_pair(scheme: Scheme) -> Pair {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("tiny-256");
    make_model(&ckpt, &MakeOptions::new(Preset::Tiny256)).unwrap();
    let lm = dir.path().join("lm.gguf");
    let mmproj = dir.path().join("mmproj.gguf");
    quantize_checkpoint(&ckpt, scheme, &lm, &mmproj).unwrap();
    let served = dir.path().join("served");
    materialize(&lm, &mmproj, &served).unwrap();
    Pair {
        _dir: dir,
        ckpt,
        lm,
        served,
    }
}

/// `tol`: the largest logit difference allowed, as a share of the largest |logit|.
fn check_against_reference(scheme: Scheme, golden: &str, tol: f32) {
    let g = fixture(golden);
    let pair = quantized_pair(scheme);
    assert_eq!(
        sha256(&pair.lm),
        g["gguf_sha256"].as_str().unwrap(),
        "`vlm quantize` wrote other bytes than the golden was made from: regenerate {golden} \
         (see this file's header)"
    );
    let ids: Vec<u32> = serde_json::from_value(g["input_ids"].clone()).unwrap();
    let v = &g["variants"][activation_variant()];
    let steps = v["step_logits"].as_array().unwrap().len();
    let oracle = Oracle::load_text_only(&cpu(), &pair.served, DType::F32).unwrap();
    let out = oracle.generate_greedy(&ids, &[], steps, &[]).unwrap();
    let got = out.step_logits.to_vec2::<f32>().unwrap();
    assert_steps_match(golden, &got, &out.tokens, v, tol);
}

/// Which activations candle's kernels pair Q8_0 weights with on this CPU: Q8_K rows on its
/// VNNI repacked path (`repack_x86::select`), Q8_0 rows on AVX2 alone.
fn activation_variant() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        let vnni = (is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni"))
            || (is_x86_feature_detected!("avxvnni") && is_x86_feature_detected!("avx2"));
        if vnni {
            return "q8_k_act";
        }
    }
    "q8_0_act"
}

#[test]
fn q8_0_logits_match_the_scheme_reference() {
    // Two correct implementations of the scheme differ by the activation roundings that
    // land within float error of a .5 tie (x * 127 / max with ~1e-6 relative error: one or
    // two of a token's few thousand activations round one quantum apart), which moves these
    // logits by up to ~1% of the scale; the scheme itself moves them by several % (Q8_0 with
    // Q8_0 vs Q8_K rows: 4.5%). Ties aside, the products are exact (the unit test below).
    check_against_reference(Scheme::Q8_0, "tiny-256-q8_0.json", 3e-2);
}

#[test]
fn q4_k_m_logits_match_the_scheme_reference() {
    // As for Q8_0 (measured: steps within 1e-6 of the scale, one at 1%).
    check_against_reference(Scheme::Q4KM, "tiny-256-q4_k_m.json", 3e-2);
}

#[test]
fn the_derived_tokenizer_encodes_as_the_checkpoints() {
    let pair = quantized_pair(Scheme::Q8_0);
    let ours = vlm_tokenizer::ChatTokenizer::from_dir(&pair.served).unwrap();
    let theirs = vlm_tokenizer::ChatTokenizer::from_dir(&pair.ckpt).unwrap();
    for text in [
        "Hello, world! The quick brown fox's 123 jumps.\n\n  indented",
        "<|im_start|>user\nDescribe <|vision_start|><|image_pad|><|vision_end|> please<|im_end|>",
        "<think>unicode: héllo wörld 日本語 😀</think>",
    ] {
        assert_eq!(
            ours.encode(text).unwrap(),
            theirs.encode(text).unwrap(),
            "{text:?}"
        );
    }
}

#[test]
fn the_mmproj_vision_tower_matches_the_checkpoints() {
    // The mmproj holds the tower in f16 (llama.cpp's default): the same forward within f16
    // rounding of the weights. Covers the name mapping, the split Conv3d and deepstack.
    let pair = quantized_pair(Scheme::Q8_0);
    let k = cpu();
    let ours = VisionModel::load(&k, &pair.served, DType::F32).unwrap();
    let theirs = VisionModel::load(&k, &pair.ckpt, DType::F32).unwrap();
    let grid = [1, 4, 4];
    let n = 16 * ours.config().patch_dim();
    let pixels: Vec<f32> = (0..n)
        .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
        .collect();
    let x = Tensor::from_vec(pixels, (16, ours.config().patch_dim()), &Device::Cpu).unwrap();
    let a = ours.forward(&x, grid).unwrap().to_host().unwrap();
    let b = theirs.forward(&x, grid).unwrap().to_host().unwrap();
    let pairs = std::iter::once((&a.embeds, &b.embeds)).chain(a.deepstack.iter().zip(&b.deepstack));
    let mut levels = 0;
    for (x, y) in pairs {
        let (x, y) = (x.to_f32(), y.to_f32());
        let scale = y.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = x
            .iter()
            .zip(&y)
            .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(
            diff <= 5e-3 * scale,
            "vision level {levels}: {diff} vs {scale}"
        );
        levels += 1;
    }
    assert_eq!(levels, 1 + 2, "main output and two deepstack levels");
}

/// A one-tensor GGUF file with `meta`, for the refusals.
fn write_gguf(path: &Path, meta: &[(&str, Value)], tensor: (&str, &QTensor)) {
    let mut f = std::fs::File::create(path).unwrap();
    let meta: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    gguf_file::write(&mut f, &meta, &[tensor]).unwrap();
}

#[test]
fn unknown_architectures_and_tensor_types_are_refused_by_name() {
    let pair = quantized_pair(Scheme::Q8_0);
    let dir = pair.lm.parent().unwrap();
    let mmproj = dir.join("mmproj.gguf");
    let w = Tensor::zeros((4, 256), DType::F32, &Device::Cpu).unwrap();
    let llama = dir.join("other-arch.gguf");
    write_gguf(
        &llama,
        &[("general.architecture", Value::String("llama".into()))],
        (
            "blk.0.attn_q.weight",
            &QTensor::quantize(&w, GgmlDType::Q8_0).unwrap(),
        ),
    );
    let err = materialize(&llama, &mmproj, &dir.join("a"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("architecture llama is not served"), "{err}");
    let q2 = dir.join("q2k.gguf");
    write_gguf(
        &q2,
        &[("general.architecture", Value::String("qwen3vl".into()))],
        (
            "blk.0.ffn_up.weight",
            &QTensor::quantize(&w, GgmlDType::Q2K).unwrap(),
        ),
    );
    let err = materialize(&q2, &mmproj, &dir.join("b"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("blk.0.ffn_up.weight") && err.contains("Q2K"),
        "{err}"
    );
}

/// The scheme of the quantized products, pinned: k-quant weights (and Q8_0 on VNNI CPUs) take
/// Q8_K activations (256-value blocks, f32 scale); the product equals the dequantized weight
/// times the Q8_K-rounded activations up to f32 summation order.
#[test]
fn quantized_products_are_dequantized_weights_times_q8k_activations() {
    use candle_core::quantized::k_quants::{BlockQ8K, GgmlType};
    use vlm_backend_cpu::kernels::quantized::QuantizedWeight;
    for (m, n, k, parts) in [
        (5, 128, 512, 2),
        (1, 128, 256, 4),
        (24, 1024, 256, 4),
        (1, 512, 256, 4),
        // Decode row counts on the k-quant gemv (AVX512-VNNI CPUs): odd weight rows, slices
        // of unequal size.
        (2, 131, 768, 4),
        (3, 129, 256, 2),
        (4, 200, 1024, 3),
    ] {
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919 % 2003) as f32 / 1001.0) - 1.0)
            .collect();
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 104729 % 1009) as f32 / 504.0) - 1.0)
            .collect();
        let wt = Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap();
        let xt = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu).unwrap();
        let types: &[GgmlDType] = match activation_variant() {
            "q8_k_act" => &[GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::Q6K],
            _ => &[GgmlDType::Q4K, GgmlDType::Q6K],
        };
        for &dtype in types {
            if dtype == GgmlDType::Q8_0 && n % 64 != 0 {
                // A Q8_0 slice whose rows are not a multiple of 16 leaves candle's tiles for
                // its generic product, which pairs Q8_0 with Q8_0 rows (another scheme).
                continue;
            }
            let q = QTensor::quantize(&wt, dtype).unwrap();
            let wd = q.dequantize(&Device::Cpu).unwrap();
            let mut blocks = vec![BlockQ8K::zeros(); m * k / 256];
            BlockQ8K::from_float(&x, &mut blocks);
            let mut xq = vec![0f32; m * k];
            BlockQ8K::to_float(&blocks, &mut xq);
            let xq = Tensor::from_vec(xq, (m, k), &Device::Cpu).unwrap();
            let want = xq
                .matmul(&wd.t().unwrap())
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let got = QuantizedWeight::new(&q, parts)
                .unwrap()
                .matmul(&xt)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let diff = got
                .iter()
                .flatten()
                .zip(want.iter().flatten())
                .fold(0f32, |d, (a, b)| d.max((a - b).abs()));
            assert!(
                diff <= 1e-4,
                "{dtype:?} {m}x{n}x{k}/{parts}: products differ by {diff}"
            );
            // The embedding rows of a tied quantized head are its dequantized rows.
            let ids = [3u32, 100, 127];
            let rows = QuantizedWeight::new(&q, 2).unwrap().rows(&ids).unwrap();
            let want_rows = wd
                .index_select(&Tensor::new(&ids, &Device::Cpu).unwrap(), 0)
                .unwrap();
            assert_eq!(
                rows.to_vec2::<f32>().unwrap(),
                want_rows.to_vec2::<f32>().unwrap(),
                "{dtype:?} rows"
            );
        }
    }
}
