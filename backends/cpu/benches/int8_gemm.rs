//! The W8A8 products (`backends/cpu/src/kernels/int8_gemm.rs`) on the 2B model's decoder shapes
//! against the bf16 GEMM on the same shapes, alternating: decode rows (1) in GB/s of weights
//! streamed (each call takes another copy, cycling over 512 MB, so the weights come from memory
//! as in the model), prefill rows (512) in GOP/s with their share of the measured `vpdpbusd`
//! and `vdpbf16ps` peaks. Where the CPU has AMX, the prefill rows also run on the tiles
//! (`tdpbusd` for int8, `tdpbf16ps` for bf16), with shares of the tiles' measured rates.
//!
//!     cargo bench -p vlm-backend-cpu --bench int8_gemm
mod common;

use common::{best, SHAPES};
use vlm_backend_cpu::kernels::int8_gemm::{vnni_available, Int8Weight};
use vlm_backend_cpu::kernels::{amx, bf16_dot_available, matmul_packed, peak, PackedB};

fn lcg(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed;
    move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }
}

fn main() {
    if !vnni_available() || !bf16_dot_available() {
        println!("this CPU lacks AVX512-VNNI or AVX512-BF16: nothing to compare");
        return;
    }
    let threads = rayon::current_num_threads();
    let i8_peak = peak::int8_peak_gops(5).unwrap();
    let bf_peak = peak::bf16_peak_gflops(5).unwrap();
    println!(
        "{threads} threads; peaks: vpdpbusd {i8_peak:.0} GOP/s, vdpbf16ps {bf_peak:.0} GFLOP/s"
    );
    // The tiles' rates are per core (the probe runs on one thread): times the threads.
    let tiles = amx::probe().filter(|p| p.int8_products > 0.0).map(|p| {
        let (i8t, bft) = (
            p.int8_products * threads as f64,
            p.products * threads as f64,
        );
        println!(
            "AMX tiles ({threads} threads): tdpbusd {i8t:.0} GOP/s, tdpbf16ps {bft:.0} GFLOP/s; \
             the bf16 tile step with its loads from L1: {:.0} GFLOP/s ({:.0}% of tdpbf16ps)",
            p.with_loads * threads as f64,
            100.0 * p.with_loads / p.products
        );
        (i8t, bft)
    });
    println!("| shape | rows | int8 (VNNI) | bf16 (AVX512) | int8 / bf16 time | int8 (AMX) | bf16 (AMX) | int8 / bf16 time, AMX |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut g = lcg(1);
    let rate = |ops: f64, t: f64, peak: f64, unit: &str| {
        format!(
            "{:.0} {unit} ({:.0}% of peak)",
            ops / t / 1e9,
            100.0 * ops / t / 1e9 / peak
        )
    };
    for (name, n, k) in SHAPES {
        let values: Vec<i8> = (0..n * k).map(|_| (g() * 127.0) as i8).collect();
        let scales = vec![0.01f32; n];
        let wf: Vec<f32> = values.iter().map(|&v| v as f32 * 0.01).collect();
        let copies = (512 << 20) / (n * k);
        let int8: Vec<Int8Weight> = (0..copies)
            .map(|_| Int8Weight::new(n, k, &values, &scales))
            .collect();
        let bf16_copies = copies / 2;
        let packed: Vec<std::sync::Arc<PackedB>> = (0..bf16_copies.max(1))
            .map(|_| std::sync::Arc::new(PackedB::from_rows(&wf, n, k, k)))
            .collect();
        for m in [1usize, 512] {
            let x: Vec<f32> = (0..m * k).map(|_| g()).collect();
            let xt =
                candle_core::Tensor::from_slice(&x, (m, k), &candle_core::Device::Cpu).unwrap();
            let (mut i, mut j) = (0, 0);
            let reps = if m == 1 { 200 } else { 5 };
            let ti = best(reps, || {
                i = (i + 1) % int8.len();
                std::hint::black_box(int8[i].matmul(&x, m));
            });
            let tb = best(reps, || {
                j = (j + 1) % packed.len();
                std::hint::black_box(matmul_packed(&xt, &packed[j]).unwrap());
            });
            let ops = 2.0 * (m * n * k) as f64;
            let (a, b) = if m == 1 {
                (
                    format!("{:.1} GB/s", (n * k) as f64 / ti / 1e9),
                    format!("{:.1} GB/s", (2 * n * k) as f64 / tb / 1e9),
                )
            } else {
                (
                    rate(ops, ti, i8_peak, "GOP/s"),
                    rate(ops, tb, bf_peak, "GFLOP/s"),
                )
            };
            // Prefill rows on the tiles: one copy each (compute-bound, B from L2 after the
            // first pass), alternating with each other.
            let on_tiles = match tiles {
                Some((i8t, bft)) if m > 1 => {
                    let wi = Int8Weight::new(n, k, &values, &scales).with_amx(true);
                    let wb = std::sync::Arc::new(PackedB::from_rows(&wf, n, k, k).with_amx(true));
                    let (mut tia, mut tba) = (f64::MAX, f64::MAX);
                    for _ in 0..reps {
                        tia = tia.min(best(1, || {
                            std::hint::black_box(wi.matmul(&x, m));
                        }));
                        tba = tba.min(best(1, || {
                            std::hint::black_box(matmul_packed(&xt, &wb).unwrap());
                        }));
                    }
                    format!(
                        "{} | {} | {:.2}",
                        rate(ops, tia, i8t, "GOP/s"),
                        rate(ops, tba, bft, "GFLOP/s"),
                        tia / tba
                    )
                }
                _ => "- | - | -".into(),
            };
            println!(
                "| {name} {n}x{k} | {m} | {a} | {b} | {:.2} | {on_tiles} |",
                ti / tb
            );
        }
    }
}
