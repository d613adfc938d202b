//! Will it fit? The memory plan of a deployment config on a kind of device, the automatic
//! KV block count the services start with, and bucket advice from observed traffic — all from
//! the config and the checkpoint's `config.json` (or a preset), before any runtime is created.
//!
//! * [`plan()`]: per device id, the bytes each part places there (weights, bucket graph buffers,
//!   KV cache, reservation), whether it fits and, when not, checked changes that would.
//! * [`resolve_kv_blocks`]: what `kvcache_num_blocks: 0` means on a kind of device; the services
//!   call it at start-up so the plan and the running service agree.
//! * [`cpu_service_bytes`]: the planned bytes of one service on this machine's CPU backend, and
//!   ([`PartBytes::resident`]) what its process holds once SERVING, checked against `VmRSS`.
//! * [`buckets`]: the K ViT buckets / decode graphs that minimise expected cost for a traffic
//!   sample.
//!
//! The accounting is documented in [`memory`]; the cost model in [`buckets`].
//!
//! ```
//! use vlm_config::plan::{self, DeviceKind, ModelDims, PlanOptions, RblnSizing};
//! let cfg = vlm_config::DeployConfig::from_json(r#"{
//!     "visual": {"max_seq_len": 16384, "device": 0},
//!     "device": 0, "max_seq_len": 32768, "kvcache_partition_len": 8192,
//!     "batch_size": 4, "decoder_batch_sizes": [1, 2, 4]
//! }"#).unwrap().config;
//! let dims = ModelDims::qwen3_vl_2b();
//! let (kind, opts) = (DeviceKind::rebel(), PlanOptions::default());
//! // The sizes of the runtime that holds the parts: here the seeds' NPU runtime; for the kinds
//! // this project runs on, `vlm_backends::sizing` gives the backends' own.
//! let p = plan::plan(&cfg, &dims, &kind, &RblnSizing::for_kind(&kind, &opts), &opts);
//! assert!(p.fits);
//! assert_eq!(p.kv.bytes_per_token, 112 * 1024); // 16-bit on an NPU
//! ```
pub mod advice;
pub mod buckets;
pub mod device;
pub mod dims;
pub mod inputs;
pub mod memory;
pub mod report;
pub mod sizing;

pub use advice::plan;
pub use buckets::{BucketSet, CostModel};
pub use device::{human, parse_bytes, BufferPolicy, DeviceKind, GIB, KIB, MIB};
pub use dims::{ModelDims, ParamCount};
pub use inputs::{Part, PlanOptions};
pub use memory::{
    cpu_service_bytes, kv_pool_bytes, plan_only, resolve_kv_blocks, resolve_kv_blocks_with,
    service_bytes, structured_output_bytes, visual_bytes, DevicePlan, Item, KvPlan, PartBytes,
    Plan, Service, Suggestion, CPU_PROCESS_BASELINE, MEDIA_LIBRARIES_BYTES,
};
pub use sizing::{
    graph_lm_elems, graph_vit_elems, BucketBytes, Dtypes, PoolUse, RblnSizing, Sizing,
};

/// Why a plan cannot be made, or why the automatic KV block count has no answer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// The checkpoint's `config.json` or the preset.
    #[error("model: {0}")]
    Model(String),
    /// The device kind or capacity.
    #[error("device: {0}")]
    Device(String),
    /// `kvcache_num_blocks: 0` and not even one full-length sequence fits.
    #[error(
        "kvcache_num_blocks: 0 (automatic): only {fits} KV blocks of {} fit on device {device} ({kind}) after \
         everything else placed there, fewer than the {needed} blocks of one full-length sequence \
         (max_seq_len {max_seq_len}); lower max_seq_len, move visual to other devices or use more devices",
        device::human(*block_bytes)
    )]
    KvTooSmall {
        device: String,
        kind: String,
        fits: u64,
        needed: u32,
        block_bytes: u64,
        max_seq_len: u32,
    },
    /// A traffic file or batch log, or the bucket choice.
    #[error("{0}")]
    Traffic(String),
}
