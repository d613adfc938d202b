//! Finds a checkpoint's safetensors files (single file or sharded with an index) and opens them
//! memory-mapped. Tensors are read lazily by name, so building only the vision tower (or only the
//! LM) touches only that part's pages: a vision replica never holds LM weights.
use crate::error::{ModelError, Result};
use crate::gguf::GgufWeights;
use crate::w8a8::{Int8Linear, Int8Source};
use candle_core::quantized::QTensor;
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use std::path::{Path, PathBuf};
use std::sync::Arc;

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

/// A [`VarBuilder`] over the checkpoint's weights, converting to `dtype` on load: its
/// safetensors files, or the GGUF pair of a directory [`crate::gguf::materialize`] wrote.
pub fn var_builder(dir: &Path, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
    if let Some(g) = crate::gguf::open_dir(dir)? {
        return Ok(VarBuilder::from_backend(Box::new(g), dtype, device.clone()));
    }
    let files = safetensors_files(dir)?;
    // SAFETY: the files are mapped read-only; the checkpoint must not be modified while served,
    // which is the same contract every safetensors loader has.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, device)? };
    Ok(vb)
}

/// The weights of a model being built: a [`VarBuilder`] at some prefix, and the GGUF pair when
/// the checkpoint is one, whose block-quantized linear weights load quantized
/// ([`Self::quantized`]) instead of through the builder.
#[derive(Clone)]
pub struct Weights {
    vb: VarBuilder<'static>,
    gguf: Option<Arc<GgufWeights>>,
    int8: Option<Arc<Int8Source>>,
}

impl Weights {
    pub fn new(vb: VarBuilder<'static>, gguf: Option<Arc<GgufWeights>>) -> Self {
        Weights {
            vb,
            gguf,
            int8: None,
        }
    }

    /// The checkpoint in `dir` (safetensors, W8A8 safetensors, or a GGUF directory), floats as
    /// `dtype`.
    pub fn open(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let gguf = crate::gguf::open_dir(dir)?.map(Arc::new);
        let vb = match &gguf {
            Some(g) => VarBuilder::from_backend(Box::new((**g).clone()), dtype, device.clone()),
            None => var_builder(dir, dtype, device)?,
        };
        let int8 = match &gguf {
            Some(_) => None,
            None => crate::w8a8::open_dir(dir)?.map(Arc::new),
        };
        Ok(Weights { vb, gguf, int8 })
    }

    pub fn pp(&self, s: impl ToString) -> Self {
        Weights {
            vb: self.vb.pp(s),
            gguf: self.gguf.clone(),
            int8: self.int8.clone(),
        }
    }

    pub fn vb(&self) -> &VarBuilder<'static> {
        &self.vb
    }

    /// `{prefix}.{name}` when the checkpoint stores it block-quantized.
    pub fn quantized(&self, name: &str) -> Result<Option<Arc<QTensor>>> {
        match &self.gguf {
            Some(g) => g.quantized(&format!("{}.{name}", self.vb.prefix())),
            None => Ok(None),
        }
    }

    /// (values, output rows) of the decoder layers' linear weights the checkpoint stores
    /// int8 (a W8A8 directory); (0, 0) otherwise.
    pub fn layer_int8(&self) -> (usize, usize) {
        self.int8.as_ref().map_or((0, 0), |s| s.layer_int8())
    }

    /// `{prefix}.weight` and its `{prefix}.weight_scale` when the checkpoint stores the
    /// linear weight at this prefix int8 (W8A8).
    pub fn int8_linear(&self) -> Result<Option<Int8Linear>> {
        match &self.int8 {
            Some(s) => s.linear(&self.vb.prefix()),
            None => Ok(None),
        }
    }
}
