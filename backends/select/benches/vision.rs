//! ViT timings per bucket: `cargo bench -p vlm-backends --bench vision -- [--buckets
//! 1024,4096,16384] [--modes f32,candle-f32,f16] [--iters 1] [--warmup 1] [--profile]
//! [--tiles 256x512]`. The
//! checkpoint is `$VLM_BENCH_MODEL` (e.g. the random 2B made by `vlm make-model --preset
//! qwen3-vl-2b`), else the tiny test fixture. Measures only; asserts nothing about time.
//!
//! Modes: `f32` = the CPU backend's bucket engine with f32 weights; `bf16` = the same engine
//! with bf16 weights and products on the bf16 kernel (the candle backend on CPUs without
//! AVX512-BF16); `candle-f32`, `f16` and `candle-bf16` = the candle backend's padded run.
//! `--profile` sets `visual.kernels.profile` (the engine logs its per-phase times).
use std::time::Instant;
use vlm_compute::PixelValues;
use vlm_config::{BackendChoice, Dtype, KernelConfig};

mod common;
use common::arg;

/// Side of a square grid with about `bucket` patches, rounded down to the merge size.
fn grid_for(bucket: usize) -> [usize; 3] {
    let side = ((bucket as f64).sqrt() as usize / 2 * 2).max(2);
    [1, side, side]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let dir = common::bench_model();
    let buckets: Vec<usize> = arg(&args, "--buckets", "1024,4096,16384")
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<Result<_, _>>()?;
    let modes: Vec<String> = arg(&args, "--modes", "f32,f16")
        .split(',')
        .map(|s| s.trim().to_string())
        .collect();
    let iters: usize = arg(&args, "--iters", "1").parse()?;
    let profile = args.iter().any(|a| a == "--profile");
    if profile {
        tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .init();
    }
    let warmup = arg(&args, "--warmup", "1") != "0";
    // `--tiles QxK`: the ViT attention's tiles (query rows, keys), `visual.kernels.attention_tiles`.
    let tiles = arg(&args, "--tiles", "")
        .split_once('x')
        .map(|(q, k)| -> Result<[u32; 2], std::num::ParseIntError> { Ok([q.parse()?, k.parse()?]) })
        .transpose()?;
    println!(
        "checkpoint {} | threads {} | buckets {buckets:?} | iters {iters} (warm-up run at the smallest bucket: {warmup})",
        dir.display(),
        rayon::current_num_threads()
    );
    // What the products could reach on these cores now (the ViT is ~85% bf16 products).
    if let Some(g) = vlm_backend_cpu::kernels::peak::bf16_peak_gflops(5) {
        println!("AVX512-BF16 peak (vdpbf16ps back to back on every thread): {g:.0} GFLOP/s");
    }
    println!(
        "{:<11} {:>7} {:>9} {:>10} {:>12} {:>12} {:>10}",
        "mode", "bucket", "grid", "patches", "seconds", "patches/s", "mem MiB"
    );
    for mode in &modes {
        let (dtype, backend) = match mode.as_str() {
            "f32" => (Dtype::F32, BackendChoice::Cpu),
            "candle-f32" => (Dtype::F32, BackendChoice::Candle),
            "f16" => (Dtype::F16, BackendChoice::Candle),
            "bf16" if vlm_backend_cpu::kernels::bf16_dot_available() => {
                (Dtype::Bf16, BackendChoice::Cpu)
            }
            "bf16" | "candle-bf16" => (Dtype::Bf16, BackendChoice::Candle),
            other => {
                return Err(format!(
                    "unknown mode {other} (f32, bf16, candle-f32, f16, candle-bf16)"
                )
                .into())
            }
        };
        let t = Instant::now();
        let kernels = KernelConfig {
            backend,
            profile,
            attention_tiles: tiles.unwrap_or(KernelConfig::default().attention_tiles),
            ..KernelConfig::default()
        };
        let graphs = vlm_backends::load_vision(&vlm_backends::VisionLoad {
            model_dir: &dir,
            dtype,
            kernels: &kernels,
            buckets: &buckets,
            devices: &[0],
        })?
        .remove(0);
        let load_s = t.elapsed().as_secs_f64();
        let patch_dim = vlm_compute::Qwen3VlConfig::from_dir(&dir)?
            .vision
            .patch_dim();
        eprintln!(
            "{mode}: loaded in {load_s:.2} s ({} backend: {})",
            graphs.info().backend,
            graphs.info().kernels_line()
        );
        let memory = graphs.memory();
        let mut warmed = !warmup;
        for &bucket in &graphs.buckets().to_vec() {
            let grid = grid_for(bucket);
            let n = grid[1] * grid[2];
            // Deterministic pseudo-random pixels in [-1, 1).
            let values: Vec<f32> = (0..n * patch_dim)
                .map(|i| {
                    ((i as u32).wrapping_mul(2654435761) >> 8) as f32 / (1u32 << 23) as f32 - 1.0
                })
                .collect();
            let pv = PixelValues {
                values,
                grid_thw: grid,
            };
            if !warmed {
                graphs.encode(&pv)?;
                warmed = true;
            }
            let mut best = f64::MAX;
            for _ in 0..iters {
                let t = Instant::now();
                let run = graphs.encode(&pv)?;
                best = best.min(t.elapsed().as_secs_f64());
                assert_eq!(run.bucket, bucket);
            }
            println!(
                "{:<11} {:>7} {:>9} {:>10} {:>12.3} {:>12.0} {:>10.0}",
                mode,
                bucket,
                format!("{}x{}", grid[1], grid[2]),
                n,
                best,
                n as f64 / best,
                memory
                    .buckets
                    .iter()
                    .find(|b| b.bucket == bucket)
                    .map_or(0, |b| b.bytes) as f64
                    / (1 << 20) as f64
            );
        }
    }
    Ok(())
}
