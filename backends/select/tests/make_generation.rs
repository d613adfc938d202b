//! A generated tied checkpoint decodes greedily without collapsing into one repeated token.
use candle_core::DType;
use std::collections::HashSet;
use vlm_backend_cpu::{CpuKernels, CpuOptions};
use vlm_make_model::{make_model, MakeOptions, Preset};
use vlm_model::oracle::Oracle;
use vlm_preprocess::{preprocess_rgb, PreprocessConfig};
use vlm_tokenizer::{ChatMessage, ChatPart, ChatTokenizer};

/// Longest run of one token.
fn longest_run(tokens: &[u32]) -> usize {
    let mut best = 0;
    let mut run = 0;
    for (i, t) in tokens.iter().enumerate() {
        run = if i > 0 && tokens[i - 1] == *t {
            run + 1
        } else {
            1
        };
        best = best.max(run);
    }
    best
}

#[test]
fn tied_tiny_models_do_not_collapse() {
    let img = image::RgbImage::from_fn(160, 96, |x, y| {
        image::Rgb([
            (x * 255 / 159) as u8,
            (y * 255 / 95) as u8,
            ((x ^ y) * 4) as u8,
        ])
    });
    let pixels = preprocess_rgb(&img, &PreprocessConfig::default()).unwrap();
    let (mut repeats, mut steps) = (0, 0);
    for seed in 0..4 {
        let dir = tempfile::tempdir().unwrap();
        let mut opts = MakeOptions::new(Preset::Tiny);
        opts.seed = seed;
        let made = make_model(dir.path(), &opts).unwrap();
        assert!(made.config.tie_word_embeddings);
        let pipeline = Oracle::load(
            &CpuKernels::new(CpuOptions::detect()),
            dir.path(),
            DType::F32,
        )
        .unwrap();
        let tok = ChatTokenizer::from_dir(dir.path()).unwrap();
        let images = pipeline
            .encode_images(std::slice::from_ref(&pixels))
            .unwrap();
        let prompts = [
            tok.encode_prompt(
                &[ChatMessage::user_text(
                    "Tell me a story about a lighthouse keeper.",
                )],
                &[],
            )
            .unwrap(),
            tok.encode_prompt(
                &[ChatMessage::user(vec![
                    ChatPart::Image,
                    ChatPart::Text("Describe the picture.".into()),
                ])],
                &[images[0].tokens()],
            )
            .unwrap(),
        ];
        for (k, ids) in prompts.iter().enumerate() {
            let imgs = if k == 1 { images.clone() } else { Vec::new() };
            let out = pipeline.generate_greedy(ids, &imgs, 32, &[]).unwrap();
            let distinct = out.tokens.iter().collect::<HashSet<_>>().len();
            let run = longest_run(&out.tokens);
            eprintln!("seed {seed} prompt {k}: {distinct} distinct of 32, longest run {run}");
            // never stuck on one token for good
            assert!(
                distinct >= 12 && run < 12,
                "seed {seed} prompt {k}: {distinct} distinct, run {run}: {:?}",
                out.tokens
            );
            repeats += out.tokens.windows(2).filter(|w| w[0] == w[1]).count();
            steps += out.tokens.len() - 1;
        }
    }
    // and repeating the previous token is the exception (a collapsed tied model does it ~always)
    assert!(
        repeats * 5 < steps,
        "{repeats} of {steps} steps repeat the previous token"
    );
}
