//! The memory plan: what each part (ViT = `visual`, LM = top level) places on each device id
//! of the config, and whether it fits.
//!
//! # Accounting
//! Per part, before splitting over its `num_devices` (tensor parallel: every byte below is
//! divided evenly, rounded up, over the part's devices; on the `cpu` kind every device id is a
//! core of one machine, so nothing is divided and everything lands in one pool, `host`):
//!
//! * **weights**: parameters x weight dtype. On our candle backend (`cpu`, `h200`) 1-D norm
//!   weights and biases stay f32 and the matrices take the config's `dtype` (f32 by default);
//!   on RBLN kinds everything takes the kind's 16-bit dtype. `--dtype` overrides both.
//! * **ViT bucket graph of b raw patches** (activation dtype, f32 on our backend): per row the
//!   residual stream, norm output, qkv, q/k/v per head, attention output, MLP hidden, the
//!   pixel row, the position row and the rotary row:
//!   `b x (11 x hidden + intermediate + patch_dim + head_dim)`; attention in query blocks
//!   (`heads x q_block x b` scores and as many probabilities, `q_block` as in
//!   model/src/vision/attention.rs: 64 Mi elements per block, 16..1024 rows); the merger and
//!   deepstack buffers `b/4 x (2 x 4 x hidden + out_hidden x (1 + deepstack))`.
//! * **LM graphs** (prefill chunk of `prefill_chunk_size` rows; one decode graph per
//!   `decoder_batch_sizes` entry of b rows): per row hidden x 4 (input, norm, o, residual),
//!   q x 2, k + v, MLP gate + up + activation (3 x intermediate), staged image embeddings with
//!   their deepstack levels (`out_hidden x (1 + deepstack)`) and rotary; attention scores and
//!   probabilities `heads x rows x keys x 2` with keys = `max_seq_len` on our backend (scores of
//!   every cached block side by side) and `kvcache_partition_len` on RBLN (flash attention, one
//!   partition at a time); logits `rows x vocab` (prefill: one row).
//! * **buffers held**: RBLN compiles one graph per bucket and keeps each graph's buffers, so a
//!   part holds their sum ([`BufferPolicy::PerGraph`]); our backend's candle ops allocate per
//!   run and a part runs one graph at a time, so it holds its largest run
//!   ([`BufferPolicy::PerRun`]). Exception: on the CPU with f32 weights the vision service runs
//!   its f32 bucket engine, which allocates every bucket's workspace at load — per graph, with
//!   the engine's own sizes ([`vit_cpu_engine_bytes`]).
//! * **KV cache**: `kvcache_num_blocks x block`, block = `kvcache_partition_len` tokens x
//!   layers x 2 (K, V) x KV heads x head_dim x KV dtype bytes (16-bit on RBLN; on our CPU
//!   backend bf16 for bf16 weights, else f32), plus, on our backend, one dummy block for
//!   padded decode rows.
//! * **reserved**: the kind's per-device reservation.
//!
//! # What a service process holds on the CPU backend ([`service_bytes`], [`cpu_service_bytes`])
//! A service's [`PartBytes`] also carries the figures to compare with the process's resident
//! memory (`VmRSS`) once it reports SERVING ([`PartBytes::resident`]):
//!
//! * **process baseline** ([`CPU_PROCESS_BASELINE`]): the binary's code pages, the tokio
//!   runtime, tonic/health/reflection, the metrics registry, tracing, thread stacks and the
//!   allocator's arenas. Not in the device placement (it is the same few MiB whatever the
//!   config), so [`PartBytes::total`] leaves it out.
//! * **held from start**: the weights (in the compute dtype: a bf16 checkpoint served in f32
//!   is widened at load), the buffers allocated at load and kept for the life of the process —
//!   the CPU f32 ViT engine's per-bucket workspaces (`rows x (5 hidden + max(intermediate,
//!   3 hidden))` f32, [`vit_cpu_engine_held_bytes`]), one set per `visual.device` entry (each
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
//! [`PartBytes::resident`] is what such a service holds after start; cli/tests/plan_rss.rs
//! checks it against `VmRSS` within 10% (tiny checkpoint) and cli/benches/plan_rss.rs
//! measures it on the 2B checkpoint.
//!
//! `kvcache_num_blocks: 0` resolves ([`resolve_kv_blocks`]) to the largest count that fits on
//! every LM device after everything else placed there (the ViT included when it shares them),
//! capped at `batch_size x max_seq_len / kvcache_partition_len` (the scheduler never holds more);
//! below one full-length sequence it is [`PlanError::KvTooSmall`].
use super::device::{human, BufferPolicy, DeviceKind};
use super::dims::ModelDims;
use super::PlanError;
use crate::types::{DeployConfig, Dtype};
use serde::Serialize;

