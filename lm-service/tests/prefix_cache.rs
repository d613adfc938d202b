//! Prefix caching does not change the numbers: a sequence whose prefix blocks were computed by
//! an earlier sequence (and are read from the cache) gets the same logits and the same greedy
//! tokens as one that computes everything, for f32 and bf16 weights, with an image in the
//! shared prefix and a shared prefix that ends mid-block. Run on the LM backend directly, as
//! the engine drives it: chunks of the prompt from the first uncached token, then decode steps.
//!
//! bf16 (the serving dtype, on the bf16 kernels) is bit-identical. The f32 path's attention is
//! candle's per-block products, whose rounding depends on where the blocks lie (it differs at
//! ~2e-7 between two block tables for the same tokens, cache or no cache): there the logits
//! agree to 1e-6 and the tokens exactly.
mod support;

use support::{text_prompt, tiny_dir, tiny_image_embeds, tiny_lm_backend};
use vlm_compute::{build_chunk, DecodeRow, ImageEmbeds, LmBackend, PromptLayout, Qwen3VlConfig};
use vlm_config::Dtype;

const BLOCK: usize = 16;
const CHUNK: usize = 32;

fn backend(dtype: Dtype) -> Box<dyn LmBackend> {
    tiny_lm_backend(dtype, BLOCK)
}

/// Prefills `prompt` from cache index `from` (the tokens before it are in `table`'s blocks
/// already) in chunks, then decodes `steps` greedy tokens; returns every step's logits and the
/// tokens.
fn run(
    b: &mut dyn LmBackend,
    layout: &PromptLayout,
    prompt: &[u32],
    images: &[ImageEmbeds],
    table: &[u32],
    from: usize,
    steps: usize,
) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut logits = Vec::new();
    let mut start = from;
    let mut last = Vec::new();
    while start < prompt.len() {
        let len = CHUNK.min(prompt.len() - start);
        let c = build_chunk(layout, prompt, &[], images, start, len, table.to_vec()).unwrap();
        last = b.prefill(&c).unwrap();
        start += len;
    }
    logits.push(last);
    let mut tokens = vec![vlm_compute::argmax(&logits[0])];
    for i in 0..steps {
        let ctx = prompt.len() + i;
        let row = DecodeRow {
            token: *tokens.last().unwrap(),
            position: layout.decode_position(ctx),
            context_len: ctx,
            block_table: table.to_vec(),
        };
        let out = b.decode(1, &[row]).unwrap().remove(0);
        tokens.push(vlm_compute::argmax(&out));
        logits.push(out);
    }
    (logits, tokens)
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b
        .iter()
        .fold(0f32, |m, v| m.max(v.abs()))
        .max(f32::MIN_POSITIVE);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn cached_prefix_blocks_give_the_logits_of_a_full_computation() {
    let cfg = Qwen3VlConfig::from_dir(&tiny_dir()).unwrap();
    let img = tiny_image_embeds();
    // Turn 1: text, the image, text; 4+ full blocks, ending mid-block.
    let mut turn1 = text_prompt(7, 3);
    turn1.push(cfg.vision_start_token_id);
    turn1.extend(std::iter::repeat_n(cfg.image_token_id, img.tokens()));
    turn1.push(cfg.vision_end_token_id);
    turn1.extend(text_prompt(9, 4));
    // Turn 2: turn 1 and more (its prefix blocks are turn 1's full blocks).
    let mut turn2 = turn1.clone();
    turn2.extend(text_prompt(29, 5));
    let images = vec![img.clone()];
    let l1 = PromptLayout::new(&turn1, &[img.grid_thw], &cfg).unwrap();
    let l2 = PromptLayout::new(&turn2, &[img.grid_thw], &cfg).unwrap();
    let full_blocks = turn1.len() / BLOCK;
    assert!(
        full_blocks >= 2 && !turn1.len().is_multiple_of(BLOCK),
        "{}",
        turn1.len()
    );
    let blocks = |r: std::ops::Range<u32>| -> Vec<u32> { r.collect() };
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let mut b = backend(dtype);
        let need = turn2.len().div_ceil(BLOCK) as u32 + 1;
        // Turn 2 from scratch, in blocks of its own.
        let scratch = blocks(0..need);
        let (want, want_tokens) = run(b.as_mut(), &l2, &turn2, &images, &scratch, 0, 6);
        // Turn 1, then turn 2 reading turn 1's full blocks and computing the rest.
        let t1 = blocks(20..20 + need);
        run(b.as_mut(), &l1, &turn1, &images, &t1, 0, 0);
        let mut t2 = t1[..full_blocks].to_vec();
        t2.extend(40..40 + need - full_blocks as u32);
        let (got, got_tokens) = run(
            b.as_mut(),
            &l2,
            &turn2,
            &images,
            &t2,
            full_blocks * BLOCK,
            6,
        );
        assert_eq!(got_tokens, want_tokens, "{dtype:?}: greedy tokens");
        // The bf16 GEMM (AVX512-BF16) sums in one fixed order whatever the chunk: the same
        // bits. Without it a bf16 model runs f32 math on its bf16 weights (candle's products,
        // whose order follows the row count), as close as f32.
        let exact = dtype == Dtype::Bf16 && vlm_backend_cpu::kernels::bf16_dot_available();
        let tol = if exact { 0.0 } else { 1e-6 };
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let d = max_rel(g, w);
            eprintln!("{dtype:?} step {i}: cached vs computed prefix, max rel diff {d:.2e}");
            assert!(d <= tol, "{dtype:?} step {i}: {d} (tolerance {tol})");
        }
    }
}
