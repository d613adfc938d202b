//! The memory plan's device from the GPU itself: its free memory when the service starts
//! (`cuMemGetInfo`, read by `gpu::device::memory`), less a margin for what the plan does not
//! count (the CUDA context's own allocations made later, cuBLAS workspaces, the allocator's
//! rounding), not a hard-coded device kind.
use vlm_config::plan::{BufferPolicy, DeviceKind};

/// What `cuMemGetInfo` says of one GPU, with its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuMemory {
    pub name: String,
    pub free: u64,
    pub total: u64,
}

/// Kept back from the free memory: 2% of the card, at least 512 MiB (cuBLAS(Lt) takes up to
/// 32 MiB of workspace per handle on Hopper; module loads and the stream-ordered pool's
/// granularity take the rest).
pub fn reserve(total: u64) -> u64 {
    (total / 50).max(512 << 20)
}

/// The planner's device for one GPU as it is now: capacity = the free memory (what this
/// process can still take), `reserved` = [`reserve`].
pub fn device_kind(mem: &GpuMemory) -> DeviceKind {
    DeviceKind {
        name: mem.name.clone(),
        capacity: mem.free,
        reserved: reserve(mem.total).min(mem.free),
        native_dtype: None,
        buffers: BufferPolicy::PerRun,
        shared_pool: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_takes_free_memory_less_the_margin() {
        let h200 = GpuMemory {
            name: "NVIDIA H200".into(),
            free: 140_000_000_000,
            total: 150_754_820_096,
        };
        let k = device_kind(&h200);
        assert_eq!(k.capacity, 140_000_000_000);
        assert_eq!(k.reserved, 150_754_820_096 / 50);
        assert!(!k.shared_pool);
        // A nearly full small card: the margin is 512 MiB, never more than what is free.
        let small = GpuMemory {
            name: "x".into(),
            free: 100 << 20,
            total: 8 << 30,
        };
        assert_eq!(device_kind(&small).reserved, 100 << 20);
        assert_eq!(reserve(8 << 30), 512 << 20);
    }
}
