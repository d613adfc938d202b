//! The Hugging Face files a checkpoint directory has (`config.json`, `tokenizer.json`,
//! `tokenizer_config.json`, `generation_config.json`, `preprocessor_config.json`), derived from
//! a GGUF pair's metadata, so the rest of the system (planner, tokenizer, processor) reads a GGUF
//! checkpoint as it reads a directory. The keys read are the ones llama.cpp's
//! `convert_hf_to_gguf.py` writes for Qwen3-VL (`Qwen3VLTextModel`, `Qwen3VLVisionModel`, the
//! gpt2-model tokenizer of `Qwen2Model.set_vocab`); each mapping is the inverse of what it does.
use super::file::GgufFile;
use crate::error::{ModelError, Result};
use candle_core::quantized::gguf_file::Value;
use serde_json::{json, Map, Value as Json};

/// llama.cpp's `llama_token_type` (`gguf-py/gguf/constants.py` `TokenType`).
const TOKEN_NORMAL: i32 = 1;
const TOKEN_CONTROL: i32 = 3;
const TOKEN_USER_DEFINED: i32 = 4;

/// Qwen2's pre-tokenizer split (`tokenizer.ggml.pre = qwen2`; llama.cpp's
/// `LLAMA_VOCAB_PRE_TYPE_QWEN2` regex, which is the Split of Qwen's own `tokenizer.json`).
const QWEN2_SPLIT: &str = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

pub struct Tokens {
    pub tokens: Vec<String>,
    pub types: Vec<i32>,
}

impl Tokens {
    pub fn read(lm: &GgufFile) -> Result<Tokens> {
        let model = lm.string("tokenizer.ggml.model")?;
        let pre = lm.string("tokenizer.ggml.pre")?;
        if model != "gpt2" || pre != "qwen2" {
            return Err(ModelError::config(
                lm.path(),
                format!(
                    "tokenizer {model}/{pre} is not Qwen's (gpt2/qwen2): this server serves Qwen3-VL"
                ),
            ));
        }
        let tokens = strings(lm, "tokenizer.ggml.tokens")?;
        let types = lm
            .array("tokenizer.ggml.token_type")?
            .iter()
            .map(|v| v.to_i32().unwrap_or(TOKEN_NORMAL))
            .collect::<Vec<_>>();
        if types.len() != tokens.len() {
            return Err(ModelError::config(
                lm.path(),
                format!("{} token types for {} tokens", types.len(), tokens.len()),
            ));
        }
        Ok(Tokens { tokens, types })
    }

    pub fn id(&self, text: &str) -> Option<usize> {
        self.tokens.iter().position(|t| t == text)
    }

    fn required_id(&self, lm: &GgufFile, text: &str) -> Result<usize> {
        self.id(text).ok_or_else(|| {
            ModelError::config(lm.path(), format!("the vocabulary has no {text} token"))
        })
    }
}

fn strings(f: &GgufFile, key: &str) -> Result<Vec<String>> {
    f.array(key)?
        .iter()
        .map(|v| match v {
            Value::String(s) => Ok(s.clone()),
            other => Err(ModelError::config(
                f.path(),
                format!("{key}: expected strings, found {:?}", other.value_type()),
            )),
        })
        .collect()
}

fn usizes(f: &GgufFile, key: &str) -> Result<Vec<usize>> {
    f.array(key)?
        .iter()
        .map(|v| {
            v.to_u32()
                .map(|n| n as usize)
                .or_else(|_| v.to_i32().map(|n| n.max(0) as usize))
                .map_err(|e| ModelError::config(f.path(), format!("{key}: {e}")))
        })
        .collect()
}

/// The vision layers whose outputs feed the deepstack mergers (`clip.vision.is_deepstack_layers`).
pub fn deepstack_layers(mmproj: &GgufFile) -> Result<Vec<usize>> {
    let Some(flags) = mmproj.value("clip.vision.is_deepstack_layers") else {
        return Ok(vec![]);
    };
    let flags = flags
        .to_vec()
        .map_err(|e| ModelError::config(mmproj.path(), e.to_string()))?;
    Ok(flags
        .iter()
        .enumerate()
        .filter(|(_, v)| v.to_bool().unwrap_or(false))
        .map(|(i, _)| i)
        .collect())
}

