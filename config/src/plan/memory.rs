//! The memory plan: what each part (ViT = `visual`, LM = top level) places on each device id
//! of the config, and whether it fits.
//!
//! # Accounting
//! Every figure of a part comes from the backend that runs it ([`Sizing`], implemented by each
//! backend with the functions it allocates with; `vlm_backends::sizing` picks them as the
//! services pick their backend, [`super::RblnSizing`] for the seeds' NPU kinds):
//!
//! * **weights** ([`Sizing::weight_bytes`]): on the CPU and candle backends the matrices in the
//!   config's `dtype` and 1-D norm weights and biases in f32; on RBLN kinds everything in the
//!   kind's 16-bit dtype. `--dtype` sets both parts' dtype.
//! * **ViT bucket of b raw patches** ([`Sizing::vit_bucket`]): the CPU engine's per-bucket
//!   workspace (held from load) plus one run's tables, attention scratch and outputs; candle's
//!   and RBLN's live activations of one run of the graph ([`super::graph_vit_elems`]).
//! * **LM graphs** ([`Sizing::lm_step`]: a prefill chunk of `prefill_chunk_size` rows; one decode
//!   graph per `decoder_batch_sizes` entry): the live activations of one step
//!   ([`super::graph_lm_elems`]), attending to `max_seq_len` keys on the CPU and candle backends
//!   (scores of every cached block side by side) and to `kvcache_partition_len` on RBLN (one
//!   partition at a time).
//! * **buffers held** ([`Sizing::vit_buffers`], [`Sizing::lm_buffers`]): a part that keeps every
//!   graph's buffers (RBLN's compiled graphs; the CPU ViT engine's workspaces) holds their sum
//!   ([`BufferPolicy::PerGraph`]); one that allocates per run holds its largest run
//!   ([`BufferPolicy::PerRun`]).
//! * **KV cache**: `kvcache_num_blocks x block`, block = `kvcache_partition_len` tokens x
//!   layers x 2 (K, V) x KV heads x head_dim x the backend's KV dtype bytes, plus the blocks the
//!   backend keeps for itself ([`Sizing::kv_extra_blocks`]: one dummy block for padded decode
//!   rows on the CPU and candle backends).
//! * **device pools** ([`Sizing::pool`]): on the `cpu` kind every device id is a core of one
//!   machine, so everything lands in one pool, `host`, the weights once and the ViT's bucket
//!   buffers once per core of its pool (one instance per core). On accelerators a part's bytes
//!   are divided over its devices when its backend splits them (RBLN: tensor parallel) and
//!   held whole on each device when it replicates (candle on GPUs: one ViT instance per GPU);
//!   a pool the backend cannot run (a multi-GPU LM on candle) is a problem of the plan.
//! * **reserved**: the kind's per-device reservation.
//!
//! # What a service process holds on the CPU backend ([`service_bytes`], [`cpu_service_bytes`])
//! A service's [`PartBytes`] also carries the figures to compare with the process's resident
//! memory (`VmRSS`) once it reports SERVING ([`PartBytes::resident`]):
//!
//! * **process baseline** ([`CPU_PROCESS_BASELINE`]): the binary's code pages, the tokio
//!   runtime, tonic/health/reflection, the metrics registry, tracing, thread stacks and the
//!   allocator's arenas; the LM adds its structured-output compiler
//!   ([`structured_output_bytes`]), the vision service FFmpeg's libraries
//!   ([`MEDIA_LIBRARIES_BYTES`]). Not in the device placement (it is the same few MiB whatever the
//!   config), so [`PartBytes::total`] leaves it out.
//! * **held from start**: the weights (in the compute dtype: a bf16 checkpoint served in f32
//!   is widened at load), the buffers allocated at load and kept for the life of the process —
//!   the CPU ViT engine's per-bucket workspaces (`rows x (5 hidden + max(intermediate,
//!   3 hidden))` f32, [`super::BucketBytes::held`]), one set per `visual.device` entry (each
//!   compute thread has its own) — and the KV pool (every block plus the dummy one).
//! * **transient**: per-run buffers (the ViT engine's rotary tables, attention scratch and
//!   outputs; candle's per-op tensors; the LM's largest run). They are counted in the plan,
//!   because the memory must be there while a run is under way, but they are freed after the
//!   run, so they are not part of the resident figure.
//!
//! Reserved means resident: the services are expected to touch (pre-fault) what they hold from
//! start — the KV pool and the ViT workspaces are zero-filled allocations, which Linux maps
//! lazily, so without touching them they cost address space and no RSS until first used, and
//! a layout that does not fit is found by the OOM killer under load instead of at start-up.
//! [`PartBytes::resident`] is what such a service holds after start; system-tests/tests/plan_rss.rs
//! checks it against `VmRSS` within 10% (tiny checkpoint) and cli/benches/plan_rss.rs
//! measures it on the 2B checkpoint.
//!
//! `kvcache_num_blocks: 0` resolves ([`resolve_kv_blocks`]) to the largest count that fits on
//! every LM device after everything else placed there (the ViT included when it shares them),
//! capped at `batch_size x max_seq_len / kvcache_partition_len` (the scheduler never holds more);
//! below one full-length sequence it is [`PlanError::KvTooSmall`].
use super::device::{human, BufferPolicy, DeviceKind};
use super::dims::ModelDims;
use super::inputs::{Part, PlanOptions};
use super::sizing::{PoolUse, Sizing};
use super::PlanError;
use crate::types::{DeployConfig, Dtype, KvDtype};
use serde::Serialize;

