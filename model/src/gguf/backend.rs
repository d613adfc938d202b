//! A GGUF pair as a candle `VarBuilder` backend under Hugging Face names (so the model code
//! loads it as it loads safetensors), plus the quantized tensors the linear layers keep
//! quantized ([`GgufWeights::quantized`]).
use super::file::GgufFile;
use super::names::{gguf_name, GgufName};
use crate::error::{ModelError, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Shape, Tensor};
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct GgufWeights {
    lm: Arc<GgufFile>,
    mmproj: Arc<GgufFile>,
    deepstack: Vec<usize>,
}

/// Whether a tensor type is a block quantization (kept quantized) rather than a float.
pub fn is_block_quantized(t: GgmlDType) -> bool {
    !matches!(t, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
}

impl GgufWeights {
    pub fn new(lm: Arc<GgufFile>, mmproj: Arc<GgufFile>) -> Result<Self> {
        let deepstack = super::derive::deepstack_layers(&mmproj)?;
        Ok(GgufWeights {
            lm,
            mmproj,
            deepstack,
        })
    }

    pub fn lm(&self) -> &GgufFile {
        &self.lm
    }

    fn locate(&self, hf: &str) -> Option<(&GgufFile, String)> {
        match gguf_name(hf, &self.deepstack)? {
            GgufName::Lm(n) => Some((&self.lm, n)),
            GgufName::Mmproj(n) => Some((&self.mmproj, n)),
            GgufName::PatchEmbedSlices => Some((&self.mmproj, "v.patch_embd.weight".into())),
        }
    }

    /// HF tensor `hf` when the file stores it block-quantized; `None` when it is stored as
    /// floats (or absent: the caller's dense load then reports it).
    pub fn quantized(&self, hf: &str) -> Result<Option<Arc<QTensor>>> {
        let Some((file, name)) = self.locate(hf) else {
            return Ok(None);
        };
        match file.tensor_type(&name) {
            Some(t) if is_block_quantized(t) => Ok(Some(Arc::new(file.tensor(&name)?))),
            _ => Ok(None),
        }
    }

    fn dense(&self, hf: &str) -> Result<Tensor> {
        let (file, name) = self
            .locate(hf)
            .ok_or_else(|| ModelError::weights(format!("no GGUF tensor for {hf}")))?;
        if !file.has_tensor(&name) {
            return Err(ModelError::weights(format!(
                "{} has no tensor {name} (for {hf})",
                file.path().display()
            )));
        }
        let read = |n: &str| -> Result<Tensor> { Ok(file.tensor(n)?.dequantize(&Device::Cpu)?) };
        if matches!(
            gguf_name(hf, &self.deepstack),
            Some(GgufName::PatchEmbedSlices)
        ) {
            // (D, C, P, P) twice -> (D, C, 2, P, P): the Conv3d's two temporal slices.
            let t0 = read(&name)?.unsqueeze(2)?;
            let t1 = read(&format!("{name}.1"))?.unsqueeze(2)?;
            return Ok(Tensor::cat(&[&t0, &t1], 2)?);
        }
        read(&name)
    }
}

impl candle_nn::var_builder::SimpleBackend for GgufWeights {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.get_unchecked(name, dtype, dev)?;
        if t.shape() != &s {
            candle_core::bail!(
                "GGUF tensor for {name} has shape {:?}, the model expects {s:?}",
                t.shape()
            )
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = self
            .dense(name)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        t.to_dtype(dtype)?.to_device(dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.locate(name).is_some_and(|(f, n)| f.has_tensor(&n))
    }
}
