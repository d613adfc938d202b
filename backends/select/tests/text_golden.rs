//! The decoder against the reference goldens (fixtures/): MRoPE positions, prefill logits,
//! chunked prefill, and the input checks of a prefill step. Image embeddings are the golden
//! ViT outputs, so these tests do not depend on the vision tower.
mod text_support;

use candle_core::{DType, Device, Tensor};
use text_support::{candle, cases, cpu, rel_diff, Case};
use vlm_backend_cpu::CpuKernels;
use vlm_compute::{get_rope_index, ComputeError, PromptLayout};
use vlm_model::text::{BatchInput, TextModel};
use vlm_model::{Kernels, ModelError};

const TOL: f32 = 1e-4;

fn load(case: &Case) -> TextModel<CpuKernels> {
    load_with(&cpu(), case)
}

fn load_with<K: Kernels>(k: &K, case: &Case) -> TextModel<K> {
    TextModel::load(k, &case.ckpt, DType::F32).expect("text model loads")
}

/// Last-position logits of the case's prompt prefilled in chunks of `chunk` with blocks of
/// `block_len` tokens.
fn prefill<K: Kernels>(
    model: &TextModel<K>,
    case: &Case,
    chunk: usize,
    block_len: usize,
) -> Tensor {
    let ids = case.input_ids();
    let images = case.images();
    let layout = PromptLayout::new(&ids, &case.grids, &case.cfg).unwrap();
    let mut kv = model
        .new_kv_cache(ids.len().div_ceil(block_len) + 2, block_len)
        .unwrap();
    // Blocks in a scrambled order: the block table, not adjacency, must decide.
    let n = kv.num_blocks() as u32;
    let table: Vec<u32> = (0..n).rev().collect();
    let mut last = None;
    for c in layout.chunks(&ids, &images, chunk, &table).unwrap() {
        last = Some(model.forward(&BatchInput::Prefill(c), &mut kv).unwrap());
    }
    last.unwrap().squeeze(0).unwrap()
}

#[test]
fn rope_index_matches_the_golden_positions() {
    for case in cases() {
        let ids = case.input_ids();
        let c = &case.cfg;
        let (pos, delta) = get_rope_index(
            &ids,
            c.image_token_id,
            c.vision_start_token_id,
            &case.grids,
            c.vision.spatial_merge_size,
        )
        .unwrap();
        let want = case
            .t("text.position_ids")
            .to_dtype(DType::I64)
            .unwrap()
            .to_vec2::<i64>()
            .unwrap();
        assert_eq!(want.len(), 3);
        for (i, p) in pos.iter().enumerate() {
            assert_eq!(
                *p,
                [want[0][i], want[1][i], want[2][i]],
                "{}: token {i}",
                case.name
            );
        }
        assert_eq!(pos.len(), ids.len());
        let want_delta = case
            .t("text.rope_deltas")
            .flatten_all()
            .unwrap()
            .to_vec1::<i64>()
            .unwrap()[0];
        assert_eq!(delta, want_delta, "{}: rope delta", case.name);
    }
}

#[test]
fn one_shot_prefill_logits_match_the_reference() {
    fn check<K: Kernels>(k: &K) {
        for case in cases() {
            let model = load_with(k, &case);
            let len = case.input_ids().len();
            let logits = prefill(&model, &case, len, 1024);
            let d = rel_diff(&logits, case.t("logits_last"));
            eprintln!(
                "{} ({} backend): one-shot prefill logits_last max rel diff {d:.2e}",
                case.name,
                k.name()
            );
            assert!(d < TOL, "{} ({}): {d}", case.name, k.name());
        }
    }
    check(&cpu());
    check(&candle());
}

#[test]
fn chunked_prefill_equals_one_shot() {
    for case in cases() {
        let len = case.input_ids().len();
        if len <= 256 && !case.name.contains("two_images") {
            continue;
        }
        let model = load(&case);
        let one = prefill(&model, &case, len, 1024);
        // Chunks of 64 over blocks of 64, and of 64 over blocks of 48 (chunks straddle blocks;
        // images cut by chunk boundaries).
        for block_len in [64, 48] {
            let chunked = prefill(&model, &case, 64, block_len);
            let d = rel_diff(&chunked, &one);
            let g = rel_diff(&chunked, case.t("logits_last"));
            eprintln!(
                "{}: chunk 64 / block {block_len} vs one-shot {d:.2e}, vs reference {g:.2e}",
                case.name
            );
            assert!(d < TOL && g < TOL, "{}: {d} {g}", case.name);
        }
    }
}

