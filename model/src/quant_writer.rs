//! What `vlm quantize` writes for the compressed-tensors schemes (`w8a8`, `w4a16`): the source
//! checkpoint's tensors with the LM's decoder linears replaced by the scheme's tensors, one
//! `model.safetensors`, and every other file copied (config.json with the scheme's
//! `quantization_config`).
use crate::error::{ModelError, Result};
use crate::weights::safetensors_files;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};
use safetensors::{Dtype, View};
use std::borrow::Cow;
use std::path::Path;

/// Whether `name` is a weight the schemes quantize: every projection of the LM's decoder layers
/// (the head, embeddings, norms and the vision tower stay as they are).
fn is_quantized(name: &str) -> bool {
    const LINEARS: [&str; 7] = [
        ".self_attn.q_proj.weight",
        ".self_attn.k_proj.weight",
        ".self_attn.v_proj.weight",
        ".self_attn.o_proj.weight",
        ".mlp.gate_proj.weight",
        ".mlp.up_proj.weight",
        ".mlp.down_proj.weight",
    ];
    name.starts_with(crate::quant_config::LM_LAYERS) && LINEARS.iter().any(|l| name.ends_with(l))
}

/// One tensor to write: borrowed from the source, or made by the scheme.
pub(crate) struct Out<'a> {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Cow<'a, [u8]>,
}

impl Out<'static> {
    pub fn owned(dtype: Dtype, shape: Vec<usize>, data: Vec<u8>) -> Self {
        Out {
            dtype,
            shape,
            data: Cow::Owned(data),
        }
    }
}

impl View for &Out<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// `v` as the checkpoint stores it in `dtype`.
pub(crate) fn stored(v: f32, dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::from_f32(v).to_f32(),
        DType::F16 => half::f16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// Scales as a tensor of the checkpoint's float dtype.
pub(crate) fn scale_bytes(scales: &[f32], dtype: DType) -> (Dtype, Vec<u8>) {
    match dtype {
        DType::BF16 => (
            Dtype::BF16,
            scales
                .iter()
                .flat_map(|s| half::bf16::from_f32(*s).to_le_bytes())
                .collect(),
        ),
        DType::F16 => (
            Dtype::F16,
            scales
                .iter()
                .flat_map(|s| half::f16::from_f32(*s).to_le_bytes())
                .collect(),
        ),
        _ => (
            Dtype::F32,
            scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
        ),
    }
}

/// A scheme's tensors for one linear weight: given its prefix (`...q_proj`), its (n, k) values
/// in f32 and the checkpoint's dtype.
pub(crate) type QuantizeLinear<'f> =
    dyn Fn(&str, &[f32], usize, usize, DType) -> Result<Vec<(String, Out<'static>)>> + 'f;

/// Writes `dst` from checkpoint `src`: each quantized linear through `quantize`, the rest as it
/// was, config.json's `quantization_config` set to `config` of the prefixes of the 2-D
/// `.weight` tensors kept as they were (the linears a config may have to list as skipped).
pub(crate) fn rewrite_checkpoint(
    src: &Path,
    dst: &Path,
    config: &dyn Fn(&[String]) -> serde_json::Value,
    quantize: &QuantizeLinear<'_>,
) -> Result<()> {
    let files = safetensors_files(src)?;
    std::fs::create_dir_all(dst).map_err(|e| ModelError::io(dst, e))?;
    // SAFETY: mapped read-only for the duration of the copy.
    let st = unsafe { MmapedSafetensors::multi(&files)? };
    let mut out: Vec<(String, Out)> = Vec::new();
    let mut quantized = 0;
    let mut kept = Vec::new();
    for (name, view) in st.tensors() {
        if !is_quantized(&name) {
            if let (Some(prefix), 2) = (name.strip_suffix(".weight"), view.shape().len()) {
                kept.push(prefix.to_string());
            }
            out.push((
                name,
                Out {
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    data: Cow::Borrowed(view.data()),
                },
            ));
            continue;
        }
        let t = st.load(&name, &Device::Cpu)?;
        let dtype = t.dtype();
        let (n, k) = t.dims2()?;
        let w: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        out.extend(quantize(name.trim_end_matches(".weight"), &w, n, k, dtype)?);
        quantized += 1;
    }
    if quantized == 0 {
        return Err(ModelError::weights(format!(
            "{} has no LM linear weights (model.language_model.layers.*) to quantize",
            src.display()
        )));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    let target = dst.join("model.safetensors");
    let views = out.iter().map(|(n, o)| (n.as_str(), o));
    safetensors::serialize_to_file(views, None, &target)
        .map_err(|e| ModelError::weights(format!("writing {}: {e}", target.display())))?;
    // Readable as the other files are (the writer's temporary file is owner-only).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o644))
            .map_err(|e| ModelError::io(&target, e))?;
    }
    kept.sort();
    copy_other_files(src, dst, config(&kept))
}

/// Every file of `src` but the weights, config.json with `quantization_config` = `config`.
fn copy_other_files(src: &Path, dst: &Path, config: serde_json::Value) -> Result<()> {
    for entry in std::fs::read_dir(src).map_err(|e| ModelError::io(src, e))? {
        let path = entry.map_err(|e| ModelError::io(src, e))?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if !path.is_file()
            || name.ends_with(".safetensors")
            || name == "model.safetensors.index.json"
        {
            continue;
        }
        let to = dst.join(name.as_ref());
        if name == "config.json" {
            let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
            let mut json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ModelError::config(&path, e.to_string()))?;
            json["quantization_config"] = config.clone();
            let text = serde_json::to_string_pretty(&json).unwrap_or_default();
            std::fs::write(&to, text).map_err(|e| ModelError::io(&to, e))?;
        } else {
            std::fs::copy(&path, &to).map_err(|e| ModelError::io(&to, e))?;
        }
    }
    Ok(())
}