/// Bytes of one thing a part holds (a whole part's figure, or one device's share of it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Item {
    pub part: Part,
    /// `weights`, `vit bucket 16384`, `prefill chunk 128`, `decode batch 8`, `kv cache`,
    /// `largest run: ...`.
    pub what: String,
    pub bytes: u64,
}

/// A part's memory before it is split over its devices.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PartBytes {
    pub part: Part,
    pub weights: u64,
    pub weight_dtype: Dtype,
    pub activation_dtype: Dtype,
    /// Per graph (each ViT bucket; prefill and each decode graph), whatever the policy.
    pub graphs: Vec<Item>,
    /// How this part holds its graphs' buffers.
    pub policy: BufferPolicy,
    /// What the part holds for its graphs under the kind's [`BufferPolicy`].
    pub buffers: u64,
    /// KV cache (LM only): blocks x block bytes, the dummy block included on our backend.
    pub kv_cache: u64,
    /// weights + buffers + kv_cache: what the device placement counts (the process baseline
    /// not included).
    pub total: u64,
    /// Of `buffers`, the bytes allocated at load and held for the life of the service (the CPU
    /// f32 ViT engine's workspaces, every compute device's); the rest is per run.
    pub held_buffers: u64,
    /// The service process's own footprint on the CPU backend ([`CPU_PROCESS_BASELINE`]);
    /// 0 on other kinds (it is host memory, not device memory).
    pub process_baseline: u64,
}

impl PartBytes {
    /// What the service process holds once it reports SERVING, when it pre-faults what it
    /// reserves: process baseline + weights + buffers held from load + KV cache. Per-run
    /// buffers are not included (they come and go with each run).
    pub fn resident(&self) -> u64 {
        self.process_baseline + self.weights + self.held_buffers + self.kv_cache
    }
}

/// Resident memory of a service process on the CPU backend beyond what the plan itemises:
/// code pages of the binary (about 12 MiB file-backed), the tokio runtime, tonic, the metrics
/// registry, tracing, thread stacks and malloc arenas (2-4 MiB anonymous).
///
/// Measured (x86_64 glibc, dev-profile binaries as the tests run them) as `VmRSS` after
/// SERVING minus the rest of the plan, with the tiny checkpoint. 2026-11-29: vision-service
/// 13.0 MB, lm-service 12.9-13.5 MB (12 MiB then). 2026-12-02, the binaries grown by video
/// decoding, the embedding caches and TLS: vision-service 13.6 MB, lm-service 16.7-18.4 MB
/// (44.3-45.2 MB RSS with a 25.4 MB KV pool; `cargo test -p vlm-system-tests --test plan_rss --
/// --nocapture` prints both). 15 MiB keeps both within their 10%; it is one figure for
/// both. It does not grow with the model: with the 2B checkpoint
/// it is noise next to gigabytes of weights (cli/benches/plan_rss.rs prints the difference).
pub const CPU_PROCESS_BASELINE: u64 = 15 * super::device::MIB;

/// What FFmpeg's shared libraries (libavformat, libavcodec, libswscale, libavutil and the codec
/// libraries they load) hold once mapped and relocated, in the service that decodes images
/// with them: the vision service (AVIF).
/// Measured 2026-12-07, Debian 12's FFmpeg 5.1: the vision-service's VmRSS after start-up rose
/// by 22.3-22.4 MB (`plan_rss`, both of its cases) when it began to link them.
pub const MEDIA_LIBRARIES_BYTES: u64 = 21 * super::device::MIB;