/// What-ifs the plan takes besides the config.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PlanOptions {
    /// Dtype of weights, KV cache and activations, over the kind's native one.
    pub dtype: Option<Dtype>,
    /// Plan `kvcache_num_blocks: 0` as `batch_size` full-length sequences (the library's
    /// default when the key is unset) instead of the largest count that fits; a layout fits
    /// only when every sequence slot can hold a full-length context.
    pub require_full_batch: bool,
}

/// One of the two parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Part {
    /// The ViT (`visual`), served by vision-service.
    Visual,
    /// The decoder (top level), served by lm-service.
    Lm,
}

impl Part {
    pub fn as_str(self) -> &'static str {
        match self {
            Part::Visual => "visual",
            Part::Lm => "lm",
        }
    }
}

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
/// code pages of the binary (about 10 MiB file-backed), the tokio runtime, tonic, the metrics
/// registry, tracing, thread stacks and malloc arenas (2-3 MiB anonymous).
///
/// Measured once (2026-11-29, this machine, x86_64 glibc, dev-profile binaries as the tests
/// run them) as `VmRSS` after SERVING minus the planned weights, with the tiny checkpoint:
/// vision-service 13.0 MB RSS with 1.8 MB of weights, lm-service 12.9-13.5 MB with 0.7 MB of
/// weights (the KV pool and ViT workspaces not touched). Both services are within a MiB of
/// 12 MiB; it is one figure for both. It does not grow with the model: with the 2B checkpoint
/// it is noise next to gigabytes of weights (cli/benches/plan_rss.rs prints the difference).
pub const CPU_PROCESS_BASELINE: u64 = 12 * super::device::MIB;

/// The KV cache's geometry and count.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KvPlan {
    pub dtype: Dtype,
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

/// Dtypes of one part on one kind.
#[derive(Debug, Clone, Copy)]
struct Dtypes {
    weights: Dtype,
    activations: Dtype,
    kv: Dtype,
    /// Norm weights and biases in f32 (our backend).
    f32_vectors: bool,
}

fn dtypes(kind: &DeviceKind, opts: &PlanOptions, config_dtype: Dtype) -> Dtypes {
    match (opts.dtype, kind.native_dtype) {
        (Some(d), _) => Dtypes {
            weights: d,
            activations: d,
            kv: d,
            f32_vectors: false,
        },
        (None, Some(d)) => Dtypes {
            weights: d,
            activations: d,
            kv: d,
            f32_vectors: false,
        },
        // Our CPU backend: f32 activations; the KV cache is bf16 for bf16 weights, else f32
        // (model/src/text/model.rs `kv_dtype_for`).
        (None, None) => Dtypes {
            weights: config_dtype,
            activations: Dtype::F32,
            kv: if config_dtype == Dtype::Bf16 {
                Dtype::Bf16
            } else {
                Dtype::F32
            },
            f32_vectors: true,
        },
    }
}

/// Query rows per block of ViT attention scores (as model/src/vision/attention.rs).
pub fn vit_query_block_rows(heads: u64, keys: u64) -> u64 {
    const SCORE_BLOCK_ELEMS: u64 = 16 << 20;
    let rows = SCORE_BLOCK_ELEMS / (heads * keys).max(1);
    (rows / 16 * 16).clamp(16, 1024)
}

