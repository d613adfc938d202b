//! The bf16 GEMM (`backends/cpu/src/kernels/bf16_gemm.rs`: AMX tiles where the CPU has them,
//! else the AVX512-BF16 register tile) alone on the 2B model's shapes: GFLOP/s for prefill and
//! ViT products (many rows), GB/s of weights streamed for decode (few rows).
//!
//!     cargo bench -p vlm-backend-cpu --bench bf16_gemm    (VLM_BENCH_AMX=0: the AVX512 path)
//!
//! `VLM_BENCH_SHAPES=decode` keeps the shapes whose name holds it; `VLM_BENCH_MKN="m,k,n;..."`
//! times those shapes instead (named `custom`). `VLM_BENCH_COLD_MB=256` gives each timed call
//! another copy of B, cycling over that many MB (more than the L3), so the weights come from
//! memory as in the model, whose 3.4 GB never stay in cache; by default one B is reused and
//! stays in L3 when it fits. `VLM_BENCH_AB_SUBRUN=1048576` and/or `VLM_BENCH_AB_A_BLOCK=1048576`
//! also time every shape with AMX sub-runs / A blocks of that many bytes
//! (`BView::with_amx_blocking`), alternating call by call with the default, and print both
//! medians: an A/B that the VM's drift does not decide.
//!
//! With AMX tiles it also times the fused ViT attention task (`kernels/attention_amx.rs`): 256
//! query rows of one 64-wide head against 4096 keys.
use std::time::Instant;
use vlm_backend_cpu::kernels::{
    amx, bf16_dot_available,
    bf16_gemm::{AmxBlocking, TilePrefetch},
    PackedB,
};

/// Whether the products run on AMX tiles: where the CPU has them, unless VLM_BENCH_AMX=0 (the
/// bench's stand-in for the backend's `kernels.amx: off`).
fn use_amx() -> bool {
    amx::available() && !std::env::var("VLM_BENCH_AMX").is_ok_and(|v| v == "0")
}

