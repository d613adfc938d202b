//! `vlm up`'s context length and KV pool when it runs without a config: as long a context as
//! the checkpoint and this machine's memory allow (up to [`CONTEXT_CAP`] unless
//! `--max-model-len` asks for more), and a KV pool the memory planner sizes
//! ([`vlm_config::plan::resolve_kv_blocks`], the same answer the LM would compute) capped at
//! what the batch needs. A config file sets these itself; this is only the embedded default.
use anyhow::{bail, Context as _};
use std::path::Path;
use vlm_config::plan::{human, PlanError, PlanOptions};
use vlm_config::DeployConfig;

/// The longest context picked without `--max-model-len`: long prompts (16K-token documents,
/// long videos) are served by default, while the KV pool for a batch stays a fraction of a
/// small machine's memory.
pub const CONTEXT_CAP: u32 = 32768;

/// KV tokens the default pool holds per sequence of the batch (and at least one full-length
/// sequence): 32 rows x 2048 tokens = 64K tokens, 7 GiB for the 2B in bf16. An FP8 cache
/// (`--kv-cache-dtype fp8`) holds twice the tokens in those bytes.
pub const POOL_TOKENS_PER_ROW: u64 = 2048;

/// What `vlm up` runs the LM with, and the line it prints about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpContext {
    pub max_seq_len: u32,
    pub kv_blocks: u32,
    pub line: String,
}

/// Chooses `max_seq_len` and `kvcache_num_blocks` for `cfg` (its dtype and devices already
/// resolved) on this machine. `want` is `--max-model-len`: taken as it is (rounded down to a
/// whole KV block) or refused naming what limits it; without it the longest context up to
/// [`CONTEXT_CAP`] whose full-length sequence fits in memory.
pub fn choose(cfg: &DeployConfig, model: &Path, want: Option<u32>) -> anyhow::Result<UpContext> {
    let checkpoint = vlm_compute::Qwen3VlConfig::from_dir(model)
        .with_context(|| format!("reading {}", model.display()))?
        .text
        .max_position_embeddings as u32;
    let block = cfg.kvcache_partition_len;
    if let Some(w) = want {
        if w > checkpoint {
            bail!("--max-model-len {w} is over the checkpoint's max_position_embeddings of {checkpoint}");
        }
        if w < block {
            bail!("--max-model-len {w} is under one KV block of {block} tokens");
        }
    }
    let dims = vlm_config::plan::ModelDims::from_dir(model)?;
    let backend = vlm_backends::Backend::resolve(&cfg.kernels, cfg.dtype, vlm_backends::Part::Lm)?;
    let kind = vlm_backends::device_kind(backend, &cfg.device)?;
    let mut len = want.unwrap_or(checkpoint.min(CONTEXT_CAP)) / block * block;
    loop {
        let mut c = cfg.clone();
        c.max_seq_len = len;
        c.kvcache_num_blocks = 0;
        let sizing = vlm_backends::sizing(&c, &kind, &PlanOptions::default())?;
        match vlm_config::plan::resolve_kv_blocks(&c, &dims, &kind, sizing.as_ref()) {
            Ok(fits) => {
                // `fits` is what memory holds, up to batch_size full-length sequences.
                let per_row = match c.kv_cache_dtype {
                    vlm_config::KvCacheDtype::Auto => POOL_TOKENS_PER_ROW,
                    vlm_config::KvCacheDtype::Fp8E4m3 => 2 * POOL_TOKENS_PER_ROW,
                };
                let cap_tokens = (len as u64).max(c.batch_size as u64 * per_row);
                let cap = cap_tokens.div_ceil(block as u64) as u32;
                let blocks = fits.min(cap);
                let bytes = vlm_config::plan::kv_pool_bytes(&c, &dims, blocks, sizing.as_ref());
                let why = match want {
                    Some(_) => "--max-model-len".to_string(),
                    None if len < checkpoint.min(CONTEXT_CAP) / block * block => {
                        "the longest whose full-length sequence fits this machine's memory; \
                         --max-model-len to change"
                            .to_string()
                    }
                    None => {
                        format!("the checkpoint allows {checkpoint}; --max-model-len to change")
                    }
                };
                let line = format!(
                    "context: max_seq_len {len} ({why}); KV pool {blocks} blocks of {block} = {} \
                     tokens, {} (memory holds {} blocks)",
                    blocks as u64 * block as u64,
                    human(bytes),
                    fits
                );
                return Ok(UpContext {
                    max_seq_len: len,
                    kv_blocks: blocks,
                    line,
                });
            }
            Err(e @ PlanError::KvTooSmall { .. }) if want.is_some() || len / 2 < block => {
                return Err(e.into())
            }
            Err(PlanError::KvTooSmall { .. }) => len = len / 2 / block * block,
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("tiny");
        let opts = vlm_make_model::MakeOptions::new(vlm_make_model::Preset::Tiny);
        vlm_make_model::make_model(&model, &opts).unwrap();
        (dir, model)
    }

    #[test]
    fn the_default_context_is_the_checkpoints_and_the_pool_fits_the_batch() {
        let (_dir, model) = tiny();
        let cfg = DeployConfig::from_json(
            r#"{"batch_size": 32, "decoder_batch_sizes": [1, 32], "kvcache_partition_len": 256}"#,
        )
        .unwrap()
        .config;
        let c = choose(&cfg, &model, None).unwrap();
        // The tiny checkpoint allows 4096 positions; its KV is small, so memory holds all 32
        // sequences and the pool is the batch's 32 x 2048 tokens.
        assert_eq!(c.max_seq_len, 4096, "{}", c.line);
        assert_eq!(
            c.kv_blocks as u64 * 256,
            32 * POOL_TOKENS_PER_ROW,
            "{}",
            c.line
        );
        assert!(c.line.contains("allows 4096"), "{}", c.line);
        // An FP8 cache: twice the tokens, in the bytes the bf16 pool would take.
        let mut fp8 = cfg.clone();
        fp8.kv_cache_dtype = vlm_config::KvCacheDtype::Fp8E4m3;
        let f = choose(&fp8, &model, None).unwrap();
        assert_eq!(f.kv_blocks, 2 * c.kv_blocks, "{}", f.line);
    }

    #[test]
    fn max_model_len_is_taken_or_refused_naming_the_limit() {
        let (_dir, model) = tiny();
        let cfg = DeployConfig::default_config();
        let c = choose(&cfg, &model, Some(2000)).unwrap();
        assert_eq!(
            c.max_seq_len,
            2000 / cfg.kvcache_partition_len * cfg.kvcache_partition_len
        );
        let e = choose(&cfg, &model, Some(8192)).unwrap_err().to_string();
        assert!(e.contains("8192") && e.contains("4096"), "{e}");
    }
}
