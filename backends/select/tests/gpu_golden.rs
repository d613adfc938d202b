//! The CUDA backend against the reference goldens, on a GPU: prefill logits, greedy decode with
//! per-step logits (the paged decode kernel), sequences decoded together in a padded bucket,
//! and bf16 weights on a bf16 cache, with the CPU tests' tolerances. Built only with the `cuda`
//! feature; on a machine without a GPU each test says so and passes without checking (the
//! CPU-side parts of the backend are tested in `backends/cuda`).
#![cfg(feature = "cuda")]
mod text_support;

use candle_core::DType;
use text_support::{
    cases, check_bf16_steps, check_steps, greedy_requests, three_of_one_checkpoint, Case,
};
use vlm_backend_cuda::gpu::{device, kernels::CudaKernels};
use vlm_model::oracle::Oracle;
use vlm_model::text::TextModel;

/// GPU 0's kernels, or None (with the reason on stderr) where no GPU can be opened.
fn gpu() -> Option<CudaKernels> {
    match device::open(0) {
        Ok(d) => {
            let sms = device::multiprocessors(&d).expect("multiprocessor count");
            Some(CudaKernels::new(d, sms))
        }
        Err(e) => {
            vlm_test_support::skip!("no CUDA GPU here ({e})");
            None
        }
    }
}

fn pipeline(k: &CudaKernels, case: &Case, dtype: DType, block_len: usize) -> Oracle<CudaKernels> {
    let text = TextModel::load(k, &case.ckpt, dtype).unwrap();
    Oracle::from_parts(case.cfg.clone(), None, text)
        .with_prefill_chunk_size(64)
        .with_block_len(block_len)
}

#[test]
fn greedy_generation_on_the_gpu_matches_the_reference() {
    let Some(k) = gpu() else { return };
    for case in cases() {
        let p = pipeline(&k, &case, DType::F32, 32);
        let steps = case.generated_ids().len();
        let out = p
            .generate_greedy(&case.input_ids(), &case.images(), steps, &[])
            .unwrap();
        let worst = check_steps(&case, "gpu greedy", &out.tokens, &out.step_logits);
        eprintln!(
            "{}: gpu greedy tokens equal, per-step logits max rel diff {worst:.2e}",
            case.name
        );
    }
}

#[test]
fn sequences_decoded_together_on_the_gpu_match_their_own_goldens() {
    let Some(k) = gpu() else { return };
    let all = cases();
    let group = three_of_one_checkpoint(&all);
    let p = pipeline(&k, group[0], DType::F32, 16);
    let reqs = greedy_requests(&group);
    let steps = group[0].generated_ids().len();
    // 3 sequences in a bucket of 4: one padded row (context 0 in the decode kernel).
    let outs = p.generate_greedy_batch(&reqs, 4, steps, &[]).unwrap();
    for (case, out) in group.iter().zip(&outs) {
        let worst = check_steps(case, "gpu batched", &out.tokens, &out.step_logits);
        eprintln!(
            "{}: gpu batch 3 in bucket 4, per-step logits max rel diff {worst:.2e}",
            case.name
        );
    }
}

#[test]
fn bf16_weights_on_the_gpu_stay_close_to_the_reference() {
    let Some(k) = gpu() else { return };
    let mut decode_steps = 0;
    for case in cases() {
        let p = pipeline(&k, &case, DType::BF16, 32);
        let want = case.generated_ids();
        let out = p
            .generate_greedy(&case.input_ids(), &case.images(), want.len(), &[])
            .unwrap();
        let (worst, steps) = check_bf16_steps(&case, "gpu bf16", &out.tokens, &out.step_logits);
        decode_steps += steps;
        eprintln!(
            "{}: gpu bf16 weights + bf16 cache, per-step logits max rel diff {worst:.2e}",
            case.name
        );
    }
    assert!(
        decode_steps >= 10,
        "only {decode_steps} decode steps compared"
    );
}
