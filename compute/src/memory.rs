//! What a loaded backend holds, as it reports it (the planner's figures come from the same
//! functions of the backend, see `vlm_config::plan::Sizing`).

/// The LM's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LmMemory {
    /// Weights as stored (a tied `lm_head` counted once).
    pub weight_bytes: u64,
    /// One KV block: `block_len` tokens x layers x K and V x kv heads x head_dim x dtype bytes.
    pub kv_block_bytes: u64,
    /// Blocks allocated, usable ones plus any the backend keeps for itself (a dummy block for
    /// padded decode rows).
    pub kv_blocks_allocated: u64,
    /// Buffers held for the process's life besides weights and KV (0 when every step
    /// allocates its own).
    pub held_bytes: u64,
}

impl LmMemory {
    pub fn kv_bytes(&self) -> u64 {
        self.kv_block_bytes * self.kv_blocks_allocated
    }
}

/// One ViT bucket's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketMemory {
    /// Raw patches.
    pub bucket: usize,
    /// Peak bytes of one run at this bucket (buffers held and per-run ones).
    pub bytes: u64,
    /// Of `bytes`, what is allocated at load and held (the rest is per run).
    pub held_bytes: u64,
}

/// The ViT's memory on one device of the pool.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VisionMemory {
    pub weight_bytes: u64,
    /// Whether the weights are one copy shared with the pool's other devices (host cores) or
    /// this device's own (accelerators).
    pub weights_shared: bool,
    pub buckets: Vec<BucketMemory>,
}
