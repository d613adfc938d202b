//! The decode-path linear layer alone: `Linear::forward` on a few rows for the 2B model's weight
//! shapes, per storage dtype, in GB/s of weights streamed (each weight is read once per call).
//!
//!     cargo bench -p vlm-backend-cpu --bench decode_gemv
//!
//! `VLM_BENCH_ROWS` (default 1,2,4,8), `VLM_BENCH_DTYPES` (default f32,f16,bf16).
use candle_core::{DType, Device, Tensor};
use std::time::Instant;
use vlm_backend_cpu::{CpuKernels, CpuOptions};
use vlm_model::text::Linear;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rows: Vec<usize> = std::env::var("VLM_BENCH_ROWS")
        .unwrap_or_else(|_| "1,2,4,8".into())
        .split(',')
        .map(|s| s.trim().parse().expect("VLM_BENCH_ROWS"))
        .collect();
    let dtypes = std::env::var("VLM_BENCH_DTYPES").unwrap_or_else(|_| "f32,f16,bf16".into());
    // (name, in, out) of the 2B decoder; lm_head last.
    let shapes = [
        ("q_proj/o_proj", 2048, 2048),
        ("gate/up_proj", 2048, 6144),
        ("down_proj", 6144, 2048),
        ("lm_head", 2048, 151936),
    ];
    println!("{} threads", rayon::current_num_threads());
    let kernels = CpuKernels::new(CpuOptions::detect());
    for name in dtypes.split(',') {
        let dtype = match name.trim() {
            "f32" => DType::F32,
            "f16" => DType::F16,
            "bf16" => DType::BF16,
            other => panic!("unknown dtype {other}"),
        };
        for &(what, k, n) in &shapes {
            let w = Tensor::randn(0f32, 0.02, (n, k), &Device::Cpu)?.to_dtype(dtype)?;
            let lin = Linear::from_weight(&kernels, w)?;
            let bytes = (n * k * dtype.size_in_bytes()) as f64;
            // Enough calls to stream ~4 GB.
            let reps = ((4e9 / bytes) as usize).clamp(3, 400);
            let mut line = format!("{name:>4} {what:>14} ({k}x{n}):");
            for &m in &rows {
                let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?;
                lin.forward(&x)?;
                let t = Instant::now();
                for _ in 0..reps {
                    std::hint::black_box(lin.forward(&x)?);
                }
                let s = t.elapsed().as_secs_f64() / reps as f64;
                line += &format!("  m={m}: {:7.3} ms {:5.1} GB/s", s * 1e3, bytes / s / 1e9);
            }
            println!("{line}");
        }
    }
    Ok(())
}
