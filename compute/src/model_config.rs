//! The checkpoint's `config.json` (Hugging Face `Qwen3VLConfig`): `text_config` for the LM,
//! `vision_config` for the ViT, and the multimodal token ids. Unknown keys are ignored, as
//! transformers does, because real checkpoints carry many keys this crate has no use for.
//!
//! Rope comes in two spellings: transformers 4.57 writes `text_config.rope_theta` +
//! `text_config.rope_scaling`, v5 writes `text_config.rope_parameters`; both are read.
use crate::error::{ComputeError, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The resolved configuration of a Qwen3-VL checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Qwen3VlConfig {
    pub text: TextConfig,
    pub vision: VisionConfig,
    pub image_token_id: u32,
    pub video_token_id: u32,
    pub vision_start_token_id: u32,
    pub vision_end_token_id: u32,
    /// `lm_head.weight` is `embed_tokens.weight` (not stored in the checkpoint).
    pub tie_word_embeddings: bool,
    /// Token ids that end generation (from `generation_config.json` when present, else
    /// `text_config.eos_token_id`).
    pub eos_token_ids: Vec<u32>,
    /// `_name_or_path` or the directory name.
    pub model_id: String,
    /// How the checkpoint stores its weights when quantized: `quantization_config`'s
    /// `quant_method` and `format` or `fmt` (`compressed-tensors int-quantized`, `fp8 e4m3`,
    /// `gguf`); empty for float checkpoints.
    #[serde(default)]
    pub quantization: String,
}

/// The decoder (`text_config`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub attention_bias: bool,
    pub rope_theta: f64,
    /// Rotary halves per axis (t, h, w); sums to head_dim / 2. [24, 20, 20] for 2B.
    pub mrope_section: [usize; 3],
}

/// The ViT (`vision_config`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub in_channels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub spatial_merge_size: usize,
    pub out_hidden_size: usize,
    pub num_position_embeddings: usize,
    pub deepstack_visual_indexes: Vec<usize>,
}

impl VisionConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }
    /// Width of one patch row of `pixel_values`: C * T * P * P (1536 for Qwen3-VL).
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }
    /// Side of the learned position-embedding grid (48 for 2B).
    pub fn num_grid_per_side(&self) -> usize {
        (self.num_position_embeddings as f64).sqrt() as usize
    }
    /// Raw patches per merged token (4).
    pub fn merge_unit(&self) -> usize {
        self.spatial_merge_size * self.spatial_merge_size
    }
}

impl TextConfig {
    pub fn num_kv_groups(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }
    /// Bytes of K and V for one token over all layers at `dtype_bytes` per value.
    pub fn kv_bytes_per_token(&self, dtype_bytes: usize) -> usize {
        2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes
    }
}

// ---- raw serde shapes of config.json --------------------------------------------------------

#[derive(Deserialize)]
struct RawConfig {
    text_config: RawText,
    vision_config: RawVision,
    #[serde(default = "d_image_token")]
    image_token_id: u32,
    #[serde(default = "d_video_token")]
    video_token_id: u32,
    #[serde(default = "d_vs_token")]
    vision_start_token_id: u32,
    #[serde(default = "d_ve_token")]
    vision_end_token_id: u32,
    tie_word_embeddings: Option<bool>,
    #[serde(rename = "_name_or_path")]
    name_or_path: Option<String>,
    quantization_config: Option<serde_json::Value>,
}
fn d_image_token() -> u32 {
    151655
}
fn d_video_token() -> u32 {
    151656
}
fn d_vs_token() -> u32 {
    151652
}
fn d_ve_token() -> u32 {
    151653
}

#[derive(Deserialize)]
struct RawText {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "d_max_pos")]
    max_position_embeddings: usize,
    #[serde(default = "d_eps")]
    rms_norm_eps: f64,
    #[serde(default)]
    attention_bias: bool,
    rope_theta: Option<f64>,
    rope_scaling: Option<RawRope>,
    rope_parameters: Option<RawRope>,
    tie_word_embeddings: Option<bool>,
    eos_token_id: Option<OneOrMany>,
    #[serde(default = "d_act")]
    hidden_act: String,
}
fn d_max_pos() -> usize {
    262144
}
fn d_eps() -> f64 {
    1e-6
}
fn d_act() -> String {
    "silu".into()
}

