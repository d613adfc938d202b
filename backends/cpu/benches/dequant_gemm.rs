//! The weight-only products (`backends/cpu/src/kernels/dequant_gemm.rs`: W4A16 4-bit and FP8
//! e4m3 codes) on the 2B model's decoder shapes against the bf16 GEMM on the same shapes,
//! alternating: decode rows (1 and 8) in GB/s of the weight's bytes as held (each call takes another
//! copy, cycling over 512 MB of codes, so the weights come from memory as in the model),
//! prefill rows (512) in GFLOP/s with their share of the bf16 products' measured peak (AMX
//! tiles where the CPU has them, as the model runs both).
//!
//!     cargo bench -p vlm-backend-cpu --bench dequant_gemm
mod common;

use common::{best, SHAPES};
use vlm_backend_cpu::kernels::dequant_gemm::{Codec, DequantWeight, Fp8E4M3, Int4};
use vlm_backend_cpu::kernels::{amx, bf16_dot_available, matmul_packed, peak, PackedB};

fn lcg(seed: u64) -> impl FnMut() -> u32 {
    let mut s = seed;
    move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 33) as u32
    }
}

fn run<C: Codec>(label: &str, code: impl Fn(u32) -> u8, bf_peak: f64) {
    let mut g = lcg(7);
    for (name, n, k) in SHAPES {
        let codes: Vec<u8> = (0..n * k).map(|_| code(g())).collect();
        let make = || DequantWeight::<C>::new(n, k, 128, &codes, |_, _| 0.01).with_amx(true);
        let bytes = make().bytes();
        let copies = ((512 << 20) / bytes).max(1);
        let ws: Vec<DequantWeight<C>> = (0..copies).map(|_| make()).collect();
        let wf: Vec<f32> = (0..n * k).map(|i| (i % 13) as f32 * 0.01 - 0.06).collect();
        let packed: Vec<std::sync::Arc<PackedB>> = (0..(copies * bytes / (2 * n * k)).max(1))
            .map(|_| std::sync::Arc::new(PackedB::from_rows(&wf, n, k, k).with_amx(true)))
            .collect();
        for m in [1usize, 8, 512] {
            let x: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect();
            let xt =
                candle_core::Tensor::from_slice(&x, (m, k), &candle_core::Device::Cpu).unwrap();
            let reps = if m < 16 { 200 } else { 5 };
            let (mut tq, mut tb) = (f64::MAX, f64::MAX);
            let (mut i, mut j) = (0, 0);
            for _ in 0..reps {
                tq = tq.min(best(1, || {
                    i = (i + 1) % ws.len();
                    std::hint::black_box(ws[i].matmul(&x, m));
                }));
                tb = tb.min(best(1, || {
                    j = (j + 1) % packed.len();
                    std::hint::black_box(matmul_packed(&xt, &packed[j]).unwrap());
                }));
            }
            let (a, b) = if m < 16 {
                (
                    format!("{:.1} GB/s", bytes as f64 / tq / 1e9),
                    format!("{:.1} GB/s", (2 * n * k) as f64 / tb / 1e9),
                )
            } else {
                let flops = 2.0 * (m * n * k) as f64;
                let r = |t: f64| {
                    format!(
                        "{:.0} GFLOP/s ({:.0}% of peak)",
                        flops / t / 1e9,
                        100.0 * flops / t / 1e9 / bf_peak
                    )
                };
                (r(tq), r(tb))
            };
            println!(
                "| {label} | {name} {n}x{k} | {m} | {a} | {b} | {:.2} |",
                tq / tb
            );
        }
    }
}

fn main() {
    if !bf16_dot_available() {
        println!("this CPU lacks AVX512-BF16: nothing to compare");
        return;
    }
    let threads = rayon::current_num_threads();
    // The bf16 products' peak: the tiles' where the CPU has them (per core: times the
    // threads), else `vdpbf16ps`.
    let bf_peak = match amx::probe() {
        Some(p) => p.products * threads as f64,
        None => peak::bf16_peak_gflops(5).unwrap(),
    };
    println!("{threads} threads; bf16 peak {bf_peak:.0} GFLOP/s");
    println!("| codes | shape | rows | quantized | bf16 | quantized / bf16 time |");
    println!("|---|---|---|---|---|---|");
    run::<Int4>("int4 (W4A16)", |r| (r & 0xF) as u8, bf_peak);
    run::<Fp8E4M3>(
        "fp8 e4m3",
        |r| {
            let c = r as u8;
            if c & 0x7F == 0x7F {
                c ^ 1
            } else {
                c
            }
        },
        bf_peak,
    );
}
