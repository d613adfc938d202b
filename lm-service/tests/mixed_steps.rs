//! A step with prefill chunks of several sequences and decode rows, run through the weights
//! together (`LmBackend::packed_step`), gives every sequence the numbers of the parts run
//! apart: the chunks' logits, the decode rows' logits, and the K/V they leave in the cache
//! (read back by the decode steps after it). The bf16 model on the bf16 kernel
//! (row-independent products) takes the joint path and must match to the bit; f32 runs them
//! apart and must too. A bad block table in one part fails that part alone.
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
            let mut out = b.packed_step(std::slice::from_ref(&c), 1, &rows);
            (out.chunks.remove(0), out.decode)
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
    let out = b.packed_step(&[s.chunk(0)], 1, &[bad]);
    assert!(out.chunks[0].is_ok(), "{:?}", out.chunks[0]);
    assert!(out.decode.is_err());
    // A chunk whose table is too short: the decode row and the other chunk still run.
    let mut c = s.chunk(0);
    c.block_table.truncate(1);
    let out = b.packed_step(&[c, s.chunk(CHUNK)], 1, &[a.row(1, a.prompt.len())]);
    assert!(out.chunks[0].is_err());
    assert!(out.chunks[1].is_ok(), "{:?}", out.chunks[1]);
    assert!(out.decode.is_ok(), "{:?}", out.decode);
}

/// One step of a packed schedule: chunks (sequence, start) and decode rows (sequence).
struct PackedStep {
    chunks: Vec<(usize, usize)>,
    decode: Vec<usize>,
}

fn packed(chunks: &[(usize, usize)], decode: &[usize]) -> PackedStep {
    PackedStep {
        chunks: chunks.to_vec(),
        decode: decode.to_vec(),
    }
}

/// Every logits vector of `steps` over `seqs`, the parts of each step run together
/// (`packed_step`) or one by one (`prefill`, `decode`). A sequence's next token is the argmax
/// of its last logits; its context grows by each chunk and decode row.
fn packed_schedule(
    b: &mut dyn LmBackend,
    seqs: &[&Seq],
    steps: &[PackedStep],
    joint: bool,
) -> Vec<Vec<f32>> {
    let mut ctx = vec![0usize; seqs.len()];
    let mut tok = vec![0u32; seqs.len()];
    let mut out = Vec::new();
    for step in steps {
        let chunks: Vec<_> = step
            .chunks
            .iter()
            .map(|&(i, at)| seqs[i].chunk(at))
            .collect();
        let rows: Vec<_> = step
            .decode
            .iter()
            .map(|&i| seqs[i].row(tok[i], ctx[i]))
            .collect();
        let bucket = rows.len().next_power_of_two();
        let (c, d) = if joint {
            let o = b.packed_step(&chunks, bucket, &rows);
            (o.chunks, o.decode)
        } else {
            let d = if rows.is_empty() {
                Ok(Vec::new())
            } else {
                b.decode(bucket, &rows)
            };
            (chunks.iter().map(|c| b.prefill(c)).collect(), d)
        };
        for (&(i, _), (logits, chunk)) in step.chunks.iter().zip(c.into_iter().zip(&chunks)) {
            let logits = logits.unwrap();
            tok[i] = vlm_compute::argmax(&logits);
            ctx[i] += chunk.tokens.len();
            out.push(logits);
        }
        for (&i, logits) in step.decode.iter().zip(d.unwrap()) {
            tok[i] = vlm_compute::argmax(&logits);
            ctx[i] += 1;
            out.push(logits);
        }
    }
    out
}

#[test]
fn packed_chunks_of_several_sequences_give_their_numbers_apart() {
    let (a, s) = sequences();
    let cfg = Qwen3VlConfig::from_dir(&tiny_dir()).unwrap();
    let text = |n, seed, blocks: std::ops::Range<u32>| {
        let prompt = text_prompt(n, seed);
        Seq {
            layout: PromptLayout::new(&prompt, &[], &cfg).unwrap(),
            table: blocks.collect(),
            prompt,
            images: Vec::new(),
        }
    };
    // A (20 tokens), S (text, image, text: several chunks), C (7 tokens), D (30 tokens).
    let (c, d) = (text(7, 31, 30..34), text(30, 41, 40..46));
    let seqs = [&a, &s, &c, &d];
    assert!(a.prompt.len() <= CHUNK && s.prompt.len() > 2 * CHUNK);
    let mut steps = vec![
        packed(&[(0, 0)], &[]),
        // Three sequences' first chunks with A's decode row; C's prompt ends here. S's image
        // rows sit after other chunks' rows.
        packed(&[(2, 0), (1, 0), (3, 0)], &[0]),
        // D's prompt ends here.
        packed(&[(3, CHUNK), (1, CHUNK)], &[0, 2]),
    ];
    for at in (2 * CHUNK..s.prompt.len()).step_by(CHUNK) {
        steps.push(packed(&[(1, at)], &[0, 2, 3]));
    }
    steps.push(packed(&[], &[0, 1, 2, 3]));
    steps.push(packed(&[], &[0, 1, 2, 3]));
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let want = packed_schedule(backend(dtype).as_mut(), &seqs, &steps, false);
        let got = packed_schedule(backend(dtype).as_mut(), &seqs, &steps, true);
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g.iter().zip(w).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{dtype:?}: logits {i} differ between the packed and the one-by-one step"
            );
        }
    }
}
