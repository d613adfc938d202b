//! The paged KV cache: tensors only. Which blocks belong to which sequence is the caller's
//! bookkeeping (the LM service's block manager); it hands a block table to each forward step.
//!
//! Layout per layer, K and V alike: `(num_blocks + 1, kv_heads, block_len, head_dim)`, in the
//! cache dtype: bf16 for a model whose weights are bf16 (as the reference's cache holds its
//! bf16 k/v states; half the bytes to read per decode step and to hold per token), else f32;
//! FP8 E4M3 codes when the config's `kv_cache_dtype` asks (a scale of 1.0, vLLM's uncalibrated
//! `fp8`: half a bf16 cache's bytes again).
//! * Block-major so that a block id from a block table addresses one contiguous slab.
//! * Head before position: the keys of one kv head inside a block are one contiguous
//!   (block_len, head_dim) matrix, so attention reads `(kv_heads, len, head_dim)` of a block as a
//!   strided view with no copy and multiplies it directly (see `attention.rs`).
//! * The last block (`dummy_block()`) takes the writes of padded decode rows; nothing reads it.
//!
//! The tensors are zero-initialised and pre-faulted on the CPU (`resident::zeros_resident`):
//! the pool a service reserves is really held from start-up, as the memory plan says. Kernels
//! that read the layout directly (a backend's paged attention) take [`PagedKvCache::layer`] and
//! [`PagedKvCache::geometry`].
use crate::error::{ModelError, Result};
use candle_core::{DType, Device, Tensor};
use vlm_compute::TextConfig;

/// Where token t of a sequence sits in one layer's K (or V) storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheGeometry {
    pub kv_heads: usize,
    pub block_len: usize,
    pub head_dim: usize,
}

impl CacheGeometry {
    /// Offset (in values) of kv head `kvh`, token `t` of the sequence whose blocks are `table`.
    #[inline]
    pub fn offset(&self, table: &[u32], kvh: usize, t: usize) -> usize {
        let block = table[t / self.block_len] as usize;
        ((block * self.kv_heads + kvh) * self.block_len + t % self.block_len) * self.head_dim
    }
}

#[derive(Debug)]
pub struct PagedKvCache {
    /// Per layer, (num_blocks + 1, kv_heads, block_len, head_dim).
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    num_blocks: usize,
    block_len: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
}

