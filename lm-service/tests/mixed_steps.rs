//! A step with a prefill chunk and decode rows, run through the weights together
//! (`LmBackend::prefill_and_decode`), gives every sequence the numbers of the two run apart:
//! the chunk's logits, the decode rows' logits, and the K/V both leave in the cache (read back by
//! the decode steps after it). The bf16 model on the bf16 kernel (row-independent products)
//! takes the joint path and must match to the bit; f32 runs them apart and must too.
//! A bad block table in one part fails that part alone.
mod support;

use support::{text_prompt, tiny_dir, tiny_image_embeds, tiny_lm_backend};
use vlm_compute::{build_chunk, DecodeRow, ImageEmbeds, LmBackend, PromptLayout, Qwen3VlConfig};
use vlm_config::Dtype;

const BLOCK: usize = 16;
const CHUNK: usize = 24;

fn backend(dtype: Dtype) -> Box<dyn LmBackend> {
    tiny_lm_backend(dtype, BLOCK)
}

/// A sequence the test drives: its prompt, layout, images and blocks.
struct Seq {
    prompt: Vec<u32>,
    layout: PromptLayout,
    images: Vec<ImageEmbeds>,
    table: Vec<u32>,
}

impl Seq {
    fn chunk(&self, start: usize) -> vlm_compute::PrefillChunk {
        let len = CHUNK.min(self.prompt.len() - start);
        build_chunk(
            &self.layout,
            &self.prompt,
            &[],
            &self.images,
            start,
            len,
            self.table.clone(),
        )
        .unwrap()
    }
    fn row(&self, token: u32, ctx: usize) -> DecodeRow {
        DecodeRow {
            token,
            position: self.layout.decode_position(ctx),
            context_len: ctx,
            block_table: self.table.clone(),
        }
    }
}

/// Every logits vector of a schedule: sequence A prefilled alone, then B's chunks each with A's
/// decode row (joint or apart), then both decoding side by side.
fn schedule(b: &mut dyn LmBackend, a: &Seq, s: &Seq, joint: bool) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut last = Vec::new();
    while start < a.prompt.len() {
        last = b.prefill(&a.chunk(start)).unwrap();
        start += CHUNK;
    }
    let mut a_tok = vlm_compute::argmax(&last);
    let mut a_ctx = a.prompt.len();
    out.push(last);
    // B's prompt, a chunk per step, each step also decoding A.
    let mut start = 0;
    let mut b_tok = 0;
    while start < s.prompt.len() {
        let c = s.chunk(start);
        let rows = [a.row(a_tok, a_ctx)];
        let (p, d) = if joint {
            b.prefill_and_decode(&c, 1, &rows)
        } else {
            let d = b.decode(1, &rows);
            (b.prefill(&c), d)
        };
        let (p, mut d) = (p.unwrap(), d.unwrap());
        a_tok = vlm_compute::argmax(&d[0]);
        a_ctx += 1;
        b_tok = vlm_compute::argmax(&p);
        out.push(p);
        out.push(d.remove(0));
        start += CHUNK;
    }
    // Both decoding: reads the K/V every earlier step wrote.
    for b_ctx in s.prompt.len()..s.prompt.len() + 3 {
        let d = b
            .decode(2, &[a.row(a_tok, a_ctx), s.row(b_tok, b_ctx)])
            .unwrap();
        a_tok = vlm_compute::argmax(&d[0]);
        b_tok = vlm_compute::argmax(&d[1]);
        a_ctx += 1;
        out.extend(d);
    }
    out
}

fn sequences() -> (Seq, Seq) {
    let cfg = Qwen3VlConfig::from_dir(&tiny_dir()).unwrap();
    let img = tiny_image_embeds();
    let a_prompt = text_prompt(20, 2);
    // B: text, an image, text; three chunks.
    let mut b_prompt = text_prompt(10, 5);
    b_prompt.push(cfg.vision_start_token_id);
    b_prompt.extend(std::iter::repeat_n(cfg.image_token_id, img.tokens()));
    b_prompt.push(cfg.vision_end_token_id);
    b_prompt.extend(text_prompt(40, 11));
    assert!(b_prompt.len() > 2 * CHUNK, "{}", b_prompt.len());
    let a = Seq {
        layout: PromptLayout::new(&a_prompt, &[], &cfg).unwrap(),
        table: (0..8).collect(),
        prompt: a_prompt,
        images: Vec::new(),
    };
    let s = Seq {
        layout: PromptLayout::new(&b_prompt, &[img.grid_thw], &cfg).unwrap(),
        table: (10..20).collect(),
        prompt: b_prompt,
        images: vec![img],
    };
    (a, s)
}

#[test]
fn a_joint_step_gives_the_numbers_of_the_two_apart() {
    let (a, s) = sequences();
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let mut apart = backend(dtype);
        let mut joint = backend(dtype);
        // The bf16 kernel's products are row-independent: the joint path runs. Without it
        // (f32, or a CPU without AVX512-BF16) the backend runs the two apart.
        let mixes = dtype == Dtype::Bf16 && vlm_backend_cpu::kernels::bf16_dot_available();
        assert_eq!(joint.mixes_steps(), mixes, "{dtype:?}");
        let want = schedule(apart.as_mut(), &a, &s, false);
        let got = schedule(joint.as_mut(), &a, &s, true);
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g.iter().zip(w).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{dtype:?}: logits {i} differ between the joint and the apart step"
            );
        }
    }
}

#[test]
fn a_bad_part_of_a_joint_step_fails_alone() {
    let (a, s) = sequences();
    let mut b = backend(Dtype::Bf16);
    let mut start = 0;
    while start < a.prompt.len() {
        b.prefill(&a.chunk(start)).unwrap();
        start += CHUNK;
    }
    // A decode row whose table is too short for its context: the chunk still runs.
    let mut bad = a.row(1, a.prompt.len());
    bad.block_table.truncate(1);
    let (p, d) = b.prefill_and_decode(&s.chunk(0), 1, &[bad]);
    assert!(p.is_ok(), "{p:?}");
    assert!(d.is_err());
    // A chunk whose table is too short: the decode row still runs.
    let mut c = s.chunk(0);
    c.block_table.truncate(1);
    let (p, d) = b.prefill_and_decode(&c, 1, &[a.row(1, a.prompt.len())]);
    assert!(p.is_err());
    assert!(d.is_ok(), "{d:?}");
}
