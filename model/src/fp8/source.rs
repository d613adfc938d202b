//! Reading an FP8 checkpoint's e4m3 linear weights and their block scales.
use super::scheme::check_quantization_config;
use super::Fp8Linear;
use crate::error::{ModelError, Result};
use crate::quant_config::{self, is_lm_linear, scales_f32, QuantConfig, LM_LAYERS};
use crate::weights::safetensors_files;
use candle_core::safetensors::MmapedSafetensors;
use safetensors::Dtype;
use std::path::Path;

/// The FP8 tensors of a checkpoint directory, memory-mapped.
pub struct Fp8Source {
    st: MmapedSafetensors,
    block: [usize; 2],
    /// Values of the decoder layers' FP8 linears.
    layer_values: usize,
}

impl std::fmt::Debug for Fp8Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fp8Source(block {:?})", self.block)
    }
}

/// The FP8 tensors of checkpoint `dir` when its config.json says `quant_method: fp8`; `None`
/// otherwise. Refuses, naming the key or tensor: another scheme
/// ([`check_quantization_config`]) and FP8 tensors outside the LM's linear layers.
pub fn open_dir(dir: &Path) -> Result<Option<Fp8Source>> {
    let (path, QuantConfig::Fp8(q)) = quant_config::read(dir)? else {
        return Ok(None);
    };
    let block = check_quantization_config(&q).map_err(|m| ModelError::config(&path, m))?;
    let files = safetensors_files(dir)?;
    // SAFETY: mapped read-only; the checkpoint must not change while served (as for every
    // safetensors loader).
    let st = unsafe { MmapedSafetensors::multi(&files)? };
    let mut layer_values = 0;
    for (name, view) in st.tensors() {
        if !matches!(view.dtype(), Dtype::F8_E4M3 | Dtype::F8_E5M2) {
            continue;
        }
        if view.dtype() == Dtype::F8_E5M2 || !is_lm_linear(&name, ".weight") {
            return Err(ModelError::weights(format!(
                "{name} is {:?}: only the LM's linear layers run FP8 (e4m3) here (the vision \
                 tower, embeddings and norms are served in floats; such checkpoints list them \
                 in `modules_to_not_convert`)",
                view.dtype()
            )));
        }
        if name.starts_with(LM_LAYERS) {
            layer_values += view.shape().iter().product::<usize>();
        }
    }
    Ok(Some(Fp8Source {
        st,
        block,
        layer_values,
    }))
}

impl Fp8Source {
    /// Values of the decoder layers' FP8 linear weights.
    pub fn layer_fp8(&self) -> usize {
        self.layer_values
    }

    /// The config's block size `[rows, inputs]`.
    pub fn block(&self) -> [usize; 2] {
        self.block
    }

    /// `{prefix}.weight` with its `{prefix}.weight_scale_inv` when the weight is stored FP8;
    /// `None` when it is stored in floats (or absent: the float loader names it).
    pub fn linear(&self, prefix: &str) -> Result<Option<Fp8Linear>> {
        let name = format!("{prefix}.weight");
        let Ok(view) = self.st.get(&name) else {
            return Ok(None);
        };
        if view.dtype() != Dtype::F8_E4M3 {
            return Ok(None);
        }
        let &[n, k] = view.shape() else {
            return Err(ModelError::weights(format!(
                "{name} has shape {:?}; an FP8 linear weight is (out, in)",
                view.shape()
            )));
        };
        let [bn, bk] = self.block;
        if !k.is_multiple_of(bk) {
            return Err(ModelError::weights(format!(
                "{name} has {k} inputs, not a multiple of the block's {bk} \
                 (quantization_config.weight_block_size)"
            )));
        }
        let scale_name = format!("{prefix}.weight_scale_inv");
        let sv = self.st.get(&scale_name).map_err(|_| {
            ModelError::weights(format!(
                "{name} is FP8 but {scale_name} (its block scales) is missing"
            ))
        })?;
        let want = [n.div_ceil(bn), k / bk];
        if sv.shape() != want {
            return Err(ModelError::weights(format!(
                "{scale_name} has shape {:?}; {name} of [{n}, {k}] in blocks of [{bn}, {bk}] \
                 (the config's weight_block_size) takes {want:?}",
                sv.shape()
            )));
        }
        let scales = scales_f32(&scale_name, &sv)?;
        let codes = view.data().to_vec();
        if let Some(at) = codes.iter().position(|&c| c & 0x7F == 0x7F) {
            return Err(ModelError::weights(format!(
                "{name} holds NaN (value {at}); FP8 weights are finite"
            )));
        }
        Ok(Some(Fp8Linear {
            n,
            k,
            block_n: bn,
            block_k: bk,
            codes,
            scales,
        }))
    }
}