/// What the LM's structured-output compiler holds (llguidance's token trie and token-class
/// slices over the model's vocabulary, built at start): a fixed part and bytes per token.
/// Measured with `cargo bench -p vlm-lm-service --bench structured_mask` (VmRSS around
/// `Grammars::load`, 2026-12-01, this machine): 0.9 MiB for the tiny checkpoint's 1024 tokens,
/// 67.0 MiB for the 2B's 151936 (463 B per token).
pub fn structured_output_bytes(vocab: u64) -> u64 {
    super::device::MIB + 464 * vocab
}

/// The KV cache's geometry and count.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KvPlan {
    pub dtype: KvDtype,
    /// Blocks are content-addressed and reused across requests (`prefix_caching`): the pool's
    /// free blocks hold cached prefixes until a request needs them.
    pub prefix_caching: bool,
    pub bytes_per_token: u64,
    /// `kvcache_partition_len`.
    pub block_tokens: u32,
    /// `block_tokens x bytes_per_token`.
    pub block_bytes: u64,
    pub max_seq_len: u32,
    pub batch_size: u32,
    /// Blocks placed in the plan (resolved when the config says 0).
    pub blocks: u32,
    /// The config said 0.
    pub automatic: bool,
    /// Extra blocks the backend allocates (our backend's dummy block for padded decode rows).
    pub extra_blocks: u32,
    pub blocks_per_sequence: u32,
    /// `batch_size x blocks_per_sequence`.
    pub full_batch_blocks: u32,
    /// Full-length sequences the blocks hold.
    pub full_sequences: u32,
    /// Why automatic resolution failed (the plan then places one sequence's blocks to show the
    /// shortfall).
    pub error: Option<String>,
}

/// One device id (or the host pool) and what lands on it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DevicePlan {
    /// The device id, or `host` for a shared pool.
    pub id: String,
    pub parts: Vec<Part>,
    pub items: Vec<Item>,
    pub reserved: u64,
    /// Items plus reservation.
    pub used: u64,
    pub capacity: u64,
    /// capacity - used; negative when short.
    pub headroom: i64,
}

/// A change to the config that makes the layout fit, checked by planning it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Suggestion {
    pub change: String,
    /// The keys to set, as in the config file.
    pub patch: serde_json::Value,
    /// KV blocks of the re-planned layout.
    pub kv_blocks: u32,
    /// Smallest headroom over the re-planned layout's devices.
    pub min_headroom: i64,
}

/// The whole plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    pub kind: DeviceKind,
    pub options: PlanOptions,
    pub visual: PartBytes,
    pub lm: PartBytes,
    pub kv: KvPlan,
    pub devices: Vec<DevicePlan>,
    /// Device ids both parts use.
    pub shared_devices: Vec<u32>,
    pub fits: bool,
    /// Every `batch_size` slot can hold a full-length sequence.
    pub full_batch: bool,
    /// Why it does not fit, one line each.
    pub problems: Vec<String>,
    /// When it does not fit: changes that would (each re-planned).
    pub suggestions: Vec<Suggestion>,
}

impl Plan {
    /// Every device holding `part` fits (for the LM: and automatic KV blocks resolved). What the
    /// bucket advisor checks: a part's buckets are bounded by the memory of its own devices.
    pub fn part_fits(&self, part: Part) -> bool {
        self.devices
            .iter()
            .filter(|d| d.parts.contains(&part))
            .all(|d| d.headroom >= 0)
            && (part != Part::Lm || self.kv.error.is_none())
    }
}

/// The config with `--dtype` applied to both parts (the what-if of [`PlanOptions::dtype`]).
fn with_dtype(cfg: &DeployConfig, opts: &PlanOptions) -> DeployConfig {
    let mut c = cfg.clone();
    if let Some(d) = opts.dtype {
        c.dtype = d;
        c.visual.dtype = d;
    }
    c
}

fn held(policy: BufferPolicy, graphs: &[Item]) -> u64 {
    match policy {
        BufferPolicy::PerGraph => graphs.iter().map(|g| g.bytes).sum(),
        BufferPolicy::PerRun => graphs.iter().map(|g| g.bytes).max().unwrap_or(0),
    }
}