/// Activation elements of one ViT run at `b` raw patches.
pub fn vit_bucket_elems(dims: &ModelDims, b: u64) -> u64 {
    let (d, i, h) = (
        dims.vision_hidden,
        dims.vision_intermediate,
        dims.vision_heads,
    );
    let head_dim = d / h.max(1);
    let per_row = 11 * d + i + dims.patch_dim + head_dim;
    let q_block = vit_query_block_rows(h, b).min(b);
    let scores = 2 * h * q_block * b;
    let unit = dims.spatial_merge * dims.spatial_merge;
    let merged = d * unit;
    let merger =
        b / unit.max(1) * (2 * merged + dims.vision_out_hidden * (1 + dims.deepstack_levels));
    b * per_row + scores + merger
}

/// Activation elements of one LM step of `rows` rows (`logit_rows` of them produce logits)
/// attending to `keys` keys.
pub fn lm_step_elems(dims: &ModelDims, rows: u64, logit_rows: u64, keys: u64) -> u64 {
    let h = dims.text_hidden;
    let q = dims.text_heads * dims.head_dim;
    let kv = dims.text_kv_heads * dims.head_dim;
    let per_row = 4 * h
        + 2 * q
        + 2 * kv
        + 3 * dims.text_intermediate
        + dims.vision_out_hidden * (1 + dims.deepstack_levels)
        + dims.head_dim;
    let scores = 2 * dims.text_heads * rows * keys;
    rows * per_row + scores + logit_rows * dims.vocab
}

fn weight_bytes(params: u64, vectors: u64, t: Dtypes) -> u64 {
    if t.f32_vectors {
        (params - vectors) * t.weights.bytes() + vectors * 4
    } else {
        params * t.weights.bytes()
    }
}

fn held(policy: BufferPolicy, graphs: &[Item]) -> u64 {
    match policy {
        BufferPolicy::PerGraph => graphs.iter().map(|g| g.bytes).sum(),
        BufferPolicy::PerRun => graphs.iter().map(|g| g.bytes).max().unwrap_or(0),
    }
}

/// Bytes of one bucket's buffers the CPU f32 ViT engine allocates at load and holds
/// (model/src/vision/engine.rs, `Workspace::new`): `rows x (5 hidden + max(intermediate,
/// 3 hidden))` f32 — the residual stream, the norm/attention output, q, k, v and the wide
/// buffer (qkv, MLP hidden, merger hidden).
pub fn vit_cpu_engine_held_bytes(dims: &ModelDims, rows: u64) -> u64 {
    let d = dims.vision_hidden;
    let big = dims.vision_intermediate.max(3 * d).max(d);
    4 * rows * (5 * d + big)
}

/// Bytes of one bucket of the CPU f32 ViT engine (model/src/vision/engine.rs,
/// `Workspace::bytes` with one thread per run, as the vision-service's compute threads run):
/// the buffers held from load (`rows x (5 hidden + max(intermediate, 3 hidden))`), the per-run
/// rotary/position tables (`rows x (head_dim + 8)`), one attention task's scores
/// (`task_rows x rows`, 256 Ki elements per task) and the outputs, all f32.
pub fn vit_cpu_engine_bytes(dims: &ModelDims, rows: u64) -> u64 {
    let d = dims.vision_hidden;
    let big = dims.vision_intermediate.max(3 * d).max(d);
    let held = rows * (5 * d + big);
    let head_dim = d / dims.vision_heads.max(1);
    let tables = rows * (head_dim + 8);
    let task_rows = ((256u64 << 10) / rows.max(1)).clamp(16, 256) / 8 * 8;
    let scratch = task_rows * rows;
    let tokens = rows / (dims.spatial_merge * dims.spatial_merge).max(1);
    let outputs = tokens * dims.vision_out_hidden * (1 + dims.deepstack_levels);
    4 * (held + tables + scratch + outputs)
}

