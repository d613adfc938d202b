//! Decoder speed: prefill of 256 tokens, decode step time at batch 1, 2, 4, 8 at context 256,
//! and the share of the measured memory read bandwidth a batch-1 step reaches (decode at batch 1
//! reads every LM weight once per step).
//!
//!     cargo bench -p vlm-backend-cpu --bench decode
//!
//! Environment:
//! * `VLM_BENCH_MODEL`: checkpoint directory (default: the tiny golden fixture checkpoint).
//! * `VLM_BENCH_MAKE`: a `make-model` preset (`qwen3-vl-2b`, `tiny`); when `VLM_BENCH_MODEL`
//!   has no config.json, a random checkpoint of that preset is written there first.
//! * `VLM_BENCH_DTYPES`: weight storage dtypes to measure, comma-separated (default f32,f16,bf16).
//! * `VLM_BENCH_BATCHES` (default 1,2,4,8), `VLM_BENCH_STEPS` (timed decode steps, default 5),
//!   `VLM_BENCH_CONTEXT` (default 256), `VLM_BENCH_CHUNK` (prefill chunk, default 128),
//!   `VLM_BENCH_PREFILL_RUNS` (default 2, the best is reported; 0 skips prefill: decode then
//!   attends to a zero cache, which costs the same), `VLM_BENCH_KV_DTYPES` (KV cache dtypes,
//!   comma-separated, timed step by step in turn; default the model's own: bf16 for bf16
//!   weights, else f32).
//! * `VLM_BENCH_GGUF`: a `vlm quantize` scheme (`q4_k_m`, `q8_0`): the checkpoint is quantized
//!   once into `$TMPDIR/vlm-bench-<name>.<scheme>/` and decoded from that GGUF pair, as the
//!   lm-service serves it (candle's pool at one thread); a step then reads the LM file's
//!   bytes. Use with `VLM_BENCH_DTYPES=f32` (the dtype of the float tensors and activations).
//! * `VLM_BENCH_SIMD=off`: the backend's `kernels.simd: off` (the scalar gemv; candle's
//!   products for quantized weights), to compare a GGUF decode with and without our gemv.
use candle_core::{DType, Device};
use std::path::{Path, PathBuf};
use std::time::Instant;
use vlm_backend_cpu::{CpuKernels, CpuOptions};
use vlm_compute::{DecodeRow, PrefillChunk, Qwen3VlConfig};
use vlm_model::text::{BatchInput, DecodeBatch, PagedKvCache, TextModel};

fn env_list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Best-of-5 GB/s of summing a 1 GiB f32 buffer with every rayon thread.
fn read_bandwidth() -> f64 {
    use rayon::prelude::*;
    let n = 1usize << 28; // 1 GiB of f32
    let buf: Vec<f32> = (0..n).into_par_iter().map(|i| (i % 7) as f32).collect();
    let mut best = f64::MAX;
    let mut sink = 0f32;
    for _ in 0..5 {
        let t = Instant::now();
        let s: f32 = buf
            .par_chunks(1 << 16)
            .map(|c| {
                // 16 independent lanes so the sum is load-bound, not add-latency-bound.
                let mut acc = [0f32; 16];
                for v in c.chunks_exact(16) {
                    for (a, x) in acc.iter_mut().zip(v) {
                        *a += x;
                    }
                }
                acc.iter().sum::<f32>()
            })
            .sum();
        best = best.min(t.elapsed().as_secs_f64());
        sink += s;
    }
    std::hint::black_box(sink);
    (n * 4) as f64 / best / 1e9
}

/// The backend's options: detected, `kernels.simd` from `VLM_BENCH_SIMD` (`off`).
fn options() -> Result<CpuOptions, Box<dyn std::error::Error>> {
    let mut cfg = vlm_config::KernelConfig::default();
    if std::env::var("VLM_BENCH_SIMD").as_deref() == Ok("off") {
        cfg.simd = vlm_config::Toggle::Off;
    }
    Ok(CpuOptions::resolve(&cfg)?)
}

