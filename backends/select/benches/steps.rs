//! The seam's steps on one backend, timed: one prefill chunk of `--prefill` tokens, decode
//! steps at each batch size of `--batches` (every row at a `--context`-token context), and the
//! ViT at each of `--buckets`; with `--packed N`, N prompts of `--packed-len` tokens beside
//! `--packed-decode` decode rows, as one packed step and as N steps of one chunk each (the
//! two alternated, `--steps` rounds). `cargo bench -p vlm-backends --bench steps --
//! [--backend cuda] [--dtype bf16] [--prefill 1024] [--batches 1,8,32,64] [--context 1024]
//! [--buckets 1024,4096,16384] [--steps 20] [--packed 4 --packed-len 128 --packed-decode 0]`; on a GPU build with `--features cuda` (scripts/gpu-check.sh
//! runs it). The checkpoint is `$VLM_BENCH_MODEL`, else the tiny test fixture. Decode rows read
//! whatever the cache holds at their positions (timing only: the KV values do not change the
//! work). Measures only; asserts nothing about time.
use std::time::Instant;
use vlm_backends::{LmLoad, VisionLoad};
use vlm_compute::{DecodeRow, PixelValues, PrefillChunk};
use vlm_config::{BackendChoice, Dtype, KernelConfig};

mod common;
use common::arg;

fn list(s: &str) -> Vec<usize> {
    s.split(',').filter_map(|x| x.trim().parse().ok()).collect()
}

