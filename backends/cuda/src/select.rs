//! Which kernel a step runs and how it is launched: decided on the host from the shapes alone,
//! so it is tested without a GPU.
//!
//! * Decode attention: `paged_decode_{bf16,f32}_hd{N}` when the head size has an instance
//!   ([`DECODE_HEAD_DIMS`]) and the heads divide into the KV heads; otherwise the generic
//!   candle-op attention (`vlm_model::text::paged_attention`), which any shape runs.
//! * The context is split (flash-decoding) so that a small batch still fills the GPU: enough
//!   (head, row, split) blocks for [`BLOCKS_PER_SM`] per multiprocessor, each split at least
//!   [`MIN_SPLIT_TOKENS`] tokens, at most [`MAX_SPLITS`] splits.
use vlm_compute::{ComputeError, Result};

/// Head sizes with a compiled decode kernel (`src/kernels/vlm_kernels.cu`'s `PAGED_DECODE`
/// instances).
pub const DECODE_HEAD_DIMS: [usize; 5] = [16, 32, 64, 128, 256];
/// Warps per decode block (`DECODE_WARPS` in the kernel).
pub const DECODE_WARPS: u32 = 4;
pub const BLOCKS_PER_SM: usize = 2;
pub const MIN_SPLIT_TOKENS: usize = 64;
pub const MAX_SPLITS: usize = 64;
/// Threads per block of the element-wise kernels (silu·mul, KV writes).
pub const ELEMENTWISE_THREADS: u32 = 256;

/// What the KV cache holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheDtype {
    Bf16,
    F32,
}

impl CacheDtype {
    pub fn suffix(self) -> &'static str {
        match self {
            CacheDtype::Bf16 => "bf16",
            CacheDtype::F32 => "f32",
        }
    }
}

/// The decode-attention kernel for this head geometry, or `None` for the generic path.
pub fn decode_kernel(
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    cache: CacheDtype,
) -> Option<String> {
    let grouped = kv_heads > 0 && heads.is_multiple_of(kv_heads);
    (grouped && DECODE_HEAD_DIMS.contains(&head_dim))
        .then(|| format!("paged_decode_{}_hd{head_dim}", cache.suffix()))
}

/// One decode-attention launch: grid (heads, rows, splits) of `threads` threads, each split
/// `split_len` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLaunch {
    pub grid: (u32, u32, u32),
    pub threads: u32,
    pub split_len: u32,
}

impl DecodeLaunch {
    pub fn splits(&self) -> usize {
        self.grid.2 as usize
    }
    /// f32 values of the split partials (rows, heads, splits, head_dim + 2).
    pub fn partial_len(&self, head_dim: usize) -> usize {
        self.grid.0 as usize * self.grid.1 as usize * self.splits() * (head_dim + 2)
    }
}

/// The launch for `rows` rows of `heads` query heads whose longest context is `max_ctx` tokens,
/// on a GPU of `multiprocessors` SMs.
pub fn decode_launch(
    heads: usize,
    rows: usize,
    max_ctx: usize,
    multiprocessors: usize,
) -> Result<DecodeLaunch> {
    if heads == 0 || rows == 0 {
        return Err(ComputeError::invalid(format!(
            "a decode launch needs heads and rows (got {heads} heads, {rows} rows)"
        )));
    }
    let to_u32 = |v: usize, what: &str| {
        u32::try_from(v).map_err(|_| ComputeError::invalid(format!("{what} {v} is over u32")))
    };
    let ctx = max_ctx.max(1);
    let want = (BLOCKS_PER_SM * multiprocessors.max(1)).div_ceil(heads * rows);
    let splits = want
        .min(ctx.div_ceil(MIN_SPLIT_TOKENS))
        .clamp(1, MAX_SPLITS);
    Ok(DecodeLaunch {
        grid: (
            to_u32(heads, "heads")?,
            to_u32(rows, "rows")?,
            splits as u32,
        ),
        threads: 32 * DECODE_WARPS,
        split_len: to_u32(ctx.div_ceil(splits), "split length")?,
    })
}

/// Blocks of [`ELEMENTWISE_THREADS`] for `n` elements.
pub fn elementwise_blocks(n: usize) -> Result<u32> {
    u32::try_from(n.div_ceil(ELEMENTWISE_THREADS as usize).max(1))
        .map_err(|_| ComputeError::invalid(format!("{n} elements is over one launch")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_exist_for_the_model_head_sizes() {
        // Qwen3-VL-2B: 16 heads over 8 KV heads of 128; the tiny fixture: 4 over 2 of 16.
        assert_eq!(
            decode_kernel(16, 8, 128, CacheDtype::Bf16).as_deref(),
            Some("paged_decode_bf16_hd128")
        );
        assert_eq!(
            decode_kernel(4, 2, 16, CacheDtype::F32).as_deref(),
            Some("paged_decode_f32_hd16")
        );
        assert_eq!(decode_kernel(16, 8, 96, CacheDtype::Bf16), None);
        assert_eq!(decode_kernel(12, 8, 128, CacheDtype::Bf16), None);
    }

    #[test]
    fn kernel_names_are_in_the_source() {
        let src = include_str!("kernels/vlm_kernels.cu");
        for hd in DECODE_HEAD_DIMS {
            for c in [CacheDtype::Bf16, CacheDtype::F32] {
                let name = decode_kernel(2, 1, hd, c).unwrap();
                assert!(src.contains(&format!("PAGED_DECODE({name},")), "{name}");
            }
        }
        assert!(src.contains(&format!("#define DECODE_WARPS {DECODE_WARPS}")));
    }

    #[test]
    fn small_batches_split_the_context_to_fill_the_gpu() {
        // One row, 16 heads, 4k context, 132 SMs: 264 blocks wanted -> 17 splits of 241.
        let l = decode_launch(16, 1, 4096, 132).unwrap();
        assert_eq!(l.grid, (16, 1, 17));
        assert_eq!(l.split_len, 241);
        assert!(l.split_len as usize * l.splits() >= 4096);
        // 64 rows fill the GPU on their own: no split.
        assert_eq!(decode_launch(16, 64, 4096, 132).unwrap().splits(), 1);
        // A short context is not split below MIN_SPLIT_TOKENS.
        assert_eq!(decode_launch(16, 1, 100, 132).unwrap().splits(), 2);
        assert_eq!(decode_launch(16, 1, 1, 132).unwrap().splits(), 1);
        // Capped.
        assert_eq!(
            decode_launch(1, 1, 1 << 20, 1000).unwrap().splits(),
            MAX_SPLITS
        );
        assert!(decode_launch(0, 1, 10, 1).is_err());
    }
}