fn time<F: FnMut()>(mut f: F) -> f64 {
    f(); // warm: pages, caches
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

fn main() {
    if !bf16_dot_available() {
        println!("this CPU has no AVX512-BF16: nothing to measure");
        return;
    }
    println!(
        "{} threads, {}",
        rayon::current_num_threads(),
        if use_amx() {
            "AMX tiles"
        } else {
            "AVX512-BF16 register tile"
        }
    );
    // The tiles' rate on this core now (it moves within minutes on a shared VM: compare
    // figures taken at a similar probe).
    let probe = || {
        if let Some(g) = vlm_backend_cpu::kernels::peak::bf16_peak_gflops(5) {
            println!(
                "AVX512-BF16 peak ({} threads, vdpbf16ps back to back): {g:.0} GFLOP/s",
                rayon::current_num_threads()
            );
        }
        if let Some(p) = use_amx().then(amx::probe).flatten() {
            println!(
                "AMX probe (one thread): products {:.0} GFLOP/s, the tile step on L1-resident operands {:.0} GFLOP/s",
                p.products, p.with_loads
            );
        }
    };
    probe();
    // (what, rows, in, out)
    let shapes = [
        ("prefill512 qkv", 512, 2048, 4096),
        ("prefill512 gate/up", 512, 2048, 12288),
        ("prefill512 down", 512, 6144, 2048),
        ("prefill1041 gate/up", 1041, 2048, 12288),
        ("prefill q/o_proj", 256, 2048, 2048),
        ("prefill gate/up", 256, 2048, 6144),
        ("prefill down", 256, 6144, 2048),
        ("vit qkv", 4096, 1024, 3072),
        ("vit fc1", 4096, 1024, 4096),
        ("vit fc2", 4096, 4096, 1024),
        ("vit attn q.k tile", 256, 64, 512),
        ("vit attn p.v tile", 256, 512, 64),
        ("decode gate/up x1", 1, 2048, 6144),
        ("decode gate/up x8", 8, 2048, 6144),
        ("decode lm_head x1", 1, 2048, 151936),
        ("decode lm_head x8", 8, 2048, 151936),
    ];
    // $VLM_BENCH_SHAPES: only the shapes whose name contains this (e.g. "decode").
    let only = std::env::var("VLM_BENCH_SHAPES").unwrap_or_default();
    let custom: Vec<(&str, usize, usize, usize)> = std::env::var("VLM_BENCH_MKN")
        .ok()
        .map(|v| {
            v.split(';')
                .map(|t| {
                    let d: Vec<usize> = t.split(',').map(|x| x.parse().unwrap()).collect();
                    ("custom", d[0], d[1], d[2])
                })
                .collect()
        })
        .unwrap_or_default();
    let shapes: Vec<_> = if custom.is_empty() {
        shapes.to_vec()
    } else {
        custom
    };
    let shapes: Vec<_> = shapes
        .into_iter()
        .filter(|s| s.0.contains(only.as_str()))
        .collect();
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    if only.is_empty() || "vit attention fused".contains(only.as_str()) {
        fused_attention();
    }
    for (what, m, k, n) in shapes {
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i % 251) as f32 - 125.0) / 300.0)
            .collect();
        let packed = PackedB::from_rows(&w, n, k, k);
        drop(w);
        // $VLM_BENCH_COLD_MB: copies of B to cycle over, one per call.
        let cold_mb = std::env::var("VLM_BENCH_COLD_MB")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(0);
        let copies = (cold_mb << 20).div_ceil(packed.bytes()).max(1);
        let packed: Vec<PackedB> = (0..copies).map(|_| packed.clone()).collect();
        let mut next = 0usize;
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i % 113) as f32 - 56.0) / 100.0)
            .collect();
        // $VLM_BENCH_LDC_PAD: C's row stride is n + this (e.g. 16: rows one cache line apart
        // more than their width, as the attention's scores tile has).
        let ldc = n + std::env::var("VLM_BENCH_LDC_PAD")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(0);
        let mut c = vec![0f32; m * ldc];
        // $VLM_BENCH_AB_PREFETCH=0: the register tile without its L2 prefetch against the
        // default, alternated; =next: decode rows with the next-panel prefetch rather than the
        // in-stream one.
        let ab_kc = std::env::var("VLM_BENCH_AB_PREFETCH")
            .ok()
            .map(|v| match v.as_str() {
                "0" => TilePrefetch::Off,
                "next" => TilePrefetch::NextPanel,
                v => panic!("VLM_BENCH_AB_PREFETCH={v}: 0 or next"),
            });
        let mut call = |blocking: Option<AmxBlocking>, kc: Option<TilePrefetch>| unsafe {
            next += 1;
            let b = packed[next % copies].view().with_amx(use_amx());
            let b = kc.map_or(b, |kc| b.with_prefetch(kc));
            vlm_backend_cpu::kernels::bf16_gemm::gemm(
                m,
                k,
                a.as_ptr(),
                k,
                blocking.map_or(b, |blocking| b.with_amx_blocking(blocking)),
                c.as_mut_ptr(),
                ldc,
                false,
                true,
            )
        };
        let report = |label: &str, s: f64| {
            let gflops = 2.0 * (m * n * k) as f64 / s / 1e9;
            let gbs = packed[0].bytes() as f64 / s / 1e9;
            println!(
                "{what:20} {m:5}x{k:5}->{n:6}: {:8.3} ms  {gflops:7.1} GFLOP/s  {gbs:6.1} GB/s weights{}{label}",
                s * 1e3,
                if copies > 1 { " (cold B)" } else { "" }
            );
        };
        // $VLM_BENCH_AB_SUBRUN / $VLM_BENCH_AB_A_BLOCK: the default against this, alternated.
        let bytes = |var: &str| {
            std::env::var(var)
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
        };
        let (subrun, a_block) = (bytes("VLM_BENCH_AB_SUBRUN"), bytes("VLM_BENCH_AB_A_BLOCK"));
        let alt = AmxBlocking {
            subrun_bytes: subrun.unwrap_or(AmxBlocking::default().subrun_bytes),
            a_block_bytes: a_block.unwrap_or(AmxBlocking::default().a_block_bytes),
        };
        let amx_ab = use_amx() && (subrun.is_some() || a_block.is_some());
        let kc_ab = ab_kc.filter(|_| !use_amx());
        if amx_ab || kc_ab.is_some() {
            let alt_blocking = amx_ab.then_some(alt);
            let (mut base, mut alt_times) = (Vec::new(), Vec::new());
            call(None, None);
            call(alt_blocking, kc_ab);
            for _ in 0..15 {
                for (times, blocking, kc) in [
                    (&mut base, None, None),
                    (&mut alt_times, alt_blocking, kc_ab),
                ] {
                    let t = Instant::now();
                    call(blocking, kc);
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            let median = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            report("  (default blocking, median of 15)", median(&mut base));
            let label = match kc_ab {
                Some(kc) => format!("  (prefetch {kc:?}, median of 15, alternated)"),
                None => format!(
                    "  (A blocks of {} B, sub-runs of {} B, median of 15, alternated)",
                    alt.a_block_bytes, alt.subrun_bytes
                ),
            };
            report(&label, median(&mut alt_times));
        } else {
            report("", time(|| call(None, None)));
        }
        // f32 gemm crate on the same shape (what the f32 paths use).
        if m > 16 {
            let wf: Vec<f32> = vec![0.01; n * k];
            let s32 = time(|| unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    c.as_mut_ptr(),
                    1,
                    n as isize,
                    false,
                    a.as_ptr(),
                    1,
                    k as isize,
                    wf.as_ptr(),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::Rayon(rayon::current_num_threads()),
                )
            });
            println!(
                "{:20} f32 gemm crate: {:8.3} ms  {:7.1} GFLOP/s",
                "",
                s32 * 1e3,
                2.0 * (m * n * k) as f64 / s32 / 1e9
            );
        }
    }
    probe();
}

