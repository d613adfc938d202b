//! The memory plan against the services' resident memory on a full-size checkpoint: starts
//! vision-service, then lm-service (one after the other, never together), waits for SERVING,
//! reads `VmRSS` and prints it next to the plan's figure for that service
//! (`vlm_config::plan::cpu_service_bytes(..).resident()`) and the ratio.
//!
//! ```text
//! cargo bench -p vlm-system-tests --bench plan_rss
//! ```
//!
//! * `VLM_BENCH_MODEL`: the checkpoint (default `/work/ckpt/qwen3-vl-2b`, the random 2B one);
//!   skipped with a message when it is absent.
//! * `VLM_BENCH_DTYPE`: the compute dtype of both parts, `f32` (default; the ViT then runs its
//!   f32 bucket engine) or `f16` (half the weight memory).
//! * `VLM_BENCH_BIN_DIR`: where the service binaries are (default: next to `vlm`, built when
//!   missing), e.g. `target/debug` to reuse the test build.
//!
//! The services pre-fault what they reserve (KV pool, ViT workspaces), so RSS after SERVING
//! shows everything the plan counts as resident.
// (The harness allows its own dead code: each user takes a part of it.)
#[path = "../tests/support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use vlm_config::plan::{self, human, ModelDims, Service};

const CONFIG: &str = "\
visual:
  max_seq_len: [1024, 4096, 16384]
  num_devices: 1
  device: [0]
  dtype: DTYPE
dtype: DTYPE
max_seq_len: 4096
kvcache_partition_len: 256
kvcache_num_blocks: 64
batch_size: 8
decoder_batch_sizes: [1, 2, 4, 8]
prefill_chunk_size: 128
num_devices: 1
device: [LM_DEVICE]
";

fn binary(name: &str) -> PathBuf {
    match std::env::var_os("VLM_BENCH_BIN_DIR") {
        Some(dir) => Path::new(&dir).join(name),
        None => support::bin(name),
    }
}

async fn measure(name: &str, model: &Path, config: &Path) -> (u64, Duration) {
    let started = Instant::now();
    let mut p = support::start_service(name, &binary(name), model, config).await;
    let ready = started.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss = support::vm_rss(p.pid());
    p.terminate();
    if p.wait_exit(Duration::from_secs(30)).is_none() {
        p.kill();
    }
    (rss, ready)
}

fn main() {
    // `cargo bench` passes `--bench`; without it this runs as a test (`cargo test --benches`)
    // and does nothing: loading the 2B checkpoint is not a test. A filter argument that is not
    // ours means another bench.
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !args.iter().any(|a| a == "--bench")
        || args
            .iter()
            .any(|a| !a.starts_with('-') && !"plan_rss".contains(a.as_str()))
    {
        return;
    }
    let model = PathBuf::from(
        std::env::var("VLM_BENCH_MODEL").unwrap_or_else(|_| "/work/ckpt/qwen3-vl-2b".into()),
    );
    if !model.join("config.json").is_file() {
        eprintln!(
            "plan_rss: no checkpoint at {} (set VLM_BENCH_MODEL); skipped",
            model.display()
        );
        return;
    }
    let dtype = std::env::var("VLM_BENCH_DTYPE").unwrap_or_else(|_| "f32".into());
    let config = support::write_config("plan-rss-bench.yaml", &CONFIG.replace("DTYPE", &dtype));
    let cfg = vlm_config::DeployConfig::from_path(&config).unwrap().config;
    let dims = ModelDims::from_dir(&model).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    println!(
        "plan_rss: {} ({dtype}), config {}",
        model.display(),
        config.display()
    );
    for (service, name) in [
        (Service::Vision, "vision-service"),
        (Service::Lm, "lm-service"),
    ] {
        let kind = plan::DeviceKind::cpu().unwrap();
        let sizing = vlm_backends::sizing(&cfg, &kind, &plan::PlanOptions::default()).unwrap();
        let planned = plan::cpu_service_bytes(&cfg, &dims, sizing.as_ref(), service).unwrap();
        let resident = planned.resident();
        println!(
            "{name}: planned resident {} ({resident} B) = baseline {} + weights {} + held buffers {} + kv cache {}; \
             per-run buffers {} more while running",
            human(resident),
            human(planned.process_baseline),
            human(planned.weights),
            human(planned.held_buffers),
            human(planned.kv_cache),
            human(planned.buffers - planned.held_buffers),
        );
        let (rss, ready) = rt.block_on(measure(name, &model, &config));
        println!(
            "{name}: VmRSS {} ({rss} B), ratio RSS/planned {:.3}, SERVING after {:.1} s",
            human(rss),
            rss as f64 / resident as f64,
            ready.as_secs_f64()
        );
    }
}
