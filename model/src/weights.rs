//! Finds a checkpoint's safetensors files (single file or sharded with an index) and opens them
//! memory-mapped. Tensors are read lazily by name, so building only the vision tower (or only the
//! LM) touches only that part's pages: a vision replica never holds LM weights.
use crate::error::{ModelError, Result};
use crate::fp8::{Fp8Linear, Fp8Source};
use crate::gguf::GgufWeights;
use crate::w4a16::{Int4Linear, Int4Source};
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
    int4: Option<Arc<Int4Source>>,
    fp8: Option<Arc<Fp8Source>>,
}

impl Weights {
    pub fn new(vb: VarBuilder<'static>, gguf: Option<Arc<GgufWeights>>) -> Self {
        Weights {
            vb,
            gguf,
            int8: None,
            int4: None,
            fp8: None,
        }
    }

    /// The checkpoint in `dir` (safetensors, W8A8 or W4A16 safetensors, or a GGUF directory), floats as
    /// `dtype`.
    pub fn open(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let gguf = crate::gguf::open_dir(dir)?.map(Arc::new);
        let vb = match &gguf {
            Some(g) => VarBuilder::from_backend(Box::new((**g).clone()), dtype, device.clone()),
            None => var_builder(dir, dtype, device)?,
        };
        let (int8, int4, fp8) = match &gguf {
            Some(_) => (None, None, None),
            None => (
                crate::w8a8::open_dir(dir)?.map(Arc::new),
                crate::w4a16::open_dir(dir)?.map(Arc::new),
                crate::fp8::open_dir(dir)?.map(Arc::new),
            ),
        };
        Ok(Weights {
            vb,
            gguf,
            int8,
            int4,
            fp8,
        })
    }

    pub fn pp(&self, s: impl ToString) -> Self {
        Weights {
            vb: self.vb.pp(s),
            gguf: self.gguf.clone(),
            int8: self.int8.clone(),
            int4: self.int4.clone(),
            fp8: self.fp8.clone(),
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

    /// Values of the decoder layers' linear weights the checkpoint stores FP8 (0 otherwise),
    /// and the block's input width (1 when none).
    pub fn layer_fp8(&self) -> (usize, usize) {
        self.fp8
            .as_ref()
            .map_or((0, 1), |s| (s.layer_fp8(), s.block()[1]))
    }

    /// `{prefix}.weight` and its `{prefix}.weight_scale_inv` when the checkpoint stores the
    /// linear weight at this prefix FP8.
    pub fn fp8_linear(&self) -> Result<Option<Fp8Linear>> {
        match &self.fp8 {
            Some(s) => s.linear(&self.vb.prefix()),
            None => Ok(None),
        }
    }

    /// (values, scales) of the decoder layers' linear weights the checkpoint stores
    /// 4-bit (a W4A16 directory); (0, 0) otherwise.
    pub fn layer_int4(&self) -> (usize, usize) {
        self.int4.as_ref().map_or((0, 0), |s| s.layer_int4())
    }

    /// `{prefix}.weight_packed` with its scales when the checkpoint stores the linear weight
    /// at this prefix 4-bit (W4A16).
    pub fn int4_linear(&self) -> Result<Option<Int4Linear>> {
        match &self.int4 {
            Some(s) => s.linear(&self.vb.prefix()),
            None => Ok(None),
        }
    }
}