/// Refuses a pair this server does not run: an LM whose architecture is not `qwen3vl`, an
/// mmproj whose projector is not Qwen3-VL's. Checked before anything else is read.
pub fn check_architecture(lm: &GgufFile, mmproj: &GgufFile) -> Result<()> {
    let arch = lm.string("general.architecture")?;
    if arch != "qwen3vl" {
        return Err(ModelError::config(
            lm.path(),
            format!("architecture {arch} is not served (this server runs qwen3vl)"),
        ));
    }
    let projector = mmproj.string("clip.projector_type")?;
    if projector != "qwen3vl_merger" {
        return Err(ModelError::config(
            mmproj.path(),
            format!("projector {projector} is not Qwen3-VL's (qwen3vl_merger)"),
        ));
    }
    Ok(())
}

/// `config.json` of the pair (after [`check_architecture`]).
pub fn config_json(lm: &GgufFile, mmproj: &GgufFile, tokens: &Tokens) -> Result<Json> {
    let arch = "qwen3vl";
    let a = |k: &str| format!("{arch}.{k}");
    let hidden = lm.usize(&a("embedding_length"))?;
    let heads = lm.usize(&a("attention.head_count"))?;
    let head_dim = match lm.usize(&a("attention.key_length")) {
        Ok(d) => d,
        Err(_) => hidden / heads.max(1),
    };
    let sections = usizes(lm, &a("rope.dimension_sections"))?;
    if sections.len() < 3 {
        return Err(ModelError::config(
            lm.path(),
            format!("rope.dimension_sections {sections:?}: three sections expected"),
        ));
    }
    let theta = lm.f64(&a("rope.freq_base"))?;
    let dtype = dtype_name(lm);
    let tied = !lm.has_tensor("output.weight");
    let deepstack = deepstack_layers(mmproj)?;
    let patch = mmproj.usize("clip.vision.patch_size")?;
    let image_size = mmproj.usize("clip.vision.image_size")?;
    let side = image_size / patch.max(1);
    let id = |t: &str| tokens.required_id(lm, t);
    Ok(json!({
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "dtype": dtype,
        "image_token_id": id("<|image_pad|>")?,
        "video_token_id": id("<|video_pad|>")?,
        "vision_start_token_id": id("<|vision_start|>")?,
        "vision_end_token_id": id("<|vision_end|>")?,
        "tie_word_embeddings": tied,
        "text_config": {
            "model_type": "qwen3_vl_text",
            "attention_bias": false,
            "dtype": dtype,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "hidden_size": hidden,
            "intermediate_size": lm.usize(&a("feed_forward_length"))?,
            "max_position_embeddings": lm.usize(&a("context_length"))?,
            "num_attention_heads": heads,
            "num_hidden_layers": lm.usize(&a("block_count"))?,
            "num_key_value_heads": lm.usize(&a("attention.head_count_kv"))?,
            "rms_norm_eps": lm.f64(&a("attention.layer_norm_rms_epsilon"))?,
            "rope_parameters": {
                "mrope_interleaved": true,
                "mrope_section": &sections[..3],
                "rope_theta": theta,
                "rope_type": "default"
            },
            "tie_word_embeddings": tied,
            "vocab_size": tokens.tokens.len()
        },
        "vision_config": {
            "model_type": "qwen3_vl_vision",
            "deepstack_visual_indexes": deepstack,
            "depth": mmproj.usize("clip.vision.block_count")?,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": mmproj.usize("clip.vision.embedding_length")?,
            "in_channels": 3,
            "intermediate_size": mmproj.usize("clip.vision.feed_forward_length")?,
            "num_heads": mmproj.usize("clip.vision.attention.head_count")?,
            "num_position_embeddings": side * side,
            "out_hidden_size": mmproj.usize("clip.vision.projection_dim")?,
            "patch_size": patch,
            "spatial_merge_size": mmproj.usize("clip.vision.spatial_merge_size")?,
            "temporal_patch_size": 2
        }
    }))
}

/// The dtype the float weights are served in: f16 for an F16 file (`general.file_type` 1,
/// `LLAMA_FTYPE_MOSTLY_F16`), bf16 otherwise (a quantized file's float tensors are its norms,
/// stored in f32 and served as the model's activations need).
fn dtype_name(lm: &GgufFile) -> &'static str {
    match lm.usize("general.file_type") {
        Ok(1) => "float16",
        _ => "bfloat16",
    }
}