/// One line of the table: the step, its median time, and the units (tokens, rows, patches) per
/// second.
fn row(name: impl std::fmt::Display, secs: f64, per_s: f64) {
    println!("{:<28} {:>12.2} {:>14.0}", name, secs * 1e3, per_s);
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let dir = common::bench_model();
    let backend = match arg(&args, "--backend", "auto").as_str() {
        "cpu" => BackendChoice::Cpu,
        "candle" => BackendChoice::Candle,
        "cuda" => BackendChoice::Cuda,
        _ => BackendChoice::Auto,
    };
    let dtype = match arg(&args, "--dtype", "f32").as_str() {
        "bf16" => Dtype::Bf16,
        "f16" => Dtype::F16,
        _ => Dtype::F32,
    };
    let prefill = arg(&args, "--prefill", "1024").parse::<usize>()?;
    let batches = list(&arg(&args, "--batches", "1,8,32,64"));
    let context = arg(&args, "--context", "1024").parse::<usize>()?;
    let buckets = list(&arg(&args, "--buckets", "1024,4096,16384"));
    let steps = arg(&args, "--steps", "20").parse::<usize>()?.max(1);
    let packed = arg(&args, "--packed", "0").parse::<usize>()?;
    let packed_len = arg(&args, "--packed-len", "128").parse::<usize>()?.max(1);
    let packed_decode = arg(&args, "--packed-decode", "0").parse::<usize>()?;
    let devices = list(&arg(&args, "--devices", "0"))
        .into_iter()
        .map(|d| d as u32)
        .collect::<Vec<_>>();
    let kernels = KernelConfig {
        backend,
        ..KernelConfig::default()
    };

    // LM: blocks for the largest batch at `context` + the decode steps, plus the prefill.
    let block_len = 256;
    let max_batch = batches
        .iter()
        .copied()
        .chain([packed_decode])
        .max()
        .unwrap_or(1);
    let per_row = (context + steps + 1).div_ceil(block_len);
    let per_prompt = packed_len.div_ceil(block_len);
    let num_blocks = max_batch * per_row + prefill.div_ceil(block_len) + packed * per_prompt + 1;
    let t = Instant::now();
    let mut lm = vlm_backends::load_lm(&LmLoad {
        model_dir: &dir,
        dtype,
        kv_cache_dtype: vlm_config::KvCacheDtype::Auto,
        kernels: &kernels,
        num_blocks,
        block_len,
        devices: &devices,
    })?;
    let info = lm.info().clone();
    println!(
        "checkpoint {} | LM on {} ({}, {:?}) loaded in {:.1} s | kernels {:?}",
        dir.display(),
        info.device,
        info.backend,
        info.dtype,
        t.elapsed().as_secs_f64(),
        info.kernels
    );
    println!("{:<28} {:>12} {:>14}", "step", "ms (median)", "tokens/s");

    // Prefill: one chunk of `prefill` tokens at the start of a sequence; first run warms up.
    let chunk = PrefillChunk {
        tokens: (0..prefill as u32).map(|i| 1 + i % 1000).collect(),
        start: 0,
        positions: (0..prefill as i64).map(|i| [i; 3]).collect(),
        images: Vec::new(),
        block_table: (0..prefill.div_ceil(block_len) as u32).collect(),
    };
    lm.prefill(&chunk)?;
    let times: Vec<f64> = (0..3)
        .map(|_| {
            let t = Instant::now();
            lm.prefill(&chunk).map(|_| t.elapsed().as_secs_f64())
        })
        .collect::<Result<_, _>>()?;
    let s = median(times);
    row(format!("prefill {prefill} tokens"), s, prefill as f64 / s);

    // Decode: `b` rows, each with its own blocks after the prefill's.
    let first = prefill.div_ceil(block_len) as u32;
    for &b in &batches {
        let rows = |step: usize| -> Vec<DecodeRow> {
            (0..b)
                .map(|r| DecodeRow {
                    token: 1 + r as u32,
                    position: (context + step) as i64,
                    context_len: context + step,
                    block_table: (0..per_row as u32)
                        .map(|j| first + (r * per_row) as u32 + j)
                        .collect(),
                })
                .collect()
        };
        lm.decode(b, &rows(0))?;
        let mut times = Vec::with_capacity(steps);
        for step in 0..steps {
            let r = rows(step);
            let t = Instant::now();
            lm.decode(b, &r)?;
            times.push(t.elapsed().as_secs_f64());
        }
        let s = median(times);
        row(format!("decode batch {b} @ ctx {context}"), s, b as f64 / s);
    }

    // Packed prefill: N prompts' chunks and the decode rows in one step, against N steps of
    // one chunk and the same decode rows each (what the scheduler ran before packing; there
    // the decode rows also advance N tokens instead of one, so with rows the two are not the
    // same work: the prompts' prefill alone is `--packed-decode 0`).
    if packed > 0 {
        let base = first + (max_batch * per_row) as u32;
        let chunks: Vec<PrefillChunk> = (0..packed)
            .map(|p| PrefillChunk {
                tokens: (0..packed_len as u32)
                    .map(|i| 1 + (i + p as u32) % 1000)
                    .collect(),
                start: 0,
                positions: (0..packed_len as i64).map(|i| [i; 3]).collect(),
                images: Vec::new(),
                block_table: (0..per_prompt as u32)
                    .map(|j| base + (p * per_prompt) as u32 + j)
                    .collect(),
            })
            .collect();
        let rows: Vec<DecodeRow> = (0..packed_decode)
            .map(|r| DecodeRow {
                token: 1 + r as u32,
                position: context as i64,
                context_len: context,
                block_table: (0..per_row as u32)
                    .map(|j| first + (r * per_row) as u32 + j)
                    .collect(),
            })
            .collect();
        let bucket = packed_decode.max(1);
        let mut together = Vec::with_capacity(steps);
        let mut apart = Vec::with_capacity(steps);
        for round in 0..=steps {
            let t = Instant::now();
            let out = lm.packed_step(&chunks, bucket, &rows);
            out.decode?;
            for c in out.chunks {
                c?;
            }
            let packed_s = t.elapsed().as_secs_f64();
            let t = Instant::now();
            for c in &chunks {
                let out = lm.packed_step(std::slice::from_ref(c), bucket, &rows);
                out.decode?;
                for c in out.chunks {
                    c?;
                }
            }
            if round > 0 {
                // round 0 warms up
                together.push(packed_s);
                apart.push(t.elapsed().as_secs_f64());
            }
        }
        let tokens = (packed * packed_len) as f64;
        for (name, times) in [("packed", together), ("one chunk a step", apart)] {
            let s = median(times);
            row(
                format!("{packed}x{packed_len} + {packed_decode} rows, {name}"),
                s,
                tokens / s,
            );
        }
    }
    drop(lm);

    // ViT: a square image of about each bucket's patches.
    if !buckets.is_empty() {
        let vis = vlm_backends::load_vision(&VisionLoad {
            model_dir: &dir,
            dtype,
            kernels: &kernels,
            buckets: &buckets,
            devices: &devices[..1],
        })?
        .remove(0);
        let cfg = vlm_compute::Qwen3VlConfig::from_dir(&dir)?;
        let dim = cfg.vision.patch_dim();
        for &bucket in vis.buckets().to_vec().iter() {
            let side = ((bucket as f64).sqrt() as usize / 2 * 2).max(2);
            let pv = PixelValues {
                values: (0..side * side * dim)
                    .map(|i| ((i % 97) as f32 - 48.0) / 50.0)
                    .collect(),
                grid_thw: [1, side, side],
            };
            vis.encode_in(bucket, &pv)?;
            let times: Vec<f64> = (0..3)
                .map(|_| {
                    let t = Instant::now();
                    vis.encode_in(bucket, &pv)
                        .map(|_| t.elapsed().as_secs_f64())
                })
                .collect::<Result<_, _>>()?;
            let s = median(times);
            row(
                format!("vit bucket {bucket} ({side}x{side})"),
                s,
                (side * side) as f64 / s,
            );
        }
    }
    Ok(())
}
