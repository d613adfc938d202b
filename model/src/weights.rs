//! Finds a checkpoint's safetensors files (single file or sharded with an index) and opens them
//! memory-mapped. Tensors are read lazily by name, so building only the vision tower (or only the
//! LM) touches only that part's pages: a vision replica never holds LM weights.
use crate::error::{ModelError, Result};
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use std::path::{Path, PathBuf};

/// The safetensors files of a checkpoint directory: `model.safetensors`, or the shards listed in
/// `model.safetensors.index.json`, or else every `model*.safetensors` in the directory.
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ModelError::config(&index, e.to_string()))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ModelError::config(&index, "no \"weight_map\" object"))?;
        let mut files: Vec<PathBuf> = map
            .values()
            .filter_map(|v| v.as_str())
            .map(|f| dir.join(f))
            .collect();
        files.sort();
        files.dedup();
        if let Some(missing) = files.iter().find(|f| !f.is_file()) {
            return Err(ModelError::io(
                missing,
                std::io::Error::new(std::io::ErrorKind::NotFound, "shard listed in the index"),
            ));
        }
        return Ok(files);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| ModelError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension().is_some_and(|x| x == "safetensors")
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("model"))
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ModelError::io(
            single,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no model*.safetensors in the checkpoint",
            ),
        ));
    }
    Ok(files)
}

/// A [`VarBuilder`] over the checkpoint's weights, converting to `dtype` on load.
pub fn var_builder(dir: &Path, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
    let files = safetensors_files(dir)?;
    // SAFETY: the files are mapped read-only; the checkpoint must not be modified while served,
    // which is the same contract every safetensors loader has.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, device)? };
    Ok(vb)
}
