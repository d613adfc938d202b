//! Decode products of quantized weights (the 2B's Q4_K_M and Q8_0 shapes): `QuantizedWeight::matmul`
//! (our AVX512-VNNI gemv on the compact blocks, where the CPU has it) against
//! `QuantizedWeight::matmul_candle` (candle's products, what ran before), alternating batches
//! of calls, in GB/s of weight bytes (each product reads the weight once). Run as the
//! lm-service runs them: the weight split into 2 x (pool threads) row slices, candle's own pool
//! at one thread (`CANDLE_NUM_THREADS=1`).
//!
//!     cargo bench -p vlm-backend-cpu --bench quantized_gemv
//!
//! Each shape is held in enough copies to fill 256 MB, taken in turn, so that every product
//! streams its weight from memory as a decode step does (one 6144x2048 Q4_K matrix, 7 MB, would
//! otherwise sit in L3); `VLM_BENCH_COPIES=1` times one copy.
//!
//! `VLM_BENCH_ROWS` (default 1,4), `VLM_BENCH_SECS` per shape and row count (default 4).
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{Device, Tensor};
use half::f16;
use std::borrow::Cow;
use std::time::{Duration, Instant};
use vlm_backend_cpu::kernels::quantized::QuantizedWeight;

/// An (n, k) weight of random blocks with small positive scales (the values do not matter
/// for the time, only that they are finite).
fn random_weight(dtype: GgmlDType, n: usize, k: usize) -> QTensor {
    let bb = dtype.type_size();
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut bytes: Vec<u8> = (0..n * k / dtype.block_size() * bb)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 56) as u8
        })
        .collect();
    let scale = f16::from_f32(0.002).to_bits().to_le_bytes();
    for b in bytes.chunks_exact_mut(bb) {
        match dtype {
            GgmlDType::Q4K => {
                b[0..2].copy_from_slice(&scale);
                b[2..4].copy_from_slice(&scale);
            }
            GgmlDType::Q6K => b[208..210].copy_from_slice(&scale),
            GgmlDType::Q8_0 => b[0..2].copy_from_slice(&scale),
            _ => unreachable!(),
        }
    }
    let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, dtype).unwrap();
    QTensor::new(storage, (n, k)).unwrap()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    std::env::set_var("CANDLE_NUM_THREADS", "1");
    let rows: Vec<usize> = std::env::var("VLM_BENCH_ROWS")
        .unwrap_or_else(|_| "1,4".into())
        .split(',')
        .map(|s| s.trim().parse().expect("VLM_BENCH_ROWS"))
        .collect();
    let secs: f64 = std::env::var("VLM_BENCH_SECS")
        .map(|s| s.parse().expect("VLM_BENCH_SECS"))
        .unwrap_or(4.0);
    // (what, dtype, n = out, k = in)
    let shapes = [
        ("gate/up", GgmlDType::Q4K, 6144, 2048),
        ("down", GgmlDType::Q4K, 2048, 6144),
        ("head", GgmlDType::Q6K, 151936, 2048),
        ("gate/up", GgmlDType::Q8_0, 6144, 2048),
        ("down", GgmlDType::Q8_0, 2048, 6144),
        ("head", GgmlDType::Q8_0, 151936, 2048),
    ];
    let threads = rayon::current_num_threads();
    println!(
        "{threads} threads, {} slices; kquant gemv available: {}",
        2 * threads,
        vlm_backend_cpu::kernels::kquant_gemv::available()
    );
    for (what, dtype, n, k) in shapes {
        let q = random_weight(dtype, n, k);
        let bytes = q.storage_size_in_bytes() as f64;
        let copies = std::env::var("VLM_BENCH_COPIES")
            .map(|s| s.parse().expect("VLM_BENCH_COPIES"))
            .unwrap_or_else(|_| (256e6 / bytes).ceil() as usize)
            .max(1);
        let ws: Vec<QuantizedWeight> = (0..copies)
            .map(|_| QuantizedWeight::new(&q, 2 * threads))
            .collect::<Result<_, _>>()?;
        drop(q);
        for &m in &rows {
            let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?;
            // Warm both (candle builds its repacked tiles on first use).
            for w in &ws {
                w.matmul(&x)?;
                w.matmul_candle(&x)?;
            }
            let per_call = {
                let t = Instant::now();
                ws[0].matmul_candle(&x)?;
                t.elapsed().as_secs_f64()
            };
            // Whole passes over the copies, ~50 ms or more a batch.
            let batch = ((0.05 / per_call) as usize).max(1).next_multiple_of(copies);
            let (mut ours, mut theirs, mut calls) = (Duration::ZERO, Duration::ZERO, 0usize);
            let end = Instant::now() + Duration::from_secs_f64(secs);
            while Instant::now() < end {
                let t = Instant::now();
                for i in 0..batch {
                    std::hint::black_box(ws[i % copies].matmul(&x)?);
                }
                ours += t.elapsed();
                let t = Instant::now();
                for i in 0..batch {
                    std::hint::black_box(ws[i % copies].matmul_candle(&x)?);
                }
                theirs += t.elapsed();
                calls += batch;
            }
            let (a, b) = (
                ours.as_secs_f64() / calls as f64,
                theirs.as_secs_f64() / calls as f64,
            );
            println!(
                "{dtype:?} {what:>8} ({n}x{k}, {:.1} MB x {copies}) m={m}: ours {:8.1} us \
                 {:5.1} GB/s | candle {:8.1} us {:5.1} GB/s | {:.2}x",
                bytes / 1e6,
                a * 1e6,
                bytes / a / 1e9,
                b * 1e6,
                bytes / b / 1e9,
                b / a
            );
        }
    }
    Ok(())
}
