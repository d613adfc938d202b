//! ViT timings per bucket: `cargo bench -p vlm-model --bench vision -- [--buckets 1024,4096,16384]
//! [--modes f32,candle-f32,f16] [--iters 1] [--warmup 1]`. The checkpoint is `$VLM_BENCH_MODEL` (e.g. the
//! random 2B made by `vlm make-model --preset qwen3-vl-2b`), else the tiny test fixture.
//! Measures only; asserts nothing about time.
//!
//! Modes: `f32` = the CPU bucket engine with f32 weights; `bf16` = the same engine with bf16
//! weights and products on the AVX512-BF16 kernel (falls back to candle ops on CPUs without
//! it); `candle-f32`, `f16` and `candle-bf16` = the padded run over candle ops.
use candle_core::{DType, Device, Tensor};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use vlm_model::preprocess::PixelValues;
use vlm_model::vision::{GraphBackend, VisionGraphs, VisionModel};

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_string())
}

/// Side of a square grid with about `bucket` patches, rounded down to the merge size.
fn grid_for(bucket: usize) -> [usize; 3] {
    let side = ((bucket as f64).sqrt() as usize / 2 * 2).max(2);
    [1, side, side]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::env::var_os("VLM_BENCH_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny"));
    let buckets: Vec<usize> = arg(&args, "--buckets", "1024,4096,16384")
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<Result<_, _>>()?;
    let modes: Vec<String> = arg(&args, "--modes", "f32,f16")
        .split(',')
        .map(|s| s.trim().to_string())
        .collect();
    let iters: usize = arg(&args, "--iters", "1").parse()?;
    let warmup = arg(&args, "--warmup", "1") != "0";
    println!(
        "checkpoint {} | threads {} | buckets {buckets:?} | iters {iters} (warm-up run at the smallest bucket: {warmup})",
        dir.display(),
        rayon::current_num_threads()
    );
    println!(
        "{:<11} {:>7} {:>9} {:>10} {:>12} {:>12} {:>10}",
        "mode", "bucket", "grid", "patches", "seconds", "patches/s", "mem MiB"
    );
    for mode in &modes {
        let (dtype, backend) = match mode.as_str() {
            "f32" => (DType::F32, GraphBackend::CpuEngine),
            "candle-f32" => (DType::F32, GraphBackend::Candle),
            "f16" => (DType::F16, GraphBackend::Candle),
            "bf16" if vlm_model::cpu::bf16_dot_available() => {
                (DType::BF16, GraphBackend::CpuEngine)
            }
            "bf16" | "candle-bf16" => (DType::BF16, GraphBackend::Candle),
            other => {
                return Err(format!(
                    "unknown mode {other} (f32, bf16, candle-f32, f16, candle-bf16)"
                )
                .into())
            }
        };
        let t = Instant::now();
        let model = Arc::new(VisionModel::load(&dir, &Device::Cpu, dtype)?);
        let load_s = t.elapsed().as_secs_f64();
        let graphs = VisionGraphs::with_backend(model.clone(), &buckets, backend)?;
        let patch_dim = model.config().patch_dim();
        eprintln!("{mode}: loaded in {load_s:.2} s");
        let mut warmed = !warmup;
        for &bucket in &graphs.buckets() {
            let grid = grid_for(bucket);
            let n = grid[1] * grid[2];
            let values = Tensor::randn(0f32, 0.5, (n, patch_dim), &Device::Cpu)?;
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
                graphs.memory_bytes(bucket).unwrap_or(0) as f64 / (1 << 20) as f64
            );
        }
    }
    Ok(())
}
