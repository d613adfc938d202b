//! GGUF pairs as checkpoints: `vlm up` and `vlm plan` take llama.cpp's files.
use super::cache::cache_dir;
use anyhow::{bail, Context};
use std::path::{Path, PathBuf};

/// A file named `*.gguf` (a directory is a checkpoint).
pub fn is_gguf(path: &Path) -> bool {
    path.is_file()
        && path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// The checkpoint directory of a GGUF pair: the Hugging Face files derived from its metadata
/// and a manifest naming the two files (`vlm_model::gguf::materialize`), under the cache dir,
/// one per pair of paths. The services load the weights from the GGUF files themselves.
pub fn gguf_checkpoint(model: &Path, mmproj: Option<&Path>) -> anyhow::Result<PathBuf> {
    use std::hash::{Hash, Hasher};
    let Some(mmproj) = mmproj else {
        bail!(
            "{} is a GGUF LM: give its vision file with --mmproj (llama.cpp's \
             `convert_hf_to_gguf.py --mmproj` writes it)",
            model.display()
        );
    };
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (std::path::absolute(model)?, std::path::absolute(mmproj)?).hash(&mut h);
    let stem = model.file_stem().unwrap_or_default().to_string_lossy();
    // The directory's name is the served model id: the file's, as llama.cpp's server has it.
    let dir = cache_dir()
        .join("gguf")
        .join(format!("{:016x}", h.finish()))
        .join(stem.as_ref());
    vlm_model::gguf::materialize(model, mmproj, &dir)
        .with_context(|| format!("loading GGUF {} + {}", model.display(), mmproj.display()))?;
    eprintln!(
        "GGUF: {} + {} (derived checkpoint files in {})",
        model.display(),
        mmproj.display(),
        dir.display()
    );
    Ok(dir)
}