/// The ViT's bytes on `kind`.
///
/// On the CPU with f32 (or, with AVX512-BF16, bf16) weights the vision service runs its bucket
/// engine, which allocates
/// every bucket's buffers at load ([`vit_cpu_engine_bytes`], held per graph); elsewhere our
/// backend's candle ops allocate per run ([`vit_bucket_elems`], the largest run), and RBLN
/// keeps every compiled graph's buffers ([`vit_bucket_elems`] per graph).
pub fn visual_bytes(
    cfg: &DeployConfig,
    dims: &ModelDims,
    kind: &DeviceKind,
    opts: &PlanOptions,
) -> PartBytes {
    let t = dtypes(kind, opts, cfg.visual.dtype);
    let p = dims.params();
    let weights = weight_bytes(p.visual, p.visual_vectors, t);
    // The engine runs f32 weights anywhere and bf16 weights on CPUs with AVX512-BF16 (the
    // bf16 kernel; the plan assumes such a host, as the services' own choice at start does
    // on one).
    let cpu_engine = kind.native_dtype.is_none()
        && kind.shared_pool
        && matches!(t.weights, Dtype::F32 | Dtype::Bf16);
    let policy = if cpu_engine {
        BufferPolicy::PerGraph
    } else {
        kind.buffers
    };
    // On one machine's cores each compute device (thread) of the vision service gets its own
    // bucket workspaces (vision-service prepare: "each device gets its own bucket buffers");
    // the weights are shared. Elsewhere the bytes are split over the devices at placement.
    let copies = if cpu_engine && kind.shared_pool {
        (cfg.visual.num_devices as u64).max(1)
    } else {
        1
    };
    let mut buckets: Vec<u32> = cfg.visual.max_seq_len.clone();
    buckets.sort_unstable();
    buckets.dedup();
    let graphs: Vec<Item> = buckets
        .iter()
        .map(|&b| Item {
            part: Part::Visual,
            what: if copies > 1 {
                format!("vit bucket {b} (x{copies} devices)")
            } else {
                format!("vit bucket {b}")
            },
            bytes: if cpu_engine {
                copies * vit_cpu_engine_bytes(dims, b as u64)
            } else {
                vit_bucket_elems(dims, b as u64) * t.activations.bytes()
            },
        })
        .collect();
    let buffers = held(policy, &graphs);
    let held_buffers = if cpu_engine {
        buckets
            .iter()
            .map(|&b| copies * vit_cpu_engine_held_bytes(dims, b as u64))
            .sum()
    } else {
        0
    };
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
        process_baseline: process_baseline(kind),
    }
}

/// [`CPU_PROCESS_BASELINE`] on the CPU backend, else 0.
fn process_baseline(kind: &DeviceKind) -> u64 {
    if kind.native_dtype.is_none() && kind.shared_pool {
        CPU_PROCESS_BASELINE
    } else {
        0
    }
}

/// The LM's bytes on `kind` without the KV cache (`kv_cache` 0).
fn lm_bytes_without_kv(
    cfg: &DeployConfig,
    dims: &ModelDims,
    kind: &DeviceKind,
    opts: &PlanOptions,
) -> PartBytes {
    let t = dtypes(kind, opts, cfg.dtype);
    let p = dims.params();
    let weights = weight_bytes(p.text, p.text_vectors, t);
    let keys = match kind.buffers {
        BufferPolicy::PerGraph => cfg.kvcache_partition_len,
        BufferPolicy::PerRun => cfg.max_seq_len,
    } as u64;
    let a = t.activations.bytes();
    let c = cfg.prefill_chunk_size as u64;
    let mut graphs = vec![Item {
        part: Part::Lm,
        what: format!("prefill chunk {c}"),
        bytes: lm_step_elems(dims, c, 1, keys) * a,
    }];
    for &b in &cfg.decoder_batch_sizes {
        let b = b as u64;
        graphs.push(Item {
            part: Part::Lm,
            what: format!("decode batch {b}"),
            bytes: lm_step_elems(dims, b, b, keys) * a,
        });
    }
    let buffers = held(kind.buffers, &graphs);
    PartBytes {
        part: Part::Lm,
        weights,
        weight_dtype: t.weights,
        activation_dtype: t.activations,
        graphs,
        policy: kind.buffers,
        buffers,
        kv_cache: 0,
        total: weights + buffers,
        // Every LM graph's buffers are per run (candle ops, freed after each step).
        held_buffers: 0,
        process_baseline: process_baseline(kind),
    }
}