#[derive(Deserialize)]
struct RawRope {
    rope_theta: Option<f64>,
    mrope_section: Option<Vec<usize>>,
    rope_type: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}
impl OneOrMany {
    fn into_vec(self) -> Vec<u32> {
        match self {
            OneOrMany::One(v) => vec![v],
            OneOrMany::Many(v) => v,
        }
    }
}

#[derive(Deserialize)]
struct RawVision {
    depth: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_heads: usize,
    #[serde(default = "d_three")]
    in_channels: usize,
    #[serde(default = "d_patch")]
    patch_size: usize,
    #[serde(default = "d_two")]
    temporal_patch_size: usize,
    #[serde(default = "d_two")]
    spatial_merge_size: usize,
    out_hidden_size: usize,
    #[serde(default = "d_npos")]
    num_position_embeddings: usize,
    #[serde(default)]
    deepstack_visual_indexes: Vec<usize>,
    #[serde(default = "d_vact")]
    hidden_act: String,
}
fn d_three() -> usize {
    3
}
fn d_patch() -> usize {
    16
}
fn d_two() -> usize {
    2
}
fn d_npos() -> usize {
    2304
}
fn d_vact() -> String {
    "gelu_pytorch_tanh".into()
}

#[derive(Deserialize)]
struct RawGeneration {
    eos_token_id: Option<OneOrMany>,
}

