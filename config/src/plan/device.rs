//! Device kinds: capacity, what the runtime keeps back, the native dtype and how bucket graphs
//! hold their buffers.
use super::PlanError;
use crate::types::Dtype;
use serde::Serialize;

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// How a part's per-bucket buffers occupy memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BufferPolicy {
    /// Every compiled graph (each ViT bucket, the prefill graph, each decode graph) keeps its
    /// own buffers for as long as the runtime lives: the part holds their sum (RBLN NPUs).
    PerGraph,
    /// Buffers are allocated for a run and freed after it; a part runs one graph at a time, so
    /// it holds the largest one (this project's candle backend, CPU or CUDA).
    PerRun,
}

/// A kind of device the plan places parts on.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceKind {
    pub name: String,
    /// Bytes of memory of one device.
    pub capacity: u64,
    /// Bytes the runtime/driver keeps back on each device.
    pub reserved: u64,
    /// The dtype weights, KV cache and activations take on this kind (an RBLN NPU's), unless
    /// `--dtype` says otherwise. `None` = a kind this project's backends run on (their
    /// `Sizing` says which dtypes).
    pub native_dtype: Option<Dtype>,
    /// How the kind's runtime holds graph buffers (reported; the plan takes the backend's).
    pub buffers: BufferPolicy,
    /// Every device id is the same memory (CPU cores of one machine): all parts land in one
    /// pool, named `host`.
    pub shared_pool: bool,
}

impl DeviceKind {
    /// RBLN ATOM: 16 GiB per device, 288 MiB kept by the runtime.
    pub fn atom() -> DeviceKind {
        DeviceKind {
            name: "atom".into(),
            capacity: 16 * GIB,
            reserved: 288 * MIB,
            native_dtype: Some(Dtype::Bf16),
            buffers: BufferPolicy::PerGraph,
            shared_pool: false,
        }
    }

    /// RBLN REBEL (Rebel100): 144 GiB per device over 4 chiplets, 1 GiB kept per chiplet.
    pub fn rebel() -> DeviceKind {
        DeviceKind {
            name: "rebel".into(),
            capacity: 144 * GIB,
            reserved: 4 * GIB,
            native_dtype: Some(Dtype::Bf16),
            buffers: BufferPolicy::PerGraph,
            shared_pool: false,
        }
    }

    /// One chiplet of a REBEL: 36 GiB, 1 GiB kept. Not a kind the brief names: it is the
    /// capacity under which the seed's Rebel100 statements all hold (see tests/plan_seeds.rs).
    pub fn rebel_chiplet() -> DeviceKind {
        DeviceKind {
            name: "rebel-chiplet".into(),
            capacity: 36 * GIB,
            reserved: GIB,
            native_dtype: Some(Dtype::Bf16),
            buffers: BufferPolicy::PerGraph,
            shared_pool: false,
        }
    }

    /// NVIDIA H200: 141 GB (decimal) per GPU; our candle CUDA backend.
    pub fn h200() -> DeviceKind {
        DeviceKind {
            name: "h200".into(),
            capacity: 141_000_000_000,
            reserved: 0,
            native_dtype: None,
            buffers: BufferPolicy::PerRun,
            shared_pool: false,
        }
    }

    /// This machine's RAM (`MemTotal` of /proc/meminfo); our candle CPU backend, where a
    /// device id is a core and every core shares the one memory.
    pub fn cpu() -> Result<DeviceKind, PlanError> {
        Ok(Self::cpu_with(mem_total()?))
    }

    /// The CPU backend with the memory a starting service may really take: `MemAvailable` of
    /// /proc/meminfo, or the container's cgroup limit (`memory.max`) when that is lower. The LM
    /// service sizes `kvcache_num_blocks: 0` against this rather than `MemTotal`, because it
    /// pre-faults what it reserves: memory other processes use is not there to take.
    pub fn cpu_available() -> Result<DeviceKind, PlanError> {
        let mut bytes = meminfo_field("MemAvailable:")?;
        if let Some(limit) = cgroup_memory_max() {
            bytes = bytes.min(limit);
        }
        Ok(Self::cpu_with(bytes))
    }

    /// The CPU backend with `capacity` bytes of RAM.
    pub fn cpu_with(capacity: u64) -> DeviceKind {
        DeviceKind {
            name: "cpu".into(),
            capacity,
            reserved: 0,
            native_dtype: None,
            buffers: BufferPolicy::PerRun,
            shared_pool: true,
        }
    }

    /// `atom`, `rebel`, `rebel-chiplet`, `h200` or `cpu`.
    pub fn by_name(name: &str) -> Result<DeviceKind, PlanError> {
        match name.to_ascii_lowercase().as_str() {
            "atom" => Ok(Self::atom()),
            "rebel" | "rebel100" => Ok(Self::rebel()),
            "rebel-chiplet" => Ok(Self::rebel_chiplet()),
            "h200" => Ok(Self::h200()),
            "cpu" => Self::cpu(),
            _ => Err(PlanError::Device(format!(
                "unknown device kind `{name}`; known: atom, rebel, rebel-chiplet, h200, cpu (or give --device-memory BYTES)"
            ))),
        }
    }

    /// A kind with an explicit capacity, everything else from `base`.
    pub fn with_capacity(mut self, capacity: u64) -> DeviceKind {
        self.capacity = capacity;
        self
    }

    /// Bytes a device offers after the reservation.
    pub fn usable(&self) -> u64 {
        self.capacity.saturating_sub(self.reserved)
    }
}

/// `MemTotal` of /proc/meminfo, in bytes.
pub fn mem_total() -> Result<u64, PlanError> {
    meminfo_field("MemTotal:")
}

/// The cgroup v2 memory limit of this process, when one is set.
fn cgroup_memory_max() -> Option<u64> {
    std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// A `kB` field of /proc/meminfo, in bytes.
fn meminfo_field(field: &str) -> Result<u64, PlanError> {
    let text = std::fs::read_to_string("/proc/meminfo").map_err(|e| {
        PlanError::Device(format!(
            "cannot read /proc/meminfo for the cpu kind: {e}; give --device-memory BYTES"
        ))
    })?;
    text.lines()
        .find_map(|l| {
            let rest = l.strip_prefix(field)?;
            let kb: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
            Some(kb * KIB)
        })
        .ok_or_else(|| {
            PlanError::Device(format!(
                "no {field} in /proc/meminfo; give --device-memory BYTES"
            ))
        })
}

/// Parses a byte count: `17179869184`, `16GiB`, `16G` (= GiB), `141GB`, `512MiB`, `1.5TiB`.
pub fn parse_bytes(text: &str) -> Result<u64, PlanError> {
    let t = text.trim().replace('_', "");
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| {
        PlanError::Device(format!(
            "`{text}` is not a byte count (e.g. 17179869184, 16GiB, 141GB)"
        ))
    })?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => KIB as f64,
        "m" | "mib" => MIB as f64,
        "g" | "gib" => GIB as f64,
        "t" | "tib" => (GIB * KIB) as f64,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        u => {
            return Err(PlanError::Device(format!(
                "`{text}`: unknown unit `{u}` (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            )))
        }
    };
    Ok((n * mult).round() as u64)
}

/// `1.75 GiB`, `288.0 MiB`, `112.0 KiB`, `12 B`.
pub fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if bytes >= GIB {
        format!("{:.2} GiB", b / GIB as f64)
    } else if bytes >= MIB {
        format!("{:.1} MiB", b / MIB as f64)
    } else if bytes >= KIB {
        format!("{:.1} KiB", b / KIB as f64)
    } else {
        format!("{bytes} B")
    }
}
