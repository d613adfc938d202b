//! `vlm quantize --scheme q8_0|q4_k_m|f16|bf16`: a Hugging Face Qwen3-VL checkpoint -> the GGUF pair
//! llama.cpp's `convert_hf_to_gguf.py` (+ `--mmproj`) and `llama-quantize` would write: same
//! tensor names ([`super::names`]), same metadata keys, the tokenizer as `tokenizer.ggml.*`
//! (gpt2 model, qwen2 pre-tokenizer, `[PAD{i}]` tokens up to the embedding's rows). Weights are
//! quantized round-to-nearest by candle's ports of ggml's `quantize_row_*_ref`.
use super::names::{gguf_name, GgufName};
use crate::error::{ModelError, Result};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;
use vlm_compute::Qwen3VlConfig;

/// What the LM's linear weights become.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    F16,
    BF16,
    Q8_0,
    /// llama.cpp's Q4_K_M mix (`llama_tensor_get_type` in `llama-quant.cpp`): Q4_K, with Q6_K
    /// for the output head (the token table when the head is tied to it) and for `attn_v` /
    /// `ffn_down` of the layers `use_more_bits` picks.
    Q4KM,
}

impl std::str::FromStr for Scheme {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f16" => Ok(Scheme::F16),
            "bf16" => Ok(Scheme::BF16),
            "q8_0" => Ok(Scheme::Q8_0),
            "q4_k_m" => Ok(Scheme::Q4KM),
            other => Err(format!(
                "scheme {other} is not written (f16, bf16, q8_0, q4_k_m)"
            )),
        }
    }
}

impl Scheme {
    /// `general.file_type` (`LLAMA_FTYPE_MOSTLY_*`).
    fn file_type(self) -> u32 {
        match self {
            Scheme::F16 => 1,
            Scheme::Q8_0 => 7,
            Scheme::Q4KM => 15,
            Scheme::BF16 => 32,
        }
    }

    /// The type of LM tensor `name` (GGUF name) of `layers` layers; `tied`: the model has no
    /// `output.weight`, `token_embd` is its head.
    fn lm_type(self, name: &str, layers: usize, tied: bool) -> GgmlDType {
        match self {
            Scheme::F16 => GgmlDType::F16,
            Scheme::BF16 => GgmlDType::BF16,
            Scheme::Q8_0 => GgmlDType::Q8_0,
            Scheme::Q4KM => {
                let layer = name
                    .strip_prefix("blk.")
                    .and_then(|r| r.split('.').next())
                    .and_then(|i| i.parse::<usize>().ok());
                let more_bits =
                    |i: usize| i < layers / 8 || i >= 7 * layers / 8 || (i - layers / 8) % 3 == 2;
                let head = name == "output.weight" || (tied && name == "token_embd.weight");
                let six = head
                    || (layer.is_some_and(more_bits)
                        && (name.ends_with("attn_v.weight") || name.ends_with("ffn_down.weight")));
                if six {
                    GgmlDType::Q6K
                } else {
                    GgmlDType::Q4K
                }
            }
        }
    }
}

/// Rows whose width the block size does not divide fall back as llama.cpp's quantizer does
/// (to a 32-wide type, else f16).
fn fit(t: GgmlDType, cols: usize) -> GgmlDType {
    if cols.is_multiple_of(t.block_size()) {
        t
    } else if cols.is_multiple_of(32) {
        GgmlDType::Q8_0
    } else {
        GgmlDType::F16
    }
}

fn quantize(t: &Tensor, dtype: GgmlDType) -> Result<QTensor> {
    let t = t.to_dtype(DType::F32)?.contiguous()?;
    Ok(QTensor::quantize(&t, dtype)?)
}

fn json_file(dir: &Path, name: &str) -> Result<serde_json::Value> {
    let p = dir.join(name);
    let text = std::fs::read_to_string(&p).map_err(|e| ModelError::io(&p, e))?;
    serde_json::from_str(&text).map_err(|e| ModelError::config(&p, e.to_string()))
}

fn strs(v: impl IntoIterator<Item = String>) -> Value {
    Value::Array(v.into_iter().map(Value::String).collect())
}