#[test]
fn image_token_count_mismatch_is_invalid_input_naming_both_counts() {
    let case = cases().into_iter().next().unwrap();
    let mut ids = case.input_ids();
    let pos = ids
        .iter()
        .position(|&t| t == case.cfg.image_token_id)
        .unwrap();
    ids.remove(pos);
    let err = PromptLayout::new(&ids, &case.grids, &case.cfg).unwrap_err();
    let total: usize = case.grids.iter().map(|g| g[0] * g[1] * g[2] / 4).sum();
    assert!(matches!(err, ComputeError::InvalidInput(_)), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("{} image tokens", total - 1))
            && msg.contains(&format!("need {total}")),
        "{msg}"
    );
}

#[test]
fn a_chunk_whose_image_rows_miss_image_tokens_is_rejected() {
    let case = cases().into_iter().next().unwrap();
    let model = load(&case);
    let ids = case.input_ids();
    let layout = PromptLayout::new(&ids, &case.grids, &case.cfg).unwrap();
    let mut kv = model.new_kv_cache(4, 64).unwrap();
    let mut chunk = layout
        .chunk(&ids, &case.images(), 0..ids.len(), vec![0, 1, 2, 3])
        .unwrap();
    chunk.images[0].len -= 1;
    let err = model
        .forward(&BatchInput::Prefill(chunk), &mut kv)
        .unwrap_err();
    assert!(
        matches!(err, ModelError::Compute(ComputeError::InvalidInput(_))),
        "{err}"
    );
    assert!(err.to_string().contains("not covered"), "{err}");
}

#[test]
fn a_block_table_too_short_is_a_kv_cache_error() {
    let case = cases().into_iter().next().unwrap();
    let model = load(&case);
    let ids = case.input_ids();
    let layout = PromptLayout::new(&ids, &case.grids, &case.cfg).unwrap();
    let mut kv = model.new_kv_cache(4, 16).unwrap();
    let chunk = layout
        .chunk(&ids, &case.images(), 0..40, vec![0, 1])
        .unwrap();
    let err = model
        .forward(&BatchInput::Prefill(chunk), &mut kv)
        .unwrap_err();
    assert!(
        matches!(err, ModelError::Compute(ComputeError::KvCache(_))),
        "{err}"
    );
}

#[test]
fn half_precision_weight_storage_stays_close_to_the_reference() {
    // f16 / bf16 storage rounds every weight (relative 5e-4 / 4e-3), activations stay f32
    // (except that on a CPU with AVX512-BF16 the bf16 matmuls also round their input rows to
    // bf16, as torch's bf16 does): the logits move by about that much, not more.
    for case in cases() {
        for (dtype, tol) in [(DType::F16, 2e-3), (DType::BF16, 1.5e-2)] {
            let model = TextModel::load(&cpu(), &case.ckpt, dtype).unwrap();
            let len = case.input_ids().len();
            // chunks of 64: the many-row (widening) path; the last chunk's lm_head row and the
            // decode kernel take the few-row path.
            let logits = prefill(&model, &case, 64, 64);
            let d = rel_diff(&logits, case.t("logits_last"));
            eprintln!(
                "{}: {dtype:?} weights, prefill ({len} tokens) logits max rel diff {d:.2e}",
                case.name
            );
            assert!(d < tol, "{} {dtype:?}: {d}", case.name);
        }
    }
}

#[test]
fn the_text_model_loads_from_lm_tensors_alone() {
    // A checkpoint without any `model.visual.*` tensor: the LM must not need one.
    let case = cases().into_iter().next().unwrap();
    let all =
        candle_core::safetensors::load(case.ckpt.join("model.safetensors"), &Device::Cpu).unwrap();
    let lm: std::collections::HashMap<String, Tensor> = all
        .into_iter()
        .filter(|(k, _)| !k.starts_with("model.visual."))
        .collect();
    assert!(lm
        .keys()
        .all(|k| k.starts_with("model.language_model.") || k == "lm_head.weight"));
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        case.ckpt.join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    candle_core::safetensors::save(&lm, dir.path().join("model.safetensors")).unwrap();
    let model = TextModel::load(&cpu(), dir.path(), DType::F32).unwrap();
    let logits = prefill(&model, &case, 64, 64);
    assert!(rel_diff(&logits, case.t("logits_last")) < TOL);
}