/// The ViT's bytes: weights and each bucket's buffers as the part's backend holds them
/// ([`Sizing::vit_bucket`]); on one machine's cores each core of the vision pool holds its own
/// bucket buffers (one instance per core) and the weights once.
pub fn visual_bytes(
    cfg: &DeployConfig,
    dims: &ModelDims,
    kind: &DeviceKind,
    sizing: &dyn Sizing,
    opts: &PlanOptions,
) -> PartBytes {
    let cfg = with_dtype(cfg, opts);
    let t = sizing.dtypes(Part::Visual, cfg.visual.dtype);
    let weights = sizing.weight_bytes(dims, Part::Visual, t.weights);
    let policy = sizing.vit_buffers(&cfg.visual);
    let host =
        kind.shared_pool && sizing.pool(Part::Visual, cfg.visual.num_devices) == Ok(PoolUse::Host);
    let copies = if host {
        (cfg.visual.num_devices as u64).max(1)
    } else {
        1
    };
    let mut buckets: Vec<u32> = cfg.visual.max_seq_len.clone();
    buckets.sort_unstable();
    buckets.dedup();
    let sized: Vec<(u32, super::sizing::BucketBytes)> = buckets
        .iter()
        .map(|&b| (b, sizing.vit_bucket(dims, &cfg.visual, b as u64)))
        .collect();
    let graphs: Vec<Item> = sized
        .iter()
        .map(|(b, s)| Item {
            part: Part::Visual,
            what: if copies > 1 {
                format!("vit bucket {b} (x{copies} devices)")
            } else {
                format!("vit bucket {b}")
            },
            bytes: copies * s.bytes,
        })
        .collect();
    let buffers = held(policy, &graphs);
    let held_buffers = sized.iter().map(|(_, s)| copies * s.held).sum();
    PartBytes {
        part: Part::Visual,
        weights,
        weight_dtype: t.weights,
        activation_dtype: t.activations,
        graphs,
        policy,
        buffers,
        kv_cache: 0,
        total: weights + buffers,
        held_buffers,
        // Host memory: the process and the media libraries it decodes AVIF with.
        process_baseline: if kind.shared_pool {
            sizing.process_baseline() + MEDIA_LIBRARIES_BYTES
        } else {
            0
        },
    }
}

/// The LM's bytes without the KV cache (`kv_cache` 0): weights and the prefill and decode
/// graphs' buffers as its backend holds them ([`Sizing::lm_step`]).
fn lm_bytes_without_kv(
    cfg: &DeployConfig,
    dims: &ModelDims,
    kind: &DeviceKind,
    sizing: &dyn Sizing,
    opts: &PlanOptions,
) -> PartBytes {
    let cfg = with_dtype(cfg, opts);
    let t = sizing.dtypes(Part::Lm, cfg.dtype);
    let weights = sizing.weight_bytes(dims, Part::Lm, t.weights);
    let c = cfg.prefill_chunk_size as u64;
    let mut graphs = vec![Item {
        part: Part::Lm,
        what: format!("prefill chunk {c}"),
        bytes: sizing.lm_step(dims, &cfg, c, 1),
    }];
    for &b in &cfg.decoder_batch_sizes {
        let b = b as u64;
        graphs.push(Item {
            part: Part::Lm,
            what: format!("decode batch {b}"),
            bytes: sizing.lm_step(dims, &cfg, b, b),
        });
    }
    let policy = sizing.lm_buffers();
    let buffers = held(policy, &graphs);
    PartBytes {
        part: Part::Lm,
        weights,
        weight_dtype: t.weights,
        activation_dtype: t.activations,
        graphs,
        policy,
        buffers,
        kv_cache: 0,
        total: weights + buffers,
        // The LM's step buffers are per run (allocated per op, freed after each step).
        held_buffers: 0,
        // Host memory: the process and its grammar compiler.
        process_baseline: if kind.shared_pool {
            sizing.process_baseline() + structured_output_bytes(dims.vocab)
        } else {
            0
        },
    }
}

