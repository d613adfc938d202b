//! The in-process pipeline against the reference goldens: greedy tokens and per-step decode
//! logits (prefill in chunks of 64, decode at batch 1), and several sequences decoded together
//! in one padded bucket giving each its own per-step logits.
mod text_support;

use candle_core::DType;
use text_support::{
    cases, check_bf16_steps, check_steps, cpu, greedy_requests, rel_diff, three_of_one_checkpoint,
    Case,
};
use vlm_backend_cpu::CpuKernels;
use vlm_model::oracle::Oracle;
use vlm_model::text::TextModel;

fn pipeline(case: &Case, block_len: usize) -> Oracle<CpuKernels> {
    let text = TextModel::load(&cpu(), &case.ckpt, DType::F32).unwrap();
    Oracle::from_parts(case.cfg.clone(), None, text)
        .with_prefill_chunk_size(64)
        .with_block_len(block_len)
}

#[test]
fn greedy_generation_matches_the_reference() {
    for case in cases() {
        let p = pipeline(&case, 32);
        let steps = case.generated_ids().len();
        let out = p
            .generate_greedy(&case.input_ids(), &case.images(), steps, &[])
            .unwrap();
        let worst = check_steps(&case, "greedy", &out.tokens, &out.step_logits);
        eprintln!(
            "{}: greedy tokens equal, per-step logits max rel diff {worst:.2e}",
            case.name
        );
        // positions: the prompt's, then L+i+delta for each fed token.
        let l = case.input_ids().len();
        assert_eq!(out.positions.len(), l + steps - 1);
        assert_eq!(out.positions[l], [l as i64 + out.rope_delta; 3]);
    }
}

#[test]
fn eos_stops_generation_and_is_kept() {
    let case = cases()
        .into_iter()
        .find(|c| c.name.contains("rgba"))
        .unwrap_or_else(|| cases().remove(0));
    let p = pipeline(&case, 64);
    let want = case.generated_ids();
    let out = p
        .generate_greedy(&case.input_ids(), &case.images(), 8, &[want[2]])
        .unwrap();
    let stop = want.iter().position(|&t| t == want[2]).unwrap();
    assert_eq!(out.tokens, want[..=stop].to_vec());
    assert_eq!(out.step_logits.dims()[0], stop + 1);
}

#[test]
fn sequences_decoded_together_in_a_padded_bucket_match_their_own_goldens() {
    let all = cases();
    let group = three_of_one_checkpoint(&all);
    let p = pipeline(group[0], 16);
    let reqs = greedy_requests(&group);
    let steps = group[0].generated_ids().len();
    // 3 sequences in a bucket of 4: one padded row.
    let outs = p.generate_greedy_batch(&reqs, 4, steps, &[]).unwrap();
    for (case, out) in group.iter().zip(&outs) {
        let worst = check_steps(case, "batched", &out.tokens, &out.step_logits);
        eprintln!(
            "{}: batch 3 in bucket 4, per-step logits max rel diff {worst:.2e}",
            case.name
        );
        // and the same as decoding it alone
        let single = p
            .generate_greedy(&case.input_ids(), &case.images(), steps, &[])
            .unwrap();
        let d = rel_diff(&out.step_logits, &single.step_logits);
        eprintln!("{}: batched vs single {d:.2e}", case.name);
        assert!(d < 1e-5, "{}: batched vs single {d}", case.name);
    }
}

#[test]
fn bf16_weights_decode_on_a_bf16_cache_close_to_the_reference() {
    // bf16 weights get a bf16 KV cache (the reference keeps k/v in the model dtype): the decode
    // steps read keys and values rounded to bf16, and their logits stay as close to the f32
    // reference as the bf16 prefill's do (half_precision_weight_storage_... in text_golden).
    let mut decode_steps = 0;
    for case in cases() {
        let text = TextModel::load(&cpu(), &case.ckpt, DType::BF16).unwrap();
        assert_eq!(text.kv_dtype(), DType::BF16);
        let p = Oracle::from_parts(case.cfg.clone(), None, text)
            .with_prefill_chunk_size(64)
            .with_block_len(32);
        let want = case.generated_ids();
        let out = p
            .generate_greedy(&case.input_ids(), &case.images(), want.len(), &[])
            .unwrap();
        let (worst, steps) = check_bf16_steps(&case, "bf16", &out.tokens, &out.step_logits);
        decode_steps += steps;
        eprintln!(
            "{}: bf16 weights + bf16 cache, per-step logits max rel diff {worst:.2e}",
            case.name
        );
    }
    assert!(
        decode_steps >= 10,
        "only {decode_steps} decode steps compared"
    );
}