/// One fused attention task of the 2B ViT: 256 query rows, 4096 keys, hd 64 (the 4096 bucket);
/// `VLM_BENCH_ATTN=ROWSxKEYS` for another (e.g. 512x16384).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn fused_attention() {
    use vlm_backend_cpu::kernels::{attention_amx, BView};
    let (bq, rows) = std::env::var("VLM_BENCH_ATTN")
        .ok()
        .and_then(|v| {
            let (a, b) = v.split_once('x')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .unwrap_or((256usize, 4096usize));
    let hd = 64usize;
    if !attention_amx::supported(use_amx(), rows, hd) {
        return;
    }
    let val = |i: usize| (((i * 2654435761) % 1009) as f32 / 504.5 - 1.0) * 0.5;
    let k: Vec<f32> = (0..rows * hd).map(val).collect();
    let v: Vec<f32> = (0..rows * hd).map(|i| val(i + 7)).collect();
    let kp = PackedB::from_rows(&k, rows, hd, hd);
    let vt: Vec<f32> = (0..hd * rows)
        .map(|i| v[(i % rows) * hd + i / rows])
        .collect();
    let vp = PackedB::from_rows(&vt, hd, rows, rows);
    let q: Vec<f32> = (0..bq * hd).map(|i| val(i + 3)).collect();
    let mut out = vec![0f32; bq * hd];
    let (kv, vv): (BView, BView) = (kp.view().with_amx(true), vp.view().with_amx(true));
    let s = time(|| unsafe {
        attention_amx::attend(&q, bq, hd, kv, vv, 0..rows, out.as_mut_ptr(), hd)
    });
    let flop = 4.0 * (bq * rows * hd) as f64;
    println!(
        "vit attention fused  {bq:5}x{rows:5} hd {hd}: {:8.3} ms  {:7.1} GFLOP/s (q.k, p.v; softmax between), {:.2} us per query row",
        s * 1e3,
        flop / s / 1e9,
        s * 1e6 / bq as f64
    );
}