fn kv_geometry(
    cfg: &DeployConfig,
    dims: &ModelDims,
    sizing: &dyn Sizing,
    opts: &PlanOptions,
) -> KvPlan {
    let t = sizing.dtypes(Part::Lm, with_dtype(cfg, opts).dtype);
    let dtype = cfg.kv_cache_dtype.resolve(t.kv);
    let bytes_per_token = dims.kv_bytes_per_token(dtype.bytes());
    let per_seq = cfg.blocks_per_sequence();
    KvPlan {
        dtype,
        prefix_caching: cfg.prefix_caching,
        bytes_per_token,
        block_tokens: cfg.kvcache_partition_len,
        block_bytes: bytes_per_token * cfg.kvcache_partition_len as u64,
        max_seq_len: cfg.max_seq_len,
        batch_size: cfg.batch_size,
        blocks: cfg.kvcache_num_blocks,
        automatic: cfg.kvcache_num_blocks == 0,
        extra_blocks: sizing.kv_extra_blocks(),
        blocks_per_sequence: per_seq,
        full_batch_blocks: per_seq.saturating_mul(cfg.batch_size),
        full_sequences: 0,
        error: None,
    }
}

fn div_ceil(a: u64, b: u64) -> u64 {
    a.div_ceil(b.max(1))
}

/// The device ids as the plan names them: each id, or `host` for a shared pool.
struct Layout {
    /// (name, device id when not pooled)
    slots: Vec<(String, Option<u32>)>,
}

fn layout(cfg: &DeployConfig, kind: &DeviceKind) -> Layout {
    if kind.shared_pool {
        return Layout {
            slots: vec![("host".into(), None)],
        };
    }
    let mut ids: Vec<u32> = cfg
        .visual
        .device
        .iter()
        .chain(cfg.device.iter())
        .copied()
        .collect();
    ids.sort_unstable();
    ids.dedup();
    Layout {
        slots: ids.into_iter().map(|i| (i.to_string(), Some(i))).collect(),
    }
}

/// Everything but the KV cache, per slot: (items, bytes).
/// What a part's bytes are divided by on each of its devices: its device count when the pool
/// splits them (tensor parallel), else 1 (a shared host pool, or replicas that each hold a
/// whole copy).
fn divisor(kind: &DeviceKind, sizing: &dyn Sizing, part: Part, n: u32) -> u64 {
    if kind.shared_pool {
        return 1;
    }
    match sizing.pool(part, n) {
        Ok(PoolUse::Split) => n as u64,
        _ => 1,
    }
}

fn place_without_kv(
    cfg: &DeployConfig,
    kind: &DeviceKind,
    sizing: &dyn Sizing,
    visual: &PartBytes,
    lm: &PartBytes,
    lay: &Layout,
) -> Vec<(Vec<Part>, Vec<Item>)> {
    lay.slots
        .iter()
        .map(|(_, id)| {
            let mut parts = Vec::new();
            let mut items = Vec::new();
            for (part, on, n) in [
                (
                    visual,
                    id.is_none_or(|i| cfg.visual.device.contains(&i)),
                    cfg.visual.num_devices,
                ),
                (
                    lm,
                    id.is_none_or(|i| cfg.device.contains(&i)),
                    cfg.num_devices,
                ),
            ] {
                if !on {
                    continue;
                }
                let n = divisor(kind, sizing, part.part, n);
                parts.push(part.part);
                items.push(Item {
                    part: part.part,
                    what: "weights".into(),
                    bytes: div_ceil(part.weights, n),
                });
                match part.policy {
                    BufferPolicy::PerGraph => {
                        for g in &part.graphs {
                            items.push(Item {
                                part: part.part,
                                what: g.what.clone(),
                                bytes: div_ceil(g.bytes, n),
                            });
                        }
                    }
                    BufferPolicy::PerRun => {
                        if let Some(g) = part.graphs.iter().max_by_key(|g| g.bytes) {
                            items.push(Item {
                                part: part.part,
                                what: format!("largest run: {}", g.what),
                                bytes: div_ceil(g.bytes, n),
                            });
                        }
                    }
                }
            }
            (parts, items)
        })
        .collect()
}

/// The largest block count that fits every LM device after everything else placed there,
/// not capped. `None` when no LM device exists in the layout (cannot happen for a valid config).
fn max_blocks(
    cfg: &DeployConfig,
    kind: &DeviceKind,
    sizing: &dyn Sizing,
    kv: &KvPlan,
    placed: &[(Vec<Part>, Vec<Item>)],
) -> (u64, String) {
    let n = divisor(kind, sizing, Part::Lm, cfg.num_devices);
    let mut best: Option<(u64, String)> = None;
    let lay = layout(cfg, kind);
    for ((name, _), (parts, items)) in lay.slots.iter().zip(placed) {
        if !parts.contains(&Part::Lm) {
            continue;
        }
        let used: u64 = items.iter().map(|i| i.bytes).sum::<u64>() + kind.reserved;
        let free = kind.capacity.saturating_sub(used);
        // ceil(blocks_total x block / n) <= free  <=>  blocks_total x block <= free x n
        let total = (free as u128 * n as u128 / kv.block_bytes.max(1) as u128) as u64;
        let blocks = total.saturating_sub(kv.extra_blocks as u64);
        if best.as_ref().is_none_or(|(b, _)| blocks < *b) {
            best = Some((blocks, name.clone()));
        }
    }
    best.unwrap_or((0, String::new()))
}

