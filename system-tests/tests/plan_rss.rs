//! The memory plan against what the services really hold: each service is started alone on the
//! tiny checkpoint, and once it reports SERVING its resident memory (`VmRSS`) must be within 10%
//! of the plan's figure for it (`vlm_config::plan::cpu_service_bytes(..).resident()`: process
//! baseline + weights in the compute dtype + the ViT engine's bucket workspaces + the KV pool).
//!
//! The plan counts reservations as resident, and the services pre-fault what they reserve at
//! start (the KV pool and the ViT workspaces: `vlm_model::resident::zeros_resident`), so a layout
//! that does not fit fails at start-up rather than under load (see the module documentation of
//! `config/src/plan/memory.rs`). The children run with the environment they would have.
//! The 2B checkpoint is measured by `cargo bench -p vlm-system-tests --bench plan_rss`.
#![cfg(target_os = "linux")]

mod support;

use std::time::Duration;
use support::{bin, start_service, tiny_model, vm_rss, write_config};
use vlm_config::plan::{self, ModelDims, Service};

/// Bigger ViT buckets and KV pool than the harness's config, so that what the plan itemises
/// (42 MiB of ViT workspaces; 25 MiB of KV cache) outweighs the process baseline.
const CONFIG: &str = "\
visual:
  max_seq_len: [1024, 4096, 16384]
  num_devices: 1
  device: [0]
max_seq_len: 4096
kvcache_partition_len: 256
kvcache_num_blocks: 128
batch_size: 8
decoder_batch_sizes: [1, 2, 4, 8]
prefill_chunk_size: 128
num_devices: 1
device: [LM_DEVICE]
";

/// The same with two-core pools for both parts: the vision service runs one ViT instance per
/// core, each with its own bucket workspaces and one shared copy of the weights; the LM is one
/// engine whose compute threads are pinned one per core, holding its weights and KV pool once.
const POOLS: &str = "\
visual:
  max_seq_len: [1024, 4096, 16384]
  num_devices: 2
  device: [0, 1]
max_seq_len: 4096
kvcache_partition_len: 256
kvcache_num_blocks: 128
batch_size: 8
decoder_batch_sizes: [1, 2, 4, 8]
prefill_chunk_size: 128
num_devices: 2
device: [0, 1]
";

// The std mutex only keeps the two tests' processes from running at once (each test has its
// own runtime), so holding it across the awaits is the point.
#[allow(clippy::await_holding_lock)]
async fn check(service: Service, file: &str, yaml: &str) {
    let _serial = support::serial();
    let model = tiny_model();
    let config = write_config(file, yaml);
    let cfg = vlm_config::DeployConfig::from_path(&config).unwrap().config;
    let dims = ModelDims::from_dir(&model).unwrap();
    let kind = plan::DeviceKind::cpu().unwrap();
    let sizing = vlm_backends::sizing(&cfg, &kind, &plan::PlanOptions::default()).unwrap();
    let planned = plan::cpu_service_bytes(&cfg, &dims, sizing.as_ref(), service).unwrap();
    let name = match service {
        Service::Vision => "vision-service",
        Service::Lm => "lm-service",
    };
    let mut p = start_service(name, &bin(name), &model, &config).await;
    // Let the last start-up allocations (health flip, first connections) settle.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rss = vm_rss(p.pid());
    p.kill();
    let resident = planned.resident();
    let ratio = rss as f64 / resident as f64;
    eprintln!(
        "{name}: planned resident {resident} B (baseline {} + weights {} + held buffers {} + kv {}), \
         VmRSS {rss} B, ratio {ratio:.3}",
        planned.process_baseline, planned.weights, planned.held_buffers, planned.kv_cache
    );
    assert!(
        (0.9..=1.1).contains(&ratio),
        "{name}: VmRSS after start-up {rss} B is not within 10% of the planned {resident} B \
         (ratio {ratio:.3}): {planned:?}"
    );
}

#[tokio::test]
async fn vision_service_holds_what_the_plan_says() {
    check(Service::Vision, "plan-rss.yaml", CONFIG).await;
}

#[tokio::test]
async fn lm_service_holds_what_the_plan_says() {
    check(Service::Lm, "plan-rss.yaml", CONFIG).await;
}

/// Whether this process may run on two cores (the pools below need them).
fn two_cores() -> bool {
    let n = vlm_service_kit::affinity::allowed_cores().len();
    if n < 2 {
        vlm_test_support::skip!("the two-core pools need 2 cores, this process may use {n}");
    }
    n >= 2
}

#[tokio::test]
async fn a_two_core_vision_pool_holds_what_the_plan_says() {
    if two_cores() {
        check(Service::Vision, "plan-rss-pools.yaml", POOLS).await;
    }
}

#[tokio::test]
async fn a_two_core_lm_pool_holds_what_the_plan_says() {
    if two_cores() {
        check(Service::Lm, "plan-rss-pools.yaml", POOLS).await;
    }
}