/// `tokenizer.ggml.*` and the chat template of checkpoint `dir`, padded to `vocab` tokens.
fn tokenizer_metadata(dir: &Path, vocab_size: usize) -> Result<Vec<(String, Value)>> {
    let tok = json_file(dir, "tokenizer.json")?;
    let cfg = json_file(dir, "tokenizer_config.json")?;
    let path = dir.join("tokenizer.json");
    let bad = |m: &str| ModelError::config(&path, m.to_string());
    let vocab = tok["model"]["vocab"]
        .as_object()
        .ok_or_else(|| bad("no model.vocab"))?;
    let mut tokens: Vec<Option<(String, i32)>> = vec![None; vocab_size];
    let mut put = |id: u64, text: &str, ty: i32| -> Result<()> {
        let slot = tokens
            .get_mut(id as usize)
            .ok_or_else(|| bad(&format!("token id {id} is past the {vocab_size} rows")))?;
        *slot = Some((text.to_string(), ty));
        Ok(())
    };
    for (text, id) in vocab {
        put(id.as_u64().ok_or_else(|| bad("vocab id"))?, text, 1)?;
    }
    for a in tok["added_tokens"].as_array().into_iter().flatten() {
        let special = a["special"].as_bool().unwrap_or(false);
        let text = a["content"].as_str().ok_or_else(|| bad("added token"))?;
        put(
            a["id"].as_u64().ok_or_else(|| bad("added id"))?,
            text,
            if special { 3 } else { 4 },
        )?;
    }
    let (texts, types): (Vec<String>, Vec<Value>) = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| match t {
            Some((s, ty)) => (s, Value::I32(ty)),
            None => (format!("[PAD{i}]"), Value::I32(5)),
        })
        .unzip();
    let merges = tok["model"]["merges"]
        .as_array()
        .ok_or_else(|| bad("no model.merges"))?
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => Ok(s.clone()),
            serde_json::Value::Array(p) if p.len() == 2 => Ok(format!(
                "{} {}",
                p[0].as_str().unwrap_or_default(),
                p[1].as_str().unwrap_or_default()
            )),
            _ => Err(bad("merge")),
        })
        .collect::<Result<Vec<_>>>()?;
    let id_of = |key: &str| -> Option<u32> {
        let text = cfg[key].as_str()?;
        texts.iter().position(|t| t == text).map(|i| i as u32)
    };
    let mut out = vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("qwen2".into())),
        ("tokenizer.ggml.tokens".into(), strs(texts.clone())),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.merges".into(), strs(merges)),
    ];
    let pad = id_of("pad_token");
    for (key, id) in [
        ("tokenizer.ggml.eos_token_id", id_of("eos_token")),
        ("tokenizer.ggml.padding_token_id", pad),
        ("tokenizer.ggml.bos_token_id", id_of("bos_token").or(pad)),
    ] {
        if let Some(id) = id {
            out.push((key.into(), Value::U32(id)));
        }
    }
    out.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)));
    out.push(("tokenizer.ggml.add_eos_token".into(), Value::Bool(false)));
    let template = match cfg["chat_template"].as_str() {
        Some(t) => t.to_string(),
        None => {
            let p = dir.join("chat_template.jinja");
            std::fs::read_to_string(&p).map_err(|e| ModelError::io(&p, e))?
        }
    };
    out.push(("tokenizer.chat_template".into(), Value::String(template)));
    Ok(out)
}

fn write(path: &Path, meta: &[(String, Value)], tensors: &[(String, QTensor)]) -> Result<()> {
    let mut f = std::fs::File::create(path).map_err(|e| ModelError::io(path, e))?;
    let meta: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut f, &meta, &tensors)
        .map_err(|e| ModelError::config(path, format!("writing GGUF: {e}")))
}

