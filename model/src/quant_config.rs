//! Which loader reads a checkpoint directory's quantized weights: its config.json's
//! `quantization_config`, classified. A method or compressed-tensors format this server does not
//! run is refused here, naming the key and what is served.
use crate::error::{ModelError, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// `quantization_config.quant_method` of compressed-tensors checkpoints (llm-compressor's).
pub const COMPRESSED_TENSORS: &str = "compressed-tensors";

/// How a directory's weights are stored.
#[derive(Debug, Clone, PartialEq)]
pub enum QuantConfig {
    /// Floats (no `quantization_config`), or no config.json at all.
    Floats,
    /// A GGUF pair's derived directory (its weights come from the GGUF files).
    Gguf,
    /// compressed-tensors `int-quantized` (W8A8): the config to check ([`crate::w8a8`]).
    W8A8(Value),
    /// compressed-tensors `pack-quantized` (W4A16): the config to check ([`crate::w4a16`]).
    W4A16(Value),
    /// `quant_method: fp8` (Qwen's and DeepSeek's FP8 block layout): the config to check
    /// ([`crate::fp8`]).
    Fp8(Value),
}

/// The classification of `dir`'s config.json, with that file's path (for the errors).
pub fn read(dir: &Path) -> Result<(PathBuf, QuantConfig)> {
    let path = dir.join("config.json");
    if !path.is_file() {
        return Ok((path, QuantConfig::Floats));
    }
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    let config: Value =
        serde_json::from_str(&text).map_err(|e| ModelError::config(&path, e.to_string()))?;
    let Some(q) = config.get("quantization_config").filter(|q| !q.is_null()) else {
        return Ok((path, QuantConfig::Floats));
    };
    let kind = match q.get("quant_method").and_then(Value::as_str) {
        Some("gguf") => QuantConfig::Gguf,
        Some("fp8") => QuantConfig::Fp8(q.clone()),
        Some(COMPRESSED_TENSORS) => match q.get("format").and_then(Value::as_str) {
            Some("pack-quantized") => QuantConfig::W4A16(q.clone()),
            // `int-quantized`, or a format the W8A8 check names as not served.
            _ => QuantConfig::W8A8(q.clone()),
        },
        other => {
            return Err(ModelError::config(
                &path,
                format!(
                    "quantization_config.quant_method {other:?} is not served (compressed-tensors \
                     W8A8 `int-quantized` and W4A16 `pack-quantized` directories, `fp8` block \
                     directories and GGUF files are)"
                ),
            ))
        }
    };
    Ok((path, kind))
}

/// The LM's decoder layers, whose linear weights the quantized directories hold quantized.
pub(crate) const LM_LAYERS: &str = "model.language_model.layers.";

/// Names under which a compressed-tensors checkpoint may hold a quantized linear: the LM's
/// decoder layers and its head (`{prefix}.{suffix}`).
pub(crate) fn is_lm_linear(name: &str, suffix: &str) -> bool {
    (name.starts_with(LM_LAYERS) || name.starts_with("lm_head.")) && name.ends_with(suffix)
}

/// The parts of a compressed-tensors `quantization_config` no served scheme has: a KV cache
/// scheme and sparsity are refused, naming the key; otherwise its `config_groups`.
pub(crate) fn check_extras(
    q: &Value,
) -> std::result::Result<&serde_json::Map<String, Value>, String> {
    if let Some(kv) = q.get("kv_cache_scheme").filter(|v| !v.is_null()) {
        return Err(format!(
            "quantization_config.kv_cache_scheme {kv} is not served (the KV cache dtype is the \
             server's `kv_cache_dtype` option)"
        ));
    }
    if let Some(s) = q
        .get("sparsity_config")
        .filter(|v| !v.is_null() && v.as_object().is_none_or(|o| !o.is_empty()))
    {
        return Err(format!(
            "quantization_config.sparsity_config {s} is not served"
        ));
    }
    q.get("config_groups")
        .and_then(Value::as_object)
        .filter(|g| !g.is_empty())
        .ok_or_else(|| "quantization_config has no config_groups".into())
}

/// The values of scale tensor `name` (f32, bf16 or f16) as f32; refused, naming it, when of
/// another dtype or holding a value that is not finite and >= 0.
pub(crate) fn scales_f32(
    name: &str,
    view: &safetensors::tensor::TensorView<'_>,
) -> Result<Vec<f32>> {
    use safetensors::Dtype;
    let bytes = view.data();
    let scales: Vec<f32> = match view.dtype() {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(ModelError::weights(format!(
                "{name} is {other:?}; scales are f32, bf16 or f16"
            )))
        }
    };
    if let Some(bad) = scales.iter().find(|s| !s.is_finite() || **s < 0.0) {
        return Err(ModelError::weights(format!(
            "{name} holds {bad}; scales are finite and >= 0"
        )));
    }
    Ok(scales)
}
