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
        std::fs::write(&path, text).map_err(|e| ModelError::io(&path, e))?;
    }
    Ok(())
}