/// Writes the LM file `lm_out` and the vision file `mmproj_out` of checkpoint `src`.
pub fn quantize_checkpoint(
    src: &Path,
    scheme: Scheme,
    lm_out: &Path,
    mmproj_out: &Path,
) -> Result<()> {
    let cfg = Qwen3VlConfig::from_dir(src)?;
    let files = crate::weights::safetensors_files(src)?;
    // SAFETY: read-only maps of the source checkpoint, which must not change while read.
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files)? };
    let (t, v) = (&cfg.text, &cfg.vision);
    let deepstack = v.deepstack_visual_indexes.clone();
    let mut lm_tensors: BTreeMap<String, QTensor> = BTreeMap::new();
    let mut mm_tensors: BTreeMap<String, QTensor> = BTreeMap::new();
    for (hf, _) in st.tensors() {
        let tensor = st.load(&hf, &Device::Cpu)?;
        let vector = tensor.rank() == 1;
        match gguf_name(&hf, &deepstack) {
            Some(GgufName::Lm(name)) => {
                let ty = if vector {
                    GgmlDType::F32
                } else {
                    fit(
                        scheme.lm_type(&name, t.num_hidden_layers, cfg.tie_word_embeddings),
                        tensor.dim(1)?,
                    )
                };
                lm_tensors.insert(name, quantize(&tensor, ty)?);
            }
            Some(GgufName::Mmproj(name)) => {
                let ty = if vector || name.starts_with("v.position_embd") {
                    GgmlDType::F32
                } else {
                    GgmlDType::F16
                };
                mm_tensors.insert(name, quantize(&tensor, ty)?);
            }
            Some(GgufName::PatchEmbedSlices) => {
                for (k, suffix) in ["", ".1"].iter().enumerate() {
                    let slice = tensor.narrow(2, k, 1)?.squeeze(2)?;
                    mm_tensors.insert(
                        format!("v.patch_embd.weight{suffix}"),
                        quantize(&slice, GgmlDType::F16)?,
                    );
                }
            }
            None => {
                return Err(ModelError::weights(format!(
                    "{hf}: no GGUF name for this tensor (is this a Qwen3-VL checkpoint?)"
                )))
            }
        }
    }
    if cfg.tie_word_embeddings {
        lm_tensors.remove("output.weight");
    }
    let u = |n: usize| Value::U32(n as u32);
    let f = |x: f64| Value::F32(x as f32);
    let name = src
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "qwen3-vl".into());
    let a = |k: &str| format!("qwen3vl.{k}");
    let mut lm_meta: Vec<(String, Value)> = vec![
        (
            "general.architecture".into(),
            Value::String("qwen3vl".into()),
        ),
        ("general.type".into(), Value::String("model".into())),
        ("general.name".into(), Value::String(name.clone())),
        ("general.file_type".into(), Value::U32(scheme.file_type())),
        ("general.quantization_version".into(), Value::U32(2)),
        (a("block_count"), u(t.num_hidden_layers)),
        (a("context_length"), u(t.max_position_embeddings)),
        (a("embedding_length"), u(t.hidden_size)),
        (a("feed_forward_length"), u(t.intermediate_size)),
        (a("attention.head_count"), u(t.num_attention_heads)),
        (a("attention.head_count_kv"), u(t.num_key_value_heads)),
        (a("attention.key_length"), u(t.head_dim)),
        (a("attention.value_length"), u(t.head_dim)),
        (a("attention.layer_norm_rms_epsilon"), f(t.rms_norm_eps)),
        (a("rope.freq_base"), f(t.rope_theta)),
        (
            a("rope.dimension_sections"),
            Value::Array(
                t.mrope_section
                    .iter()
                    .chain(&[0])
                    .map(|&s| Value::I32(s as i32))
                    .collect(),
            ),
        ),
        (a("n_deepstack_layers"), u(deepstack.len())),
    ];
    lm_meta.extend(tokenizer_metadata(src, t.vocab_size)?);
    let pre = json_file(src, "preprocessor_config.json").unwrap_or_default();
    let floats = |k: &str, d: f64| {
        let xs: Vec<Value> = match pre[k].as_array() {
            Some(a) => a.iter().map(|x| f(x.as_f64().unwrap_or(d))).collect(),
            None => vec![f(d); 3],
        };
        Value::Array(xs)
    };
    let side = (v.num_position_embeddings as f64).sqrt().round() as usize;
    let c = |k: &str| format!("clip.vision.{k}");
    let mm_meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String("clip".into())),
        ("general.type".into(), Value::String("mmproj".into())),
        ("general.name".into(), Value::String(name)),
        ("general.file_type".into(), Value::U32(1)),
        ("clip.has_vision_encoder".into(), Value::Bool(true)),
        (
            "clip.projector_type".into(),
            Value::String("qwen3vl_merger".into()),
        ),
        ("clip.use_gelu".into(), Value::Bool(true)),
        (c("projection_dim"), u(v.out_hidden_size)),
        (c("image_size"), u(side * v.patch_size)),
        (c("patch_size"), u(v.patch_size)),
        (c("embedding_length"), u(v.hidden_size)),
        (c("feed_forward_length"), u(v.intermediate_size)),
        (c("block_count"), u(v.depth)),
        (c("attention.head_count"), u(v.num_heads)),
        (c("attention.layer_norm_epsilon"), f(t.rms_norm_eps)),
        (c("spatial_merge_size"), u(v.spatial_merge_size)),
        (c("image_mean"), floats("image_mean", 0.5)),
        (c("image_std"), floats("image_std", 0.5)),
        (
            c("is_deepstack_layers"),
            Value::Array(
                (0..v.depth)
                    .map(|i| Value::Bool(deepstack.contains(&i)))
                    .collect(),
            ),
        ),
    ];
    let lm: Vec<(String, QTensor)> = lm_tensors.into_iter().collect();
    let mm: Vec<(String, QTensor)> = mm_tensors.into_iter().collect();
    write(lm_out, &lm_meta, &lm)?;
    write(mmproj_out, &mm_meta, &mm)
}