/// `tokenizer.json` in the layout of Qwen's own file (byte-level BPE, NFC, Qwen2's split).
pub fn tokenizer_json(lm: &GgufFile, tokens: &Tokens) -> Result<Json> {
    let merges = strings(lm, "tokenizer.ggml.merges")?;
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (id, (text, ty)) in tokens.tokens.iter().zip(&tokens.types).enumerate() {
        match *ty {
            TOKEN_NORMAL => {
                vocab.insert(text.clone(), json!(id));
            }
            TOKEN_CONTROL | TOKEN_USER_DEFINED => added.push(json!({
                "id": id, "content": text, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": *ty == TOKEN_CONTROL
            })),
            // UNUSED padding up to the embedding's rows: no text maps to them.
            _ => {}
        }
    }
    let merges: Vec<Json> = merges
        .iter()
        .map(|m| match m.split_once(' ') {
            Some((a, b)) => Ok(json!([a, b])),
            None => Err(ModelError::config(
                lm.path(),
                format!("merge {m:?} has no space"),
            )),
        })
        .collect::<Result<_>>()?;
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
        "trim_offsets": false, "use_regex": false});
    Ok(json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": false},
            byte_level
        ]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges}
    }))
}

fn token_text(lm: &GgufFile, tokens: &Tokens, key: &str) -> Option<String> {
    let id = lm.usize(key).ok()?;
    tokens.tokens.get(id).cloned()
}

/// `tokenizer_config.json`: the chat template and the special tokens by text.
pub fn tokenizer_config_json(lm: &GgufFile, tokens: &Tokens) -> Result<Json> {
    let template = lm.string("tokenizer.chat_template")?;
    let add_bos = lm
        .value("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.to_bool().ok())
        .unwrap_or(false);
    let bos = if add_bos {
        token_text(lm, tokens, "tokenizer.ggml.bos_token_id")
    } else {
        None
    };
    Ok(json!({
        "add_bos_token": add_bos,
        "bos_token": bos,
        "eos_token": token_text(lm, tokens, "tokenizer.ggml.eos_token_id"),
        "pad_token": token_text(lm, tokens, "tokenizer.ggml.padding_token_id"),
        "chat_template": template,
        "model_max_length": lm.usize("qwen3vl.context_length").unwrap_or(0),
        "tokenizer_class": "Qwen2Tokenizer"
    }))
}

/// `generation_config.json`: the stop ids (eos, and eot/pad `<|endoftext|>` as Qwen's file
/// lists) and the sampling defaults the converter copied (`general.sampling.*`).
pub fn generation_config_json(lm: &GgufFile) -> Json {
    let mut eos: Vec<usize> = Vec::new();
    for key in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.padding_token_id",
    ] {
        if let Ok(id) = lm.usize(key) {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
    }
    let mut out = json!({"eos_token_id": eos});
    for (key, name) in [
        ("general.sampling.temp", "temperature"),
        ("general.sampling.top_k", "top_k"),
        ("general.sampling.top_p", "top_p"),
    ] {
        if let Ok(x) = lm.f64(key).or_else(|_| lm.usize(key).map(|n| n as f64)) {
            out[name] = json!(x);
        }
    }
    out
}

/// `preprocessor_config.json`: Qwen3-VL's processor with the mmproj's mean, std and patch.
pub fn preprocessor_config_json(mmproj: &GgufFile) -> Result<Json> {
    let floats = |key: &str| -> Result<Vec<f64>> {
        mmproj
            .array(key)?
            .iter()
            .map(|v| {
                v.to_f32()
                    .map(f64::from)
                    .map_err(|e| ModelError::config(mmproj.path(), format!("{key}: {e}")))
            })
            .collect()
    };
    Ok(json!({
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
        "do_convert_rgb": true, "do_resize": true, "do_rescale": true, "do_normalize": true,
        "resample": 3,
        "rescale_factor": 1.0 / 255.0,
        "image_mean": floats("clip.vision.image_mean")?,
        "image_std": floats("clip.vision.image_std")?,
        "patch_size": mmproj.usize("clip.vision.patch_size")?,
        "temporal_patch_size": 2,
        "merge_size": mmproj.usize("clip.vision.spatial_merge_size")?,
        "size": {"shortest_edge": 65536, "longest_edge": 16777216}
    }))
}