/// `kvcache_num_blocks` as the service will run it: the config's value when it is not 0;
/// for 0, the largest count that fits on every LM device after the weights, the graph buffers,
/// the reservation and whatever else shares those devices (the ViT included), capped at
/// `batch_size` full-length sequences. Fewer than one full-length sequence is an error.
pub fn resolve_kv_blocks(
    cfg: &DeployConfig,
    dims: &ModelDims,
    kind: &DeviceKind,
    sizing: &dyn Sizing,
) -> Result<u32, PlanError> {
    resolve_kv_blocks_with(cfg, dims, kind, sizing, &PlanOptions::default())
}

/// [`resolve_kv_blocks`] with what-ifs (dtype override; `require_full_batch` makes 0 mean
/// exactly `batch_size` full-length sequences).
pub fn resolve_kv_blocks_with(
    cfg: &DeployConfig,
    dims: &ModelDims,
    kind: &DeviceKind,
    sizing: &dyn Sizing,
    opts: &PlanOptions,
) -> Result<u32, PlanError> {
    if cfg.kvcache_num_blocks != 0 {
        return Ok(cfg.kvcache_num_blocks);
    }
    let kv = kv_geometry(cfg, dims, sizing, opts);
    if opts.require_full_batch {
        return Ok(kv.full_batch_blocks);
    }
    let visual = visual_bytes(cfg, dims, kind, sizing, opts);
    let lm = lm_bytes_without_kv(cfg, dims, kind, sizing, opts);
    let lay = layout(cfg, kind);
    let placed = place_without_kv(cfg, kind, sizing, &visual, &lm, &lay);
    let (max, device) = max_blocks(cfg, kind, sizing, &kv, &placed);
    if max < kv.blocks_per_sequence as u64 {
        return Err(PlanError::KvTooSmall {
            device,
            kind: kind.name.clone(),
            fits: max,
            needed: kv.blocks_per_sequence,
            block_bytes: kv.block_bytes,
            max_seq_len: cfg.max_seq_len,
        });
    }
    Ok(max.min(kv.full_batch_blocks as u64) as u32)
}

