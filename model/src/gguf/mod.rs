//! GGUF checkpoints, as llama.cpp writes them: an LM file (`general.architecture = qwen3vl`) and
//! its `--mmproj` vision file (`clip`, projector `qwen3vl_merger`).
//!
//! [`materialize`] writes a small checkpoint directory for the pair: the Hugging Face JSON
//! files derived from the metadata ([`derive`]) and `gguf.json` naming the two files. Every part
//! that reads a checkpoint directory (planner, tokenizer, processor, services) then reads it
//! unchanged, and [`crate::weights::var_builder`] loads the weights from the GGUF files: block-
//! quantized linear weights stay quantized ([`GgufWeights::quantized`]), float tensors load as
//! the model's dtype.
mod backend;
pub mod derive;
mod file;
mod names;
mod writer;

pub use backend::{is_block_quantized, GgufWeights};
pub use file::{GgufFile, SUPPORTED_TYPES};
pub use names::{gguf_name, GgufName};
pub use writer::{quantize_checkpoint, Scheme};

use crate::error::{ModelError, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A file named `*.gguf` (a directory is a checkpoint).
pub fn is_gguf(path: &Path) -> bool {
    path.is_file()
        && path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// The checkpoint directory a service reads for `--model` (and `--mmproj`): a directory as
/// given, or for a GGUF LM file and its vision file the directory [`materialize`] writes
/// under `root`, one per pair of paths (`root/<hash>/<LM file stem>`: the stem is the served
/// model id, as llama.cpp's server has it). Every part of the system resolves the same pair to
/// the same files.
pub fn resolve_model(model: &Path, mmproj: Option<&Path>, root: &Path) -> Result<PathBuf> {
    use std::hash::{Hash, Hasher};
    if !is_gguf(model) {
        if mmproj.is_some() {
            return Err(ModelError::invalid(format!(
                "--mmproj goes with a GGUF --model; {} is a checkpoint directory, which holds \
                 its vision tower",
                model.display()
            )));
        }
        return Ok(model.to_path_buf());
    }
    let Some(mmproj) = mmproj else {
        return Err(ModelError::invalid(format!(
            "{} is a GGUF LM: give its vision file with --mmproj (llama.cpp's \
             `convert_hf_to_gguf.py --mmproj` writes it)",
            model.display()
        )));
    };
    let abs = |p: &Path| std::path::absolute(p).map_err(|e| ModelError::io(p, e));
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (abs(model)?, abs(mmproj)?).hash(&mut h);
    let stem = model.file_stem().unwrap_or_default().to_string_lossy();
    let dir = root
        .join(format!("{:016x}", h.finish()))
        .join(stem.as_ref());
    materialize(model, mmproj, &dir)?;
    Ok(dir)
}

/// The manifest file of a directory [`materialize`] wrote.
pub const MANIFEST: &str = "gguf.json";

/// The GGUF pair of a checkpoint directory, when it is one [`materialize`] wrote.
pub fn manifest(dir: &Path) -> Result<Option<(PathBuf, PathBuf)>> {
    let path = dir.join(MANIFEST);
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| ModelError::config(&path, e.to_string()))?;
    let get = |k: &str| -> Result<PathBuf> {
        v.get(k)
            .and_then(|p| p.as_str())
            .map(PathBuf::from)
            .ok_or_else(|| ModelError::config(&path, format!("no \"{k}\" path")))
    };
    Ok(Some((get("model")?, get("mmproj")?)))
}

/// Opens the GGUF pair of `dir` when it has a manifest.
pub fn open_dir(dir: &Path) -> Result<Option<GgufWeights>> {
    let Some((lm, mmproj)) = manifest(dir)? else {
        return Ok(None);
    };
    let lm = Arc::new(GgufFile::open(&lm)?);
    let mmproj = Arc::new(GgufFile::open(&mmproj)?);
    Ok(Some(GgufWeights::new(lm, mmproj)?))
}

/// Writes the checkpoint directory `out` for LM file `model` and vision file `mmproj`: the
/// derived JSON files and the manifest (absolute paths; the GGUF files are not copied).
/// Refuses a pair this server cannot run, naming the key or tensor.
pub fn materialize(model: &Path, mmproj: &Path, out: &Path) -> Result<()> {
    let abs = |p: &Path| std::path::absolute(p).map_err(|e| ModelError::io(p, e));
    let (model, mmproj) = (abs(model)?, abs(mmproj)?);
    let lm = GgufFile::open(&model)?;
    let mm = GgufFile::open(&mmproj)?;
    derive::check_architecture(&lm, &mm)?;
    let tokens = derive::Tokens::read(&lm)?;
    let mut config = derive::config_json(&lm, &mm, &tokens)?;
    // What the planner sizes the LM's weights by (`ModelDims::lm_stored_bytes`): block-
    // quantized tensors twice (candle's kernels keep a repacked copy beside the file's
    // layout: the 2B in Q8_0 stores 1.83 GB and holds ~3.7 GB), float tensors as stored.
    let quantized = lm.tensor_bytes(|_, t| is_block_quantized(t));
    let floats = lm.tensor_bytes(|_, t| !is_block_quantized(t));
    config["quantization_config"] = serde_json::json!({
        "quant_method": "gguf",
        "lm_weight_bytes": 2 * quantized + floats,
    });
    // The served model id: the LM file's name, as llama.cpp's server reports it.
    if let Some(stem) = model.file_stem() {
        config["_name_or_path"] = serde_json::json!(stem.to_string_lossy());
    }
    let files = [
        ("config.json", config),
        ("tokenizer.json", derive::tokenizer_json(&lm, &tokens)?),
        (
            "tokenizer_config.json",
            derive::tokenizer_config_json(&lm, &tokens)?,
        ),
        (
            "generation_config.json",
            derive::generation_config_json(&lm),
        ),
        (
            "preprocessor_config.json",
            derive::preprocessor_config_json(&mm)?,
        ),
        (
            MANIFEST,
            serde_json::json!({"model": model, "mmproj": mmproj}),
        ),
    ];
    std::fs::create_dir_all(out).map_err(|e| ModelError::io(out, e))?;
    for (name, value) in files {
        let path = out.join(name);
        let text = serde_json::to_string_pretty(&value)
            .map_err(|e| ModelError::config(&path, e.to_string()))?;
        // Written beside and renamed into place: services started at once on one host derive
        // the same files, and none reads a half-written one.
        let tmp = out.join(format!(".{name}.{}", std::process::id()));
        std::fs::write(&tmp, text).map_err(|e| ModelError::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| ModelError::io(&path, e))?;
    }
    Ok(())
}
