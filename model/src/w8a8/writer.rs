//! `vlm quantize --scheme w8a8`: a float Qwen3-VL checkpoint -> a compressed-tensors
//! `int-quantized` directory as llm-compressor's `W8A8` preset with round-to-nearest writes it
//! (what vLLM loads as `CompressedTensorsW8A8Int8`): the LM's linear weights int8 with one
//! symmetric scale per output channel, everything else (head, embeddings, norms, the vision
//! tower) as it was; the other files copied.
use crate::error::{ModelError, Result};
use crate::weights::safetensors_files;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};
use safetensors::{Dtype, View};
use std::borrow::Cow;
use std::path::Path;

/// The linear layers quantized: every projection of the LM's decoder layers.
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
    name.starts_with("model.language_model.layers.") && LINEARS.iter().any(|l| name.ends_with(l))
}

/// The `quantization_config` llm-compressor writes for its `W8A8` preset (minmax observer,
/// the head and the vision tower ignored).
pub fn w8a8_config() -> serde_json::Value {
    let args = |strategy: &str, dynamic: bool, observer: serde_json::Value| {
        serde_json::json!({
            "num_bits": 8, "type": "int", "symmetric": true, "strategy": strategy,
            "dynamic": dynamic, "group_size": null, "block_structure": null, "actorder": null,
            "observer": observer, "observer_kwargs": {}
        })
    };
    serde_json::json!({
        "quant_method": super::QUANT_METHOD,
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": args("channel", false, "minmax".into()),
            "input_activations": args("token", true, serde_json::Value::Null),
            "output_activations": null
        }},
        "ignore": ["re:.*lm_head", "re:.*visual.*"],
        "kv_cache_scheme": null,
        "sparsity_config": {},
        "global_compression_ratio": null
    })
}

/// One tensor to write: borrowed from the source, or made here.
struct Out<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Cow<'a, [u8]>,
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

/// Row-wise round-to-nearest of `w` (n, k): `scale = max|row| / 127`, stored in `dtype` (the
/// checkpoint's), and `q = clamp(round_half_even(w / stored scale), -128, 127)`, so that `q *
/// scale` is the weight the reference and the kernels multiply by.
pub fn quantize_rows(w: &[f32], n: usize, k: usize, dtype: DType) -> (Vec<i8>, Vec<f32>) {
    let mut q = vec![0i8; n * k];
    let mut scales = vec![0f32; n];
    for r in 0..n {
        let row = &w[r * k..(r + 1) * k];
        let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = stored(amax / 127.0, dtype);
        scales[r] = s;
        if s > 0.0 {
            for (o, v) in q[r * k..(r + 1) * k].iter_mut().zip(row) {
                *o = (v / s).round_ties_even().clamp(-128.0, 127.0) as i8;
            }
        }
    }
    (q, scales)
}

/// `v` as the checkpoint stores it in `dtype`.
fn stored(v: f32, dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::from_f32(v).to_f32(),
        DType::F16 => half::f16::from_f32(v).to_f32(),
        _ => v,
    }
}

fn scale_bytes(scales: &[f32], dtype: DType) -> (Dtype, Vec<u8>) {
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

/// Writes the W8A8 directory `dst` for checkpoint `src`.
pub fn quantize_checkpoint_w8a8(src: &Path, dst: &Path) -> Result<()> {
    let files = safetensors_files(src)?;
    std::fs::create_dir_all(dst).map_err(|e| ModelError::io(dst, e))?;
    // SAFETY: mapped read-only for the duration of the copy.
    let st = unsafe { MmapedSafetensors::multi(&files)? };
    let mut out: Vec<(String, Out)> = Vec::new();
    let mut quantized = 0;
    for (name, view) in st.tensors() {
        if !is_quantized(&name) {
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
        let (q, scales) = quantize_rows(&w, n, k, dtype);
        let (sdtype, sdata) = scale_bytes(&scales, dtype);
        let prefix = name.trim_end_matches(".weight");
        out.push((
            format!("{prefix}.weight_scale"),
            Out {
                dtype: sdtype,
                shape: vec![n, 1],
                data: Cow::Owned(sdata),
            },
        ));
        out.push((
            name,
            Out {
                dtype: Dtype::I8,
                shape: vec![n, k],
                data: Cow::Owned(q.into_iter().map(|v| v as u8).collect()),
            },
        ));
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
    copy_other_files(src, dst)
}

/// Every file of `src` but the weights, config.json with the scheme's `quantization_config`.
fn copy_other_files(src: &Path, dst: &Path) -> Result<()> {
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
            let mut config: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ModelError::config(&path, e.to_string()))?;
            config["quantization_config"] = w8a8_config();
            let text = serde_json::to_string_pretty(&config).unwrap_or_default();
            std::fs::write(&to, text).map_err(|e| ModelError::io(&to, e))?;
        } else {
            std::fs::copy(&path, &to).map_err(|e| ModelError::io(&to, e))?;
        }
    }
    Ok(())
}
