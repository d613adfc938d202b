//! What structured output costs per generated token: the llguidance mask computed and
//! applied to a full logits row, for 8 sequences (one decode step at batch 8), each under its
//! own JSON Schema, on the 2B checkpoint's vocabulary (151936 rows; a generated checkpoint's
//! metadata, no weights). Also the one-off costs: the token trie at start, one compile per
//! request.
//!
//! `cargo bench -p vlm-lm-service --bench structured_mask`
use rand::{Rng, SeedableRng};
use std::time::Instant;
use vlm_lm_service::structured::Grammars;
use vlm_proto::v1 as pb;

/// Resident bytes of this process (VmRSS).
fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn main() {
    // What the compiler holds, per preset.
    for preset in [
        vlm_make_model::Preset::Tiny,
        vlm_make_model::Preset::Qwen3Vl2b,
    ] {
        let dir = tempfile::tempdir().unwrap();
        let opts = vlm_make_model::MakeOptions {
            weights: false,
            ..vlm_make_model::MakeOptions::new(preset)
        };
        let made = vlm_make_model::make_model(dir.path(), &opts).unwrap();
        let before = rss();
        let g = Grammars::load(
            dir.path(),
            made.config.text.vocab_size,
            made.config.eos_token_ids[0],
        );
        let held = rss().saturating_sub(before);
        println!(
            "{}: vocab {}, the compiler holds {:.1} MiB ({:.0} B per token)",
            preset.name(),
            made.config.text.vocab_size,
            held as f64 / (1 << 20) as f64,
            held as f64 / made.config.text.vocab_size as f64
        );
        drop(g);
    }
    let dir = tempfile::tempdir().unwrap();
    let opts = vlm_make_model::MakeOptions {
        weights: false,
        ..vlm_make_model::MakeOptions::new(vlm_make_model::Preset::Qwen3Vl2b)
    };
    let made = vlm_make_model::make_model(dir.path(), &opts).unwrap();
    let vocab = made.config.text.vocab_size;
    let eos = made.config.eos_token_ids[0];
    let t0 = Instant::now();
    let g = Grammars::load(dir.path(), vocab, eos).unwrap();
    println!(
        "vocab {vocab}: trie + slices built in {:.0} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );

    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8},
            "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                        "required": ["city", "zip"], "additionalProperties": false}
        },
        "required": ["name", "age", "tags", "address"],
        "additionalProperties": false
    })
    .to_string();
    let spec = pb::StructuredOutput {
        kind: Some(pb::structured_output::Kind::JsonSchema(schema)),
    };
    let t0 = Instant::now();
    let mut guides: Vec<_> = (0..8).map(|_| g.compile(&spec).unwrap()).collect();
    println!(
        "compile: {:.2} ms per request",
        t0.elapsed().as_secs_f64() * 1e3 / 8.0
    );

    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let mut row = vec![0f32; vocab];
    let (mut steps, mut spent) = (0usize, 0f64);
    let mut per_step = Vec::new();
    while steps < 64 && guides.iter().any(|g| !g.is_done()) {
        let t = Instant::now();
        for guide in guides.iter_mut().filter(|g| !g.is_done()) {
            for x in row.iter_mut() {
                *x = rng.gen();
            }
            guide.mask(&mut row).unwrap();
            let tok = vlm_compute::argmax(&row);
            guide.advance(tok).unwrap();
        }
        let dt = t.elapsed().as_secs_f64();
        // The random row is part of the loop; time it alone to subtract.
        let t = Instant::now();
        for _ in 0..8 {
            for x in row.iter_mut() {
                *x = rng.gen();
            }
        }
        let fill = t.elapsed().as_secs_f64();
        per_step.push((dt - fill).max(0.0));
        spent += (dt - fill).max(0.0);
        steps += 1;
    }
    per_step.sort_by(f64::total_cmp);
    println!(
        "batch 8: {steps} steps, mask+apply+advance {:.2} ms per step (median {:.2}, max {:.2}), {:.3} ms per token",
        spent * 1e3 / steps as f64,
        per_step[steps / 2] * 1e3,
        per_step[steps - 1] * 1e3,
        spent * 1e3 / (steps * 8) as f64
    );
}
