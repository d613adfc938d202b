//! The cross-field rules of the library the config is modelled on (DESIGN.md, "Rules the
//! library enforces"). Each broken rule is an error naming the key, the value and what would be
//! valid; fixes the library applies by itself are warnings.
use crate::error::ConfigError;
use crate::types::DeployConfig;

/// Granularity of `prefill_chunk_size`.
pub const PREFILL_CHUNK_MULTIPLE: u32 = 64;
/// Granularity of ViT buckets (patches come in 2x2 merge blocks).
pub const VIT_BUCKET_MULTIPLE: u32 = 4;

/// Checks every rule, normalizing what the library normalizes (sorting buckets, appending
/// `batch_size` to `decoder_batch_sizes`). Returns the warnings.
pub(crate) fn apply(cfg: &mut DeployConfig) -> Result<Vec<String>, ConfigError> {
    let mut warnings = Vec::new();

    // max_seq_len is a multiple of kvcache_partition_len, and at least two partitions.
    if !cfg.max_seq_len.is_multiple_of(cfg.kvcache_partition_len) {
        let lower =
            (cfg.max_seq_len / cfg.kvcache_partition_len * cfg.kvcache_partition_len) as u64;
        let upper = lower + cfg.kvcache_partition_len as u64;
        return Err(ConfigError::invalid(
            "max_seq_len",
            cfg.max_seq_len,
            format!(
                "must be a multiple of kvcache_partition_len ({}); e.g. {} or {}",
                cfg.kvcache_partition_len,
                if lower > 0 { lower } else { upper },
                upper
            ),
        ));
    }
    if cfg.max_seq_len / cfg.kvcache_partition_len < 2 {
        return Err(ConfigError::invalid(
            "max_seq_len",
            cfg.max_seq_len,
            format!(
                "must be at least two KV partitions (2 x kvcache_partition_len = {}); raise max_seq_len or lower kvcache_partition_len to at most {}",
                2 * cfg.kvcache_partition_len as u64,
                cfg.max_seq_len / 2
            ),
        ));
    }

    // prefill_chunk_size is a positive multiple of 64.
    if cfg.prefill_chunk_size == 0
        || !cfg
            .prefill_chunk_size
            .is_multiple_of(PREFILL_CHUNK_MULTIPLE)
    {
        return Err(ConfigError::invalid(
            "prefill_chunk_size",
            cfg.prefill_chunk_size,
            format!("must be a positive multiple of {PREFILL_CHUNK_MULTIPLE} (e.g. 64, 128, 256)"),
        ));
    }

    // decoder_batch_sizes: every value in 1..=batch_size; a single value must be batch_size;
    // a largest value below batch_size gets batch_size appended.
    let bs = cfg.batch_size;
    if let Some(&bad) = cfg.decoder_batch_sizes.iter().find(|&&b| b == 0 || b > bs) {
        return Err(ConfigError::invalid(
            "decoder_batch_sizes",
            format!("{:?}", cfg.decoder_batch_sizes),
            format!("every value must be between 1 and batch_size ({bs}); {bad} is not"),
        ));
    }
    if cfg.decoder_batch_sizes.len() == 1 && cfg.decoder_batch_sizes[0] != bs {
        return Err(ConfigError::invalid(
            "decoder_batch_sizes",
            format!("{:?}", cfg.decoder_batch_sizes),
            format!(
                "a single decoder batch size must equal batch_size ({bs}); use [{bs}] or list several sizes ending with {bs}"
            ),
        ));
    }
    let mut sizes = cfg.decoder_batch_sizes.clone();
    sizes.sort_unstable();
    sizes.dedup();
    if sizes.len() != cfg.decoder_batch_sizes.len() {
        warnings.push(format!(
            "decoder_batch_sizes {:?} has repeated values; using {:?}",
            cfg.decoder_batch_sizes, sizes
        ));
    }
    if sizes.last() != Some(&bs) {
        warnings.push(format!(
            "decoder_batch_sizes {:?}: the largest value is below batch_size {bs}; appending {bs}",
            cfg.decoder_batch_sizes
        ));
        sizes.push(bs);
    }
    cfg.decoder_batch_sizes = sizes;

    // kvcache_num_blocks: 0 = automatic; otherwise at least one full-length sequence.
    let per_seq = cfg.blocks_per_sequence();
    if cfg.kvcache_num_blocks != 0 {
        if cfg.kvcache_num_blocks < per_seq {
            return Err(ConfigError::invalid(
                "kvcache_num_blocks",
                cfg.kvcache_num_blocks,
                format!(
                    "must be 0 (automatic) or at least max_seq_len / kvcache_partition_len = {per_seq} blocks, the blocks of one full-length sequence"
                ),
            ));
        }
        if (cfg.kvcache_num_blocks as u64) < per_seq as u64 * bs as u64 {
            warnings.push(format!(
                "kvcache_num_blocks {} holds fewer than batch_size ({bs}) full-length sequences ({} blocks); long requests will queue or be preempted",
                cfg.kvcache_num_blocks,
                per_seq as u64 * bs as u64
            ));
        }
    }

    // visual.max_seq_len: positive multiples of 4, ascending.
    let v = &mut cfg.visual;
    if let Some(&bad) = v
        .max_seq_len
        .iter()
        .find(|&&b| b == 0 || b % VIT_BUCKET_MULTIPLE != 0)
    {
        return Err(ConfigError::invalid(
            "visual.max_seq_len",
            format!("{:?}", v.max_seq_len),
            format!(
                "every ViT bucket must be a positive multiple of {VIT_BUCKET_MULTIPLE} (patches come in 2x2 merge blocks); {bad} is not"
            ),
        ));
    }
    let mut buckets = v.max_seq_len.clone();
    buckets.sort_unstable();
    buckets.dedup();
    if buckets != v.max_seq_len {
        warnings.push(format!(
            "visual.max_seq_len {:?} normalized to {:?}",
            v.max_seq_len, buckets
        ));
    }
    v.max_seq_len = buckets;

    // visual pixel limits.
    if v.min_pixels > v.max_pixels {
        return Err(ConfigError::invalid(
            "visual.min_pixels",
            v.min_pixels,
            format!("must be <= visual.max_pixels ({})", v.max_pixels),
        ));
    }
    let largest = *v.max_seq_len.last().unwrap_or(&0) as u64;
    let max_patches = v.max_pixels / 256;
    if largest > max_patches {
        warnings.push(format!(
            "visual.max_seq_len bucket {largest} is larger than any image can be after resize (visual.max_pixels {} = {max_patches} patches)",
            v.max_pixels
        ));
    }
    let smallest_patches = v.min_pixels / 256;
    if largest < smallest_patches {
        warnings.push(format!(
            "every image has at least {smallest_patches} patches after resize (visual.min_pixels {}), over the largest ViT bucket {largest}: every image will be refused or downscaled",
            v.min_pixels
        ));
    }
    if largest / 4 >= cfg.max_seq_len as u64 {
        warnings.push(format!(
            "an image in the largest ViT bucket ({largest} patches = {} tokens) does not fit max_seq_len {}",
            largest / 4,
            cfg.max_seq_len
        ));
    }
    Ok(warnings)
}
