//! GGUF pairs as checkpoints: `vlm up` and `vlm plan` take llama.cpp's files.
use super::cache::cache_dir;
use anyhow::Context;
use std::path::{Path, PathBuf};

/// A file named `*.gguf` (a directory is a checkpoint).
pub fn is_gguf(path: &Path) -> bool {
    vlm_model::gguf::is_gguf(path)
}

/// The checkpoint directory of a GGUF pair (`vlm_model::gguf::resolve_model`) under the cache
/// dir: the Hugging Face files derived from its metadata and a manifest naming the two files.
/// The services load the weights from the GGUF files themselves.
pub fn gguf_checkpoint(model: &Path, mmproj: Option<&Path>) -> anyhow::Result<PathBuf> {
    let dir = vlm_model::gguf::resolve_model(model, mmproj, &cache_dir().join("gguf"))
        .with_context(|| format!("loading GGUF {}", model.display()))?;
    eprintln!(
        "GGUF: {} + {} (derived checkpoint files in {})",
        model.display(),
        mmproj.map_or("-".into(), |m| m.display().to_string()),
        dir.display()
    );
    Ok(dir)
}
