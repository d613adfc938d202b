//! The deployment config as every service binary reads it.
use std::path::Path;
use vlm_config::DeployConfig;

/// The config at `path` (its normalization warnings logged), or the defaults when there is no
/// file. The error names the file.
pub fn load_deploy_config(path: Option<&Path>) -> Result<DeployConfig, String> {
    let Some(path) = path else {
        return Ok(DeployConfig::default_config());
    };
    let loaded =
        DeployConfig::from_path(path).map_err(|e| format!("config {}: {e}", path.display()))?;
    for w in &loaded.warnings {
        tracing::warn!("config {}: {w}", path.display());
    }
    Ok(loaded.config)
}
