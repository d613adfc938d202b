//! The deployment config as every service binary reads it.
use std::path::Path;
use vlm_config::{DeployConfig, DtypeFacts};

/// The config at `path` (its normalization warnings logged), or the defaults when there is no
/// file, with `dtype: auto` resolved against the checkpoint in `model` and this CPU (the
/// choice logged with its reason). The error names the file.
pub fn load_deploy_config(path: Option<&Path>, model: &Path) -> Result<DeployConfig, String> {
    let mut config = match path {
        None => DeployConfig::default_config(),
        Some(path) => {
            let loaded = DeployConfig::from_path(path)
                .map_err(|e| format!("config {}: {e}", path.display()))?;
            for w in &loaded.warnings {
                tracing::warn!("config {}: {w}", path.display());
            }
            loaded.config
        }
    };
    for line in config.resolve_auto_dtype(&DtypeFacts::for_checkpoint(model, cpu_has_bf16())) {
        tracing::info!("{line}");
    }
    Ok(config)
}

/// Whether this CPU runs bf16 products natively (AVX512-BF16).
pub fn cpu_has_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}
