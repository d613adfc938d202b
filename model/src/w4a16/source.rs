//! Reading a W4A16 checkpoint's packed 4-bit linear weights and their group scales.
use super::scheme::check_quantization_config;
use super::Int4Linear;
use crate::error::{ModelError, Result};
use crate::quant_config::{self, is_lm_linear, scales_f32, QuantConfig, LM_LAYERS};
use crate::weights::safetensors_files;
use candle_core::safetensors::MmapedSafetensors;
use safetensors::Dtype;
use std::path::Path;

/// The packed tensors of a W4A16 checkpoint directory, memory-mapped.
pub struct Int4Source {
    st: MmapedSafetensors,
    group: usize,
    /// Values of the decoder layers' 4-bit linears.
    layer_values: usize,
}

impl std::fmt::Debug for Int4Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Int4Source(group {})", self.group)
    }
}

/// The W4A16 tensors of checkpoint `dir` when its config.json says compressed-tensors
/// `pack-quantized`; `None` otherwise. Refuses, naming the key or tensor: another scheme
/// ([`check_quantization_config`]), packed tensors outside the LM's linear layers, zero points
/// and group indices.
pub fn open_dir(dir: &Path) -> Result<Option<Int4Source>> {
    let (path, QuantConfig::W4A16(q)) = quant_config::read(dir)? else {
        return Ok(None);
    };
    let group = check_quantization_config(&q).map_err(|m| ModelError::config(&path, m))?;
    let files = safetensors_files(dir)?;
    // SAFETY: mapped read-only; the checkpoint must not change while served (as for every
    // safetensors loader).
    let st = unsafe { MmapedSafetensors::multi(&files)? };
    let mut layer_values = 0;
    for (name, view) in st.tensors() {
        for refused in ["weight_zero_point", "weight_g_idx"] {
            if name.ends_with(refused) {
                return Err(ModelError::weights(format!(
                    "{name}: {refused} is not served (symmetric groups in file order are)"
                )));
            }
        }
        if !name.ends_with(".weight_packed") {
            continue;
        }
        if !is_lm_linear(&name, ".weight_packed") {
            return Err(ModelError::weights(format!(
                "{name} is packed 4-bit: only the LM's linear layers run W4A16 here (the vision \
                 tower, embeddings and norms are served in floats; such checkpoints list them in \
                 `ignore`)"
            )));
        }
        if name.starts_with(LM_LAYERS) {
            let &[n, words] = view.shape() else {
                return Err(ModelError::weights(format!(
                    "{name} has shape {:?}; packed weights are (out, in / 8)",
                    view.shape()
                )));
            };
            layer_values += n * words * 8;
        }
    }
    Ok(Some(Int4Source {
        st,
        group,
        layer_values,
    }))
}

impl Int4Source {
    /// (values, scales) of the decoder layers' 4-bit linear weights.
    pub fn layer_int4(&self) -> (usize, usize) {
        (self.layer_values, self.layer_values / self.group)
    }

    /// `{prefix}.weight_packed` with its scales and shape when the weight is stored packed;
    /// `None` when it is stored in floats (the float loader reads or names it).
    pub fn linear(&self, prefix: &str) -> Result<Option<Int4Linear>> {
        let name = format!("{prefix}.weight_packed");
        let Ok(view) = self.st.get(&name) else {
            return Ok(None);
        };
        let (&[n, words], Dtype::I32) = (view.shape(), view.dtype()) else {
            return Err(ModelError::weights(format!(
                "{name} is {:?} {:?}; packed weights are int32 (out, in / 8)",
                view.dtype(),
                view.shape()
            )));
        };
        let shape_name = format!("{prefix}.weight_shape");
        let sv = self.st.get(&shape_name).map_err(|_| {
            ModelError::weights(format!("{name} is packed but {shape_name} is missing"))
        })?;
        let dims: Vec<i64> = match sv.dtype() {
            Dtype::I64 => sv
                .data()
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap_or_default()))
                .collect(),
            Dtype::I32 => sv
                .data()
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap_or_default()) as i64)
                .collect(),
            other => {
                return Err(ModelError::weights(format!(
                    "{shape_name} is {other:?}; the shape is int64 or int32"
                )))
            }
        };
        let k = match dims[..] {
            [rows, k]
                if rows == n as i64 && k > 8 * (words as i64 - 1) && k <= 8 * words as i64 =>
            {
                k as usize
            }
            _ => {
                return Err(ModelError::weights(format!(
                    "{shape_name} is {dims:?}; {name} of [{n}, {words}] holds [{n}, {}]",
                    8 * words
                )))
            }
        };
        let scale_name = format!("{prefix}.weight_scale");
        let scv = self.st.get(&scale_name).map_err(|_| {
            ModelError::weights(format!(
                "{name} is packed but {scale_name} (its group scales) is missing"
            ))
        })?;
        let group = self.group;
        if !k.is_multiple_of(group) || scv.shape() != [n, k / group] {
            return Err(ModelError::weights(format!(
                "{scale_name} has shape {:?}; {prefix} of [{n}, {k}] in groups of {group} (the \
                 config's group_size) takes [{n}, {}]",
                scv.shape(),
                k / group
            )));
        }
        let scales = scales_f32(&scale_name, &scv)?;
        let data = view.data();
        let mut values = vec![0i8; n * k];
        for (r, row) in values.chunks_exact_mut(k).enumerate() {
            let packed = &data[r * words * 4..(r + 1) * words * 4];
            for (i, v) in row.iter_mut().enumerate() {
                // Value i of the row: word i / 8, bits 4 (i % 8) (`pack_to_int32`, little-endian
                // words), stored + 8.
                let byte = packed[i / 2];
                let nibble = if i % 2 == 0 { byte & 0xF } else { byte >> 4 };
                *v = nibble as i8 - 8;
            }
        }
        Ok(Some(Int4Linear {
            n,
            k,
            group,
            values,
            scales,
        }))
    }
}