fn parse_dtype(s: &str) -> DType {
    match s {
        "f32" => DType::F32,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        // A KV cache's only (VLM_BENCH_KV_DTYPES).
        "f8e4m3" => DType::F8E4M3,
        other => panic!("unknown dtype {other:?} (f32, f16, bf16; f8e4m3 for the KV cache)"),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The steps run on a pool thread, as the LM engine's do (`pool.install`): the calling
    // thread is one of the pool's, not a thread waiting outside it.
    let pool = rayon::ThreadPoolBuilder::new().build()?;
    pool.install(|| run().map_err(|e| e.to_string()))?;
    Ok(())
}

/// The served directory of `dir` quantized with `scheme` (written once) and the bytes of its
/// LM file.
fn gguf_served(dir: &Path, scheme: &str) -> Result<(PathBuf, u64), Box<dyn std::error::Error>> {
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
    let out = std::env::temp_dir().join(format!("vlm-bench-{}.{scheme}", name.unwrap_or_default()));
    let (lm, mmproj) = (out.join("lm.gguf"), out.join("mmproj-lm.gguf"));
    if !mmproj.is_file() {
        std::fs::create_dir_all(&out)?;
        eprintln!(
            "quantizing {} to {scheme} in {}",
            dir.display(),
            out.display()
        );
        let t = Instant::now();
        vlm_model::gguf::quantize_checkpoint(dir, scheme.parse()?, &lm, &mmproj)?;
        eprintln!("  done in {:.1} s", t.elapsed().as_secs_f64());
    }
    let served = out.join("served");
    vlm_model::gguf::materialize(&lm, &mmproj, &served)?;
    Ok((served, std::fs::metadata(&lm)?.len()))
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut dir = std::env::var_os("VLM_BENCH_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny"));
    if !dir.join("config.json").is_file() {
        if let Ok(preset) = std::env::var("VLM_BENCH_MAKE") {
            let preset: vlm_make_model::Preset = preset.parse()?;
            eprintln!(
                "writing a random {} checkpoint to {}",
                preset.name(),
                dir.display()
            );
            let t = Instant::now();
            vlm_make_model::make_model(&dir, &vlm_make_model::MakeOptions::new(preset))?;
            eprintln!("  done in {:.1} s", t.elapsed().as_secs_f64());
        }
    }
    let mut gguf_bytes = None;
    if let Ok(scheme) = std::env::var("VLM_BENCH_GGUF") {
        // As the lm-service runs quantized products (see its main).
        if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
            std::env::set_var("CANDLE_NUM_THREADS", "1");
        }
        let (served, bytes) = gguf_served(&dir, &scheme)?;
        dir = served;
        gguf_bytes = Some(bytes as usize);
    }
    let cfg = Qwen3VlConfig::from_dir(&dir)?;
    let t = &cfg.text;
    let context = env_usize("VLM_BENCH_CONTEXT", 256);
    let chunk = env_usize("VLM_BENCH_CHUNK", 128);
    let steps = env_usize("VLM_BENCH_STEPS", 5).max(1);
    let batches: Vec<usize> = env_list("VLM_BENCH_BATCHES", "1,2,4,8")
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    println!(
        "model {} ({}): {} layers, hidden {}, vocab {}; {} threads",
        cfg.model_id,
        dir.display(),
        t.num_hidden_layers,
        t.hidden_size,
        t.vocab_size,
        rayon::current_num_threads()
    );
    let bw = read_bandwidth();
    println!("memory read bandwidth (sum of a 1 GiB f32 buffer, best of 5): {bw:.1} GB/s");

    let top = cfg
        .image_token_id
        .min(cfg.vision_start_token_id)
        .min(t.vocab_size as u32);
    let ids: Vec<u32> = (0..context as u32).map(|i| (i * 7919 + 13) % top).collect();
    let positions: Vec<[i64; 3]> = (0..context as i64).map(|i| [i; 3]).collect();

    for dtype_name in env_list("VLM_BENCH_DTYPES", "f32,f16,bf16") {
        let dtype = parse_dtype(&dtype_name);
        let t0 = Instant::now();
        let model = TextModel::load(&CpuKernels::new(options()?), &dir, dtype)?;
        let load_s = t0.elapsed().as_secs_f64();
        // Bytes a decode step streams: every layer weight plus lm_head (the embedding lookup
        // reads only a few rows).
        let s = dtype.size_in_bytes();
        let embed = t.vocab_size * t.hidden_size * s;
        let read_bytes = gguf_bytes.unwrap_or_else(|| {
            model.weight_bytes() - if cfg.tie_word_embeddings { 0 } else { embed }
        });
        println!(
            "\n[{dtype_name}] weights {:.2} GB (loaded in {load_s:.1} s); a decode step reads {:.2} GB",
            gguf_bytes.unwrap_or(model.weight_bytes()) as f64 / 1e9,
            read_bytes as f64 / 1e9
        );

        // Blocks of `context` tokens: block 0 holds the prefilled context, shared by every
        // decode row; row r writes its token into its own block 1 + r.
        let max_b = batches.iter().copied().max().unwrap_or(1);
        // One cache per KV dtype under test ($VLM_BENCH_KV_DTYPES, default the model's own).
        let kv_dtypes: Vec<DType> = match std::env::var("VLM_BENCH_KV_DTYPES") {
            Ok(list) => list.split(',').map(|d| parse_dtype(d.trim())).collect(),
            Err(_) => vec![model.kv_dtype()],
        };
        let mut caches = Vec::new();
        for &d in &kv_dtypes {
            let cache = PagedKvCache::new(t, 1 + max_b, context, d, &Device::Cpu)?;
            caches.push((d, cache));
        }

        // Prefill `context` tokens in chunks into every cache, `runs` times each, the caches
        // alternating.
        let runs = env_usize("VLM_BENCH_PREFILL_RUNS", 2);
        let mut prefill_runs = vec![Vec::new(); caches.len()];
        for _ in 0..runs {
            for (i, (_, kv)) in caches.iter_mut().enumerate() {
                let t = Instant::now();
                let mut start = 0;
                while start < context {
                    let end = (start + chunk).min(context);
                    let c = PrefillChunk {
                        tokens: ids[start..end].to_vec(),
                        start,
                        positions: positions[start..end].to_vec(),
                        images: Vec::new(),
                        block_table: vec![0],
                    };
                    model.forward(&BatchInput::Prefill(c), kv)?;
                    start = end;
                }
                prefill_runs[i].push(t.elapsed().as_secs_f64());
            }
        }
        if runs > 0 {
            for ((d, _), runs) in caches.iter().zip(&prefill_runs) {
                let prefill_s = runs.iter().copied().fold(f64::MAX, f64::min);
                let each: Vec<String> = runs.iter().map(|s| format!("{s:.2}")).collect();
                println!(
                    "prefill {context} tokens (chunks of {chunk}), {d:?} cache: {prefill_s:.3} s ({:.0} tok/s); runs {} s",
                    context as f64 / prefill_s,
                    each.join(", ")
                );
            }
            // The tiles' rate on this core now: on a shared VM it moves within minutes, and
            // the prefill with it (see `amx::probe`).
            if let Some(p) = vlm_backend_cpu::kernels::amx::probe() {
                println!(
                    "AMX probe after the prefill (one thread): products {:.0} GFLOP/s, the GEMM's tile step on L1-resident operands {:.0} GFLOP/s",
                    p.products, p.with_loads
                );
            }
        }

        for &b in &batches {
            let rows: Vec<DecodeRow> = (0..b)
                .map(|r| DecodeRow {
                    token: ids[r % context],
                    position: context as i64,
                    context_len: context,
                    block_table: vec![0, 1 + r as u32],
                })
                .collect();
            let batch = BatchInput::Decode(DecodeBatch {
                rows: rows.into_iter().map(Some).collect(),
            });
            // The caches' steps interleaved, so that each sees the same bandwidth phases.
            let mut times = vec![Vec::with_capacity(steps); caches.len()];
            for (_, kv) in caches.iter_mut() {
                model.forward(&batch, kv)?; // warm-up
            }
            for _ in 0..steps {
                for (i, (_, kv)) in caches.iter_mut().enumerate() {
                    let t = Instant::now();
                    model.forward(&batch, kv)?;
                    times[i].push(t.elapsed().as_secs_f64());
                }
            }
            for ((d, _), times) in caches.iter().zip(&mut times) {
                times.sort_by(|a, b| a.total_cmp(b));
                let med = times[times.len() / 2];
                let gbs = read_bytes as f64 / med / 1e9;
                println!(
                    "decode batch {b} at context {context}, {d:?} cache: {med:.4} s/step (min {:.4}), \
                     {:.1} tok/s, weights streamed at {gbs:.1} GB/s = {:.0}% of measured bandwidth",
                    times[0],
                    b as f64 / med,
                    100.0 * gbs / bw
                );
            }
        }
    }
    Ok(())
}