/// The plan without suggestions (what suggestions are checked with; cheaper than
/// [`super::advice::plan`]).
pub fn plan_only(
    cfg: &DeployConfig,
    dims: &ModelDims,
    kind: &DeviceKind,
    sizing: &dyn Sizing,
    opts: &PlanOptions,
) -> Plan {
    let visual = visual_bytes(cfg, dims, kind, sizing, opts);
    let mut lm = lm_bytes_without_kv(cfg, dims, kind, sizing, opts);
    let mut kv = kv_geometry(cfg, dims, sizing, opts);
    let mut problems = Vec::new();
    // A pool the part's backend cannot run (e.g. a tensor-parallel LM on a backend without it).
    for (part, n) in [
        (Part::Visual, cfg.visual.num_devices),
        (Part::Lm, cfg.num_devices),
    ] {
        if let Err(why) = sizing.pool(part, n) {
            problems.push(format!("{}: {why}", part.as_str()));
        }
    }
    match resolve_kv_blocks_with(cfg, dims, kind, sizing, opts) {
        Ok(b) => kv.blocks = b,
        Err(e) => {
            problems.push(e.to_string());
            kv.error = Some(e.to_string());
            kv.blocks = kv.blocks_per_sequence;
        }
    }
    kv.full_sequences = kv.blocks / kv.blocks_per_sequence.max(1);
    lm.kv_cache = (kv.blocks as u64 + kv.extra_blocks as u64) * kv.block_bytes;
    lm.total += lm.kv_cache;

    let lay = layout(cfg, kind);
    let placed = place_without_kv(cfg, kind, sizing, &visual, &lm, &lay);
    let n_lm = divisor(kind, sizing, Part::Lm, cfg.num_devices);
    let mut devices = Vec::new();
    for ((name, _), (parts, mut items)) in lay.slots.iter().zip(placed) {
        if parts.contains(&Part::Lm) {
            items.push(Item {
                part: Part::Lm,
                what: format!(
                    "kv cache ({} blocks)",
                    kv.blocks as u64 + kv.extra_blocks as u64
                ),
                bytes: div_ceil(lm.kv_cache, n_lm),
            });
        }
        let used = items.iter().map(|i| i.bytes).sum::<u64>() + kind.reserved;
        let headroom = kind.capacity as i64 - used as i64;
        devices.push(DevicePlan {
            id: name.clone(),
            parts,
            items,
            reserved: kind.reserved,
            used,
            capacity: kind.capacity,
            headroom,
        });
    }
    // One line per run of devices short by the same amount.
    let mut short: Vec<(Vec<&str>, u64)> = Vec::new();
    for d in devices.iter().filter(|d| d.headroom < 0) {
        match short.last_mut() {
            Some((ids, used)) if *used == d.used => ids.push(&d.id),
            _ => short.push((vec![&d.id], d.used)),
        }
    }
    for (ids, used) in short {
        let (label, each) = if ids.len() == 1 {
            ("device", "")
        } else {
            ("devices", "each ")
        };
        problems.push(format!(
            "{label} {} ({}): {each}needs {} of {}, short by {}",
            ids.join(", "),
            kind.name,
            human(used),
            human(kind.capacity),
            human(used - kind.capacity)
        ));
    }
    let full_batch = kv.blocks >= kv.full_batch_blocks;
    let mut shared: Vec<u32> = if kind.shared_pool {
        Vec::new()
    } else {
        cfg.visual
            .device
            .iter()
            .copied()
            .filter(|d| cfg.device.contains(d))
            .collect()
    };
    shared.sort_unstable();
    shared.dedup();
    let fits = problems.is_empty();
    Plan {
        kind: kind.clone(),
        options: opts.clone(),
        visual,
        lm,
        kv,
        devices,
        shared_devices: shared,
        fits,
        full_batch,
        problems,
        suggestions: Vec::new(),
    }
}

/// Which service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Service {
    Vision,
    Lm,
}

/// The bytes one service plans to hold on this machine's host memory (RAM from /proc/meminfo):
/// weights in the config's dtype (norms in f32), its graph buffers (the ViT's per compute
/// device; the LM's largest run) and, for the LM, the KV cache as [`resolve_kv_blocks`] sizes
/// it (plus the backend's extra blocks); with the process baseline.
///
/// Comparing with process RSS after start-up: [`PartBytes::resident`] is what a service that
/// pre-faults its reservations holds (see the module documentation); per-run buffers are not
/// resident between runs.
pub fn cpu_service_bytes(
    cfg: &DeployConfig,
    dims: &ModelDims,
    sizing: &dyn Sizing,
    service: Service,
) -> Result<PartBytes, PlanError> {
    service_bytes(
        cfg,
        dims,
        &DeviceKind::cpu()?,
        sizing,
        service,
        &PlanOptions::default(),
    )
}

/// [`cpu_service_bytes`] on any kind.
pub fn service_bytes(
    cfg: &DeployConfig,
    dims: &ModelDims,
    kind: &DeviceKind,
    sizing: &dyn Sizing,
    service: Service,
    opts: &PlanOptions,
) -> Result<PartBytes, PlanError> {
    match service {
        Service::Vision => Ok(visual_bytes(cfg, dims, kind, sizing, opts)),
        Service::Lm => {
            let blocks = resolve_kv_blocks_with(cfg, dims, kind, sizing, opts)?;
            let mut lm = lm_bytes_without_kv(cfg, dims, kind, sizing, opts);
            lm.kv_cache = kv_pool_bytes(cfg, dims, blocks, sizing);
            lm.total += lm.kv_cache;
            Ok(lm)
        }
    }
}

/// Bytes of a KV pool of `blocks` usable blocks as the LM's backend allocates it (its extra
/// blocks included).
pub fn kv_pool_bytes(
    cfg: &DeployConfig,
    dims: &ModelDims,
    blocks: u32,
    sizing: &dyn Sizing,
) -> u64 {
    let kv = kv_geometry(cfg, dims, sizing, &PlanOptions::default());
    (blocks as u64 + kv.extra_blocks as u64) * kv.block_bytes
}
