//! Drift of each quantization scheme from the checkpoint it was made from (issue 46): the
//! checkpoint in bf16 and its GGUF pairs and W8A8 directory (`vlm quantize`'s schemes; `w8a8`
//! names the latter) on the same prompts, kept
//! out of CI. For each prompt and each of four cut points, the next-token logits after the
//! prefix: top-1 agreement with bf16, and KL(bf16 || scheme) of the softmaxes (nats).
//!
//!   VLM_DRIFT_MODEL=/path/to/bf16-checkpoint [VLM_DRIFT_SCHEMES=f32,q8_0,q4_k_m] \
//!     cargo bench -p vlm-backends --bench quant_drift
//!
//! The LM alone (text prompts), on the CPU kernels, as it is served (float tensors in bf16).
//! `f32` is the checkpoint itself computed in f32: the drift bf16 compute alone causes, the
//! floor the schemes are read against. The reference's mean top-1 margin (logit gap to the
//! runner-up) is printed too: a random checkpoint's next-token distributions are nearly
//! flat, so its top-1 agreement is far below a trained model's.
use std::path::Path;
use std::time::Instant;
use vlm_backend_cpu::{CpuKernels, CpuOptions};
use vlm_model::gguf::{materialize, quantize_checkpoint, Scheme};
use vlm_model::oracle::Oracle;
use vlm_model::DType;

const PROMPTS: &[&str] = &[
    "Explain why the sky is blue to a ten-year-old.",
    "Write a haiku about a lighthouse in winter.",
    "What are the main differences between TCP and UDP?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Give me a recipe for a quick vegetarian pasta dinner.",
    "How does a transformer neural network process a sentence?",
    "List five tips for staying focused while working from home.",
    "Translate 'Where is the train station?' into French and German.",
    "Why do cats purr, and what does it mean?",
    "Describe the water cycle step by step.",
    "What is the difference between a virus and a bacterium?",
    "Write a short, polite email declining a meeting invitation.",
    "How do I compute the derivative of x squared times sine x?",
    "What should I pack for a three-day hiking trip in the mountains?",
    "Explain what a hash table is and when to use one.",
    "Tell me a fun fact about octopuses.",
];

/// Next-token logits after each of four prefixes of each prompt.
fn logits(oracle: &Oracle<CpuKernels>, prompts: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    for ids in prompts {
        for q in 1..=4 {
            let cut = (ids.len() * q / 4).max(1);
            let l = oracle.prefill(&ids[..cut], &[]).expect("prefill");
            out.push(l.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap());
        }
    }
    out
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let z = x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
    x.iter().map(|&v| v as f64 - z).collect()
}

fn argmax(x: &[f32]) -> usize {
    (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b })
}

/// (top-1 agreement, mean KL, max KL) of `q` against `p`.
fn drift(p: &[Vec<f32>], q: &[Vec<f32>]) -> (f64, f64, f64) {
    let (mut agree, mut sum, mut max) = (0usize, 0f64, 0f64);
    for (a, b) in p.iter().zip(q) {
        agree += (argmax(a) == argmax(b)) as usize;
        let (la, lb) = (log_softmax(a), log_softmax(b));
        let kl: f64 = la.iter().zip(&lb).map(|(x, y)| x.exp() * (x - y)).sum();
        sum += kl;
        max = max.max(kl);
    }
    let n = p.len() as f64;
    (agree as f64 / n, sum / n, max)
}

fn file_bytes(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

fn main() {
    let Ok(model) = std::env::var("VLM_DRIFT_MODEL") else {
        eprintln!("set VLM_DRIFT_MODEL to a bf16 checkpoint directory");
        return;
    };
    let model = Path::new(&model);
    let names = std::env::var("VLM_DRIFT_SCHEMES").unwrap_or_else(|_| "f32,q8_0,q4_k_m".into());
    let k = CpuKernels::new(CpuOptions::detect());
    let tok = vlm_tokenizer::ChatTokenizer::from_dir(model).expect("the checkpoint's tokenizer");
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| tok.encode(p).expect("encoding"))
        .collect();
    let t = Instant::now();
    let reference = {
        let o = Oracle::load_text_only(&k, model, DType::BF16).expect("loading bf16");
        logits(&o, &prompts)
    };
    let margin = reference
        .iter()
        .map(|l| {
            let mut s = l.clone();
            s.sort_by(|a, b| b.total_cmp(a));
            (s[0] - s[1]) as f64
        })
        .sum::<f64>()
        / reference.len() as f64;
    println!(
        "bf16: {} next-token distributions from {} prompts in {:.1} s; mean top-1 margin {margin:.3}",
        reference.len(),
        prompts.len(),
        t.elapsed().as_secs_f64()
    );
    println!("\n| scheme | LM file bytes | top-1 agreement | mean KL (nats) | max KL |");
    println!("|---|---|---|---|---|");
    let dir = tempfile::tempdir().expect("a temporary directory");
    for name in names.split(',') {
        if name == "f32" {
            let o = Oracle::load_text_only(&k, model, DType::F32).expect("loading f32");
            let (top1, mean, max) = drift(&reference, &logits(&o, &prompts));
            println!(
                "| f32 compute (no quantization) | - | {:.1}% | {mean:.4} | {max:.4} |",
                100.0 * top1
            );
            continue;
        }
        if name == "w8a8" {
            let out = dir.path().join("w8a8");
            vlm_model::w8a8::quantize_checkpoint_w8a8(model, &out).expect("quantizing");
            let o = Oracle::load_text_only(&k, &out, DType::BF16).expect("loading W8A8");
            let (top1, mean, max) = drift(&reference, &logits(&o, &prompts));
            println!(
                "| W8A8 (compressed-tensors) | {} | {:.1}% | {mean:.4} | {max:.4} |",
                file_bytes(&out.join("model.safetensors")),
                100.0 * top1
            );
            let _ = std::fs::remove_dir_all(&out);
            continue;
        }
        let scheme: Scheme = name.parse().expect("a scheme");
        let lm = dir.path().join(format!("{scheme:?}.gguf"));
        let mmproj = dir.path().join(format!("mmproj-{scheme:?}.gguf"));
        quantize_checkpoint(model, scheme, &lm, &mmproj).expect("quantizing");
        let served = dir.path().join(format!("{scheme:?}"));
        materialize(&lm, &mmproj, &served).expect("materializing");
        let got = {
            let o = Oracle::load_text_only(&k, &served, DType::BF16).expect("loading the pair");
            logits(&o, &prompts)
        };
        let (top1, mean, max) = drift(&reference, &got);
        println!(
            "| {scheme:?} | {} | {:.1}% | {mean:.4} | {max:.4} |",
            file_bytes(&lm),
            100.0 * top1
        );
        let _ = std::fs::remove_file(&lm);
        let _ = std::fs::remove_file(&mmproj);
    }
}
