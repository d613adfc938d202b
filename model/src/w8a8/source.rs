//! Reading a W8A8 checkpoint's int8 linear weights and their per-channel scales.
use super::scheme::check_quantization_config;
use super::Int8Linear;
use crate::error::{ModelError, Result};
use crate::quant_config::{self, is_lm_linear, scales_f32, QuantConfig, LM_LAYERS};
use crate::weights::safetensors_files;
use candle_core::safetensors::MmapedSafetensors;
use safetensors::Dtype;
use std::path::Path;

/// The int8 tensors of a W8A8 checkpoint directory, memory-mapped.
pub struct Int8Source {
    st: MmapedSafetensors,
    /// Values and output rows of the decoder layers' int8 linears (a checkpoint may keep some
    /// of them in floats, listed in `ignore`).
    layer_values: usize,
    layer_rows: usize,
}

impl std::fmt::Debug for Int8Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Int8Source")
    }
}

/// The W8A8 tensors of checkpoint `dir` when its config.json says `quant_method:
/// compressed-tensors` in a format other than `pack-quantized`; `None` for a float, W4A16 or
/// GGUF-derived checkpoint. Refuses, naming the key or tensor: another quantization method
/// ([`quant_config::read`]), another compressed-tensors scheme, and int8
/// tensors outside the LM's linear layers (the vision tower and the embeddings run in floats:
/// such checkpoints list them in `ignore`).
pub fn open_dir(dir: &Path) -> Result<Option<Int8Source>> {
    let (path, QuantConfig::W8A8(q)) = quant_config::read(dir)? else {
        return Ok(None);
    };
    check_quantization_config(&q).map_err(|m| ModelError::config(&path, m))?;
    let files = safetensors_files(dir)?;
    // SAFETY: mapped read-only; the checkpoint must not change while served (as for every
    // safetensors loader).
    let st = unsafe { MmapedSafetensors::multi(&files)? };
    let (mut layer_values, mut layer_rows) = (0, 0);
    for (name, view) in st.tensors() {
        if view.dtype() != Dtype::I8 {
            continue;
        }
        if !is_lm_linear(&name, ".weight") {
            return Err(ModelError::weights(format!(
                "{name} is int8: only the LM's linear layers run W8A8 here (the vision tower, \
                 embeddings and norms are served in floats; such checkpoints list them in \
                 `ignore`)"
            )));
        }
        if name.starts_with(LM_LAYERS) {
            layer_values += view.shape().iter().product::<usize>();
            layer_rows += view.shape().first().copied().unwrap_or(0);
        }
    }
    Ok(Some(Int8Source {
        st,
        layer_values,
        layer_rows,
    }))
}

impl Int8Source {
    /// (values, output rows) of the decoder layers' int8 linear weights.
    pub fn layer_int8(&self) -> (usize, usize) {
        (self.layer_values, self.layer_rows)
    }

    /// `{prefix}.weight` with its `{prefix}.weight_scale` when the weight is stored int8;
    /// `None` when it is stored in floats (or absent: the float loader names it).
    pub fn linear(&self, prefix: &str) -> Result<Option<Int8Linear>> {
        let name = format!("{prefix}.weight");
        let Ok(view) = self.st.get(&name) else {
            return Ok(None);
        };
        if view.dtype() != Dtype::I8 {
            return Ok(None);
        }
        let &[n, k] = view.shape() else {
            return Err(ModelError::weights(format!(
                "{name} has shape {:?}; an int8 linear weight is (out, in)",
                view.shape()
            )));
        };
        let scale_name = format!("{prefix}.weight_scale");
        let sv = self.st.get(&scale_name).map_err(|_| {
            ModelError::weights(format!(
                "{name} is int8 but {scale_name} (its per-channel scales) is missing"
            ))
        })?;
        if sv.shape() != [n, 1] && sv.shape() != [n] {
            return Err(ModelError::weights(format!(
                "{scale_name} has shape {:?}; per-channel scales of {name} are [{n}, 1] (a \
                 group or block layout is not served)",
                sv.shape()
            )));
        }
        let scales = scales_f32(&scale_name, &sv)?;
        let values = view.data().iter().map(|&b| b as i8).collect();
        Ok(Some(Int8Linear {
            n,
            k,
            values,
            scales,
        }))
    }
}