impl Qwen3VlConfig {
    /// Reads `config.json` (and `generation_config.json` when present) from a checkpoint dir.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ComputeError::io(&path, e))?;
        let mut cfg = Self::from_json_str(&text).map_err(|message| ComputeError::Config {
            path: path.clone(),
            message,
        })?;
        let gen_path = dir.join("generation_config.json");
        if let Ok(gen_text) = std::fs::read_to_string(&gen_path) {
            let gen: RawGeneration =
                serde_json::from_str(&gen_text).map_err(|e| ComputeError::Config {
                    path: gen_path.clone(),
                    message: e.to_string(),
                })?;
            if let Some(eos) = gen.eos_token_id {
                cfg.eos_token_ids = eos.into_vec();
            }
        }
        if cfg.model_id.is_empty() {
            cfg.model_id = dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "qwen3-vl".into());
        }
        Ok(cfg)
    }

    /// Parses the text of a `config.json`; the error is a message naming the problem.
    pub fn from_json_str(text: &str) -> std::result::Result<Self, String> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let t = raw.text_config;
        let v = raw.vision_config;
        let rope = t.rope_parameters.as_ref().or(t.rope_scaling.as_ref());
        let rope_theta = rope
            .and_then(|r| r.rope_theta)
            .or(t.rope_theta)
            .unwrap_or(5_000_000.0);
        if let Some(kind) = rope.and_then(|r| r.rope_type.as_deref()) {
            if kind != "default" && kind != "mrope" {
                return Err(format!(
                    "text_config rope_type {kind:?} is not supported (expected \"default\")"
                ));
            }
        }
        let head_dim = t.head_dim.unwrap_or(t.hidden_size / t.num_attention_heads);
        let section = rope
            .and_then(|r| r.mrope_section.clone())
            .unwrap_or_else(|| vec![24, 20, 20]);
        if section.len() != 3 || section.iter().sum::<usize>() != head_dim / 2 {
            return Err(format!(
                "text_config mrope_section {section:?} must have 3 entries summing to head_dim/2 = {}",
                head_dim / 2
            ));
        }
        if t.hidden_act != "silu" {
            return Err(format!(
                "text_config hidden_act {:?} is not supported (silu)",
                t.hidden_act
            ));
        }
        if v.hidden_act != "gelu_pytorch_tanh" {
            return Err(format!(
                "vision_config hidden_act {:?} is not supported (gelu_pytorch_tanh)",
                v.hidden_act
            ));
        }
        let num_kv = t.num_key_value_heads.unwrap_or(t.num_attention_heads);
        if !t.num_attention_heads.is_multiple_of(num_kv) {
            return Err(format!(
                "text_config num_attention_heads {} is not a multiple of num_key_value_heads {num_kv}",
                t.num_attention_heads
            ));
        }
        if !v.hidden_size.is_multiple_of(v.num_heads) {
            return Err(format!(
                "vision_config hidden_size {} is not a multiple of num_heads {}",
                v.hidden_size, v.num_heads
            ));
        }
        let grid = (v.num_position_embeddings as f64).sqrt() as usize;
        if grid * grid != v.num_position_embeddings {
            return Err(format!(
                "vision_config num_position_embeddings {} is not a square",
                v.num_position_embeddings
            ));
        }
        if let Some(&bad) = v.deepstack_visual_indexes.iter().find(|&&i| i >= v.depth) {
            return Err(format!(
                "vision_config deepstack_visual_indexes contains {bad}, but depth is {}",
                v.depth
            ));
        }
        if v.deepstack_visual_indexes.len() > t.num_hidden_layers {
            return Err("more deepstack levels than text layers".into());
        }
        let tie = raw
            .tie_word_embeddings
            .or(t.tie_word_embeddings)
            .unwrap_or(false);
        Ok(Qwen3VlConfig {
            text: TextConfig {
                vocab_size: t.vocab_size,
                hidden_size: t.hidden_size,
                intermediate_size: t.intermediate_size,
                num_hidden_layers: t.num_hidden_layers,
                num_attention_heads: t.num_attention_heads,
                num_key_value_heads: num_kv,
                head_dim,
                max_position_embeddings: t.max_position_embeddings,
                rms_norm_eps: t.rms_norm_eps,
                attention_bias: t.attention_bias,
                rope_theta,
                mrope_section: [section[0], section[1], section[2]],
            },
            vision: VisionConfig {
                depth: v.depth,
                hidden_size: v.hidden_size,
                intermediate_size: v.intermediate_size,
                num_heads: v.num_heads,
                in_channels: v.in_channels,
                patch_size: v.patch_size,
                temporal_patch_size: v.temporal_patch_size,
                spatial_merge_size: v.spatial_merge_size,
                out_hidden_size: v.out_hidden_size,
                num_position_embeddings: v.num_position_embeddings,
                deepstack_visual_indexes: v.deepstack_visual_indexes,
            },
            image_token_id: raw.image_token_id,
            video_token_id: raw.video_token_id,
            vision_start_token_id: raw.vision_start_token_id,
            vision_end_token_id: raw.vision_end_token_id,
            tie_word_embeddings: tie,
            eos_token_ids: t.eos_token_id.map(OneOrMany::into_vec).unwrap_or_default(),
            model_id: raw.name_or_path.unwrap_or_default(),
            quantization: raw
                .quantization_config
                .map(|q| {
                    ["quant_method", "format", "fmt"]
                        .iter()
                        .filter_map(|k| q.get(*k).and_then(|v| v.as_str()))
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = r#"{
      "text_config": {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2]}},
      "vision_config": {"depth": 3, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
        "out_hidden_size": 64, "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 2]},
      "image_token_id": 993, "tie_word_embeddings": true}"#;

    #[test]
    fn reads_rope_parameters_and_rope_scaling_alike() {
        let a = Qwen3VlConfig::from_json_str(TINY).unwrap();
        let legacy = TINY.replace(
            r#""rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2]}"#,
            r#""rope_theta": 5000000.0, "rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": true}"#,
        );
        assert_ne!(legacy, TINY);
        let b = Qwen3VlConfig::from_json_str(&legacy).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.text.mrope_section, [4, 2, 2]);
        assert!(a.tie_word_embeddings);
        assert_eq!(a.vision.num_grid_per_side(), 8);
    }

    #[test]
    fn names_how_the_weights_are_quantized() {
        assert_eq!(Qwen3VlConfig::from_json_str(TINY).unwrap().quantization, "");
        let w8a8 = TINY.replace(
            r#""image_token_id": 993"#,
            r#""quantization_config": {"quant_method": "compressed-tensors",
                "format": "int-quantized", "config_groups": {}}, "image_token_id": 993"#,
        );
        let c = Qwen3VlConfig::from_json_str(&w8a8).unwrap();
        assert_eq!(c.quantization, "compressed-tensors int-quantized");
    }

    #[test]
    fn rejects_bad_mrope_section() {
        let bad = TINY.replace("[4, 2, 2]", "[4, 2, 3]");
        let err = Qwen3VlConfig::from_json_str(&bad).unwrap_err();
        assert!(err.contains("mrope_section"), "{err}");
    }
}