impl PagedKvCache {
    /// A cache of `num_blocks` usable blocks of `block_len` tokens (plus the dummy block),
    /// holding `dtype` (f32, bf16 or f8e4m3) values.
    pub fn new(
        cfg: &TextConfig,
        num_blocks: usize,
        block_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if num_blocks == 0 || block_len == 0 {
            return Err(ModelError::kv_cache(format!(
                "a paged KV cache needs at least one block of at least one token \
                 (got {num_blocks} blocks of {block_len})"
            )));
        }
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F8E4M3) {
            return Err(ModelError::kv_cache(format!(
                "a KV cache of {dtype:?} is not supported (f32, bf16, f8e4m3)"
            )));
        }
        let shape = (
            num_blocks + 1,
            cfg.num_key_value_heads,
            block_len,
            cfg.head_dim,
        );
        let mut k = Vec::with_capacity(cfg.num_hidden_layers);
        let mut v = Vec::with_capacity(cfg.num_hidden_layers);
        for _ in 0..cfg.num_hidden_layers {
            k.push(crate::resident::zeros_resident(shape, dtype, device)?);
            v.push(crate::resident::zeros_resident(shape, dtype, device)?);
        }
        Ok(PagedKvCache {
            k,
            v,
            num_blocks,
            block_len,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            dtype,
        })
    }

    /// Bytes a cache of this geometry and dtype takes (K and V of every layer, dummy block
    /// included).
    pub fn bytes_for(cfg: &TextConfig, num_blocks: usize, block_len: usize, dtype: DType) -> usize {
        (num_blocks + 1) * block_len * cfg.kv_bytes_per_token(dtype.size_in_bytes())
    }

    /// Bytes of all K and V tensors (dummy block included).
    pub fn bytes(&self) -> usize {
        2 * self.k.len()
            * (self.num_blocks + 1)
            * self.kv_heads
            * self.block_len
            * self.head_dim
            * self.dtype.size_in_bytes()
    }

    /// Usable blocks (ids 0..num_blocks).
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    pub fn block_len(&self) -> usize {
        self.block_len
    }
    /// The id of the block padded rows write to (== num_blocks).
    pub fn dummy_block(&self) -> u32 {
        self.num_blocks as u32
    }
    pub fn num_layers(&self) -> usize {
        self.k.len()
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_len)
    }

    /// One layer's K and V storage, each (num_blocks + 1, kv_heads, block_len, head_dim).
    pub fn layer(&self, layer: usize) -> (&Tensor, &Tensor) {
        (&self.k[layer], &self.v[layer])
    }

    /// Checks that a block table covers `tokens` tokens with valid, usable block ids.
    pub fn check_table(&self, table: &[u32], tokens: usize, what: &str) -> Result<()> {
        Ok(vlm_compute::check_table(
            table,
            tokens,
            self.num_blocks,
            self.block_len,
            what,
        )?)
    }

    /// Writes k, v: (n, kv_heads, head_dim) of tokens at cache indices [start, start+n) of the
    /// sequence whose blocks are `table`.
    pub fn write(
        &self,
        layer: usize,
        table: &[u32],
        start: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let n = k.dim(0)?;
        // (n, kv, hd) -> (kv, n, hd): the in-block layout.
        let k = k.transpose(0, 1)?.contiguous()?;
        let v = v.transpose(0, 1)?.contiguous()?;
        let mut done = 0;
        while done < n {
            let pos = start + done;
            let block = table[pos / self.block_len] as usize;
            let off = pos % self.block_len;
            let len = (self.block_len - off).min(n - done);
            self.write_run(
                layer,
                block,
                off,
                &k.narrow(1, done, len)?,
                &v.narrow(1, done, len)?,
            )?;
            done += len;
        }
        Ok(())
    }

    /// Writes one token's k, v: (kv_heads, head_dim) at `slot` of `block` (any block, the dummy
    /// included).
    pub fn write_slot(
        &self,
        layer: usize,
        block: u32,
        slot: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let k = k.unsqueeze(1)?.contiguous()?;
        let v = v.unsqueeze(1)?.contiguous()?;
        self.write_run(layer, block as usize, slot, &k, &v)
    }

    /// k, v: (kv_heads, len, head_dim) contiguous, into block `block` at offset `off`.
    fn write_run(
        &self,
        layer: usize,
        block: usize,
        off: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let k = k.contiguous()?.to_dtype(self.dtype)?;
        let v = v.contiguous()?.to_dtype(self.dtype)?;
        // `get(block)` is a contiguous (kv, block_len, hd) view sharing the cache's storage;
        // slice_set copies `len` rows per head at `off` in place.
        self.k[layer].get(block)?.slice_set(&k, 1, off)?;
        self.v[layer].get(block)?.slice_set(&v, 1, off)?;
        Ok(())
    }

    /// The geometry of one layer's K (and V) storage.
    pub fn geometry(&self) -> CacheGeometry {
        CacheGeometry {
            kv_heads: self.kv_heads,
            block_len: self.block_len,
            head_dim: self.head_dim,
        }
    }

    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The cached K and V of tokens [0, len) of a sequence, as per-block f32 views
    /// `(kv_heads, n_i, head_dim)` (strided, no copy, for an f32 cache; widened copies of a
    /// bf16 or FP8 one), in order.
    pub fn read(&self, layer: usize, table: &[u32], len: usize) -> Result<Vec<(Tensor, Tensor)>> {
        let mut out = Vec::with_capacity(self.blocks_for(len));
        let mut done = 0;
        while done < len {
            let block = table[done / self.block_len] as usize;
            let n = (len - done).min(self.block_len);
            let k = self.k[layer].get(block)?.narrow(1, 0, n)?;
            let v = self.v[layer].get(block)?.narrow(1, 0, n)?;
            let (k, v) = if self.dtype == DType::F32 {
                (k, v)
            } else {
                (k.to_dtype(DType::F32)?, v.to_dtype(DType::F32)?)
            };
            out.push((k, v));
            done += n;
        }
        Ok(out)
    }
}