fn kv_geometry(
    cfg: &DeployConfig,
    dims: &ModelDims,
    kind: &DeviceKind,
    opts: &PlanOptions,
) -> KvPlan {
    let t = dtypes(kind, opts, cfg.dtype);
    let bytes_per_token = dims.kv_bytes_per_token(t.kv.bytes());
    let per_seq = cfg.blocks_per_sequence();
    KvPlan {
        dtype: t.kv,
        bytes_per_token,
        block_tokens: cfg.kvcache_partition_len,
        block_bytes: bytes_per_token * cfg.kvcache_partition_len as u64,
        max_seq_len: cfg.max_seq_len,
        batch_size: cfg.batch_size,
        blocks: cfg.kvcache_num_blocks,
        automatic: cfg.kvcache_num_blocks == 0,
        extra_blocks: if kind.native_dtype.is_none() && opts.dtype.is_none() {
            1
        } else {
            0
        },
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
fn place_without_kv(
    cfg: &DeployConfig,
    kind: &DeviceKind,
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
                let n = if kind.shared_pool { 1 } else { n as u64 };
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
    kv: &KvPlan,
    placed: &[(Vec<Part>, Vec<Item>)],
) -> (u64, String) {
    let n = if kind.shared_pool {
        1
    } else {
        cfg.num_devices as u64
    };
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
) -> Result<u32, PlanError> {
    resolve_kv_blocks_with(cfg, dims, kind, &PlanOptions::default())
}

/// [`resolve_kv_blocks`] with what-ifs (dtype override; `require_full_batch` makes 0 mean
/// exactly `batch_size` full-length sequences).
pub fn resolve_kv_blocks_with(
    cfg: &DeployConfig,
    dims: &ModelDims,
    kind: &DeviceKind,
    opts: &PlanOptions,
) -> Result<u32, PlanError> {
    if cfg.kvcache_num_blocks != 0 {
        return Ok(cfg.kvcache_num_blocks);
    }
    let kv = kv_geometry(cfg, dims, kind, opts);
    if opts.require_full_batch {
        return Ok(kv.full_batch_blocks);
    }
    let visual = visual_bytes(cfg, dims, kind, opts);
    let lm = lm_bytes_without_kv(cfg, dims, kind, opts);
    let lay = layout(cfg, kind);
    let placed = place_without_kv(cfg, kind, &visual, &lm, &lay);
    let (max, device) = max_blocks(cfg, kind, &kv, &placed);
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

/// Plans `cfg` on devices of `kind`. Never fails: a layout that does not fit comes back with
/// `fits: false`, its problems and the suggestions that would fit.
pub fn plan(cfg: &DeployConfig, dims: &ModelDims, kind: &DeviceKind, opts: &PlanOptions) -> Plan {
    let mut p = plan_only(cfg, dims, kind, opts);
    if !p.fits {
        p.suggestions = super::advice::suggest(cfg, dims, kind, opts, &p);
    }
    p
}

/// The plan without suggestions (what suggestions are checked with; cheaper than [`plan`]).
pub fn plan_only(
    cfg: &DeployConfig,
    dims: &ModelDims,
    kind: &DeviceKind,
    opts: &PlanOptions,
) -> Plan {
    let visual = visual_bytes(cfg, dims, kind, opts);
    let mut lm = lm_bytes_without_kv(cfg, dims, kind, opts);
    let mut kv = kv_geometry(cfg, dims, kind, opts);
    let mut problems = Vec::new();
    match resolve_kv_blocks_with(cfg, dims, kind, opts) {
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
    let placed = place_without_kv(cfg, kind, &visual, &lm, &lay);
    let n_lm = if kind.shared_pool {
        1
    } else {
        cfg.num_devices as u64
    };
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

/// The bytes one service plans to hold on the CPU backend of this machine (RAM from
/// /proc/meminfo): weights in the config's dtype (norms in f32), its graph buffers (the ViT
/// engine's workspaces per compute device; the LM's largest run) and, for the LM, the KV cache
/// as [`resolve_kv_blocks`] sizes it (plus the dummy block); with the process baseline.
///
/// Comparing with process RSS after start-up: [`PartBytes::resident`] is what a service that
/// pre-faults its reservations holds (see the module documentation); per-run buffers are not
/// resident between runs.
pub fn cpu_service_bytes(
    cfg: &DeployConfig,
    dims: &ModelDims,
    service: Service,
) -> Result<PartBytes, PlanError> {
    service_bytes(
        cfg,
        dims,
        &DeviceKind::cpu()?,
        service,
        &PlanOptions::default(),
    )
}

/// [`cpu_service_bytes`] on any kind.
pub fn service_bytes(
    cfg: &DeployConfig,
    dims: &ModelDims,
    kind: &DeviceKind,
    service: Service,
    opts: &PlanOptions,
) -> Result<PartBytes, PlanError> {
    match service {
        Service::Vision => Ok(visual_bytes(cfg, dims, kind, opts)),
        Service::Lm => {
            let blocks = resolve_kv_blocks_with(cfg, dims, kind, opts)?;
            let kv = kv_geometry(cfg, dims, kind, opts);
            let mut lm = lm_bytes_without_kv(cfg, dims, kind, opts);
            lm.kv_cache = (blocks as u64 + kv.extra_blocks as u64) * kv.block_bytes;
            lm.total += lm.kv_cache;
            Ok(lm)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::device::GIB;

    fn cfg(json: &str) -> DeployConfig {
        DeployConfig::from_json(json).unwrap().config
    }

    #[test]
    fn a_cpu_service_resident_figure_is_baseline_weights_held_buffers_and_kv() {
        let c = cfg(r#"{
            "visual": {"max_seq_len": [1024, 4096], "device": [0]},
            "device": [1], "max_seq_len": 4096, "kvcache_partition_len": 256,
            "kvcache_num_blocks": 16, "batch_size": 2
        }"#);
        let dims = ModelDims::qwen3_vl_2b();
        let kind = DeviceKind::cpu_with(64 * GIB);
        let opts = PlanOptions::default();
        let v = service_bytes(&c, &dims, &kind, Service::Vision, &opts).unwrap();
        let held = vit_cpu_engine_held_bytes(&dims, 1024) + vit_cpu_engine_held_bytes(&dims, 4096);
        assert_eq!(v.held_buffers, held);
        assert!(v.held_buffers < v.buffers);
        assert_eq!(v.resident(), CPU_PROCESS_BASELINE + v.weights + held);
        let l = service_bytes(&c, &dims, &kind, Service::Lm, &opts).unwrap();
        assert_eq!(l.held_buffers, 0);
        assert_eq!(l.resident(), CPU_PROCESS_BASELINE + l.weights + l.kv_cache);
        // Device memory of an accelerator carries no process baseline.
        let h = service_bytes(&c, &dims, &DeviceKind::h200(), Service::Lm, &opts).unwrap();
        assert_eq!(h.process_baseline, 0);
    }

    #[test]
    fn every_cpu_vision_device_holds_its_own_workspaces() {
        let one = cfg(r#"{"visual": {"max_seq_len": [1024, 4096], "device": [0]}, "device": [3]}"#);
        let three =
            cfg(r#"{"visual": {"max_seq_len": [1024, 4096], "device": [0, 1, 2]}, "device": [3]}"#);
        let dims = ModelDims::qwen3_vl_2b();
        let kind = DeviceKind::cpu_with(64 * GIB);
        let opts = PlanOptions::default();
        let a = visual_bytes(&one, &dims, &kind, &opts);
        let b = visual_bytes(&three, &dims, &kind, &opts);
        assert_eq!(b.weights, a.weights, "the weights are shared");
        assert_eq!(b.buffers, 3 * a.buffers);
        assert_eq!(b.held_buffers, 3 * a.held_buffers);
        assert!(b.graphs[0].what.contains("x3 devices"), "{:?}", b.graphs[0]);
    }
}
