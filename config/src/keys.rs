//! The keys the config knows, their older spellings, and the nearest-key suggestion for an
//! unknown one.

/// Keys of the top level (the LM), canonical spellings.
pub const LM_KEYS: &[&str] = &[
    "max_seq_len",
    "kvcache_partition_len",
    "kvcache_num_blocks",
    "batch_size",
    "decoder_batch_sizes",
    "prefill_chunk_size",
    "num_devices",
    "device",
    "create_runtimes",
    "dtype",
    "kernels",
    "prefix_caching",
    "kv_cache_dtype",
    "visual",
];

/// Keys of the `visual` section, canonical spellings.
pub const VISUAL_KEYS: &[&str] = &[
    "max_seq_len",
    "num_devices",
    "device",
    "create_runtimes",
    "min_pixels",
    "max_pixels",
    "oversize",
    "dtype",
    "kernels",
];

/// Keys of `kernels` (the LM's kernel choices).
pub const LM_KERNEL_KEYS: &[&str] = &["backend", "bf16_dot", "amx", "simd"];

/// Keys of `visual.kernels`: the LM's and the ViT engine's own.
pub const VISUAL_KERNEL_KEYS: &[&str] = &[
    "backend",
    "bf16_dot",
    "amx",
    "simd",
    "attention_tiles",
    "profile",
];

/// Older spelling -> canonical spelling, accepted at both levels.
pub const ALIASES: &[(&str, &str)] = &[
    ("max_seq_lens", "max_seq_len"),
    ("tensor_parallel_size", "num_devices"),
];

/// The canonical name of `key`, if it is an older spelling.
pub fn canonical(key: &str) -> &str {
    ALIASES
        .iter()
        .find(|(old, _)| *old == key)
        .map(|(_, new)| *new)
        .unwrap_or(key)
}

/// The known key closest to `key` (edit distance at most a third of its length, at least 2),
/// among `known` and the aliases.
pub fn suggest(key: &str, known: &[&str]) -> Option<String> {
    let candidates = known
        .iter()
        .copied()
        .chain(ALIASES.iter().map(|(old, _)| *old));
    let (best, dist) = candidates
        .map(|k| (k, edit_distance(&key.to_ascii_lowercase(), k)))
        .min_by_key(|(_, d)| *d)?;
    let limit = (key.len() / 3).max(2);
    (dist <= limit).then(|| best.to_string())
}

/// Levenshtein distance.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_nearest() {
        assert_eq!(
            suggest("max_seq_le", LM_KEYS).as_deref(),
            Some("max_seq_len")
        );
        assert_eq!(suggest("batchsize", LM_KEYS).as_deref(), Some("batch_size"));
        assert_eq!(suggest("devices", VISUAL_KEYS).as_deref(), Some("device"));
        assert_eq!(suggest("completely_different", LM_KEYS), None);
    }
}
