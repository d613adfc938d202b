//! The few model dimensions the memory plan needs, read from a checkpoint's `config.json`
//! (`text_config` / `vision_config`, unknown keys ignored) or taken from a preset.
//!
//! This crate cannot depend on `vlm-model` (the dependency points the other way), so the
//! parameter count is computed here from the architecture (Qwen3-VL: Conv3d patch embedding,
//! learned position table, pre-norm ViT blocks with biased linears and LayerNorm, 2x2 patch
//! merger and deepstack mergers; Qwen3 decoder with q/k RMSNorm, no biases).
use super::PlanError;
use serde::{Deserialize, Serialize};

/// Dimensions of a Qwen3-VL checkpoint that decide its memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelDims {
    // ---- vision (`vision_config`)
    pub vision_depth: u64,
    pub vision_hidden: u64,
    pub vision_intermediate: u64,
    pub vision_heads: u64,
    /// Width of a merged image token (= the LM's hidden size).
    pub vision_out_hidden: u64,
    /// Deepstack mergers (`len(deepstack_visual_indexes)`).
    pub deepstack_levels: u64,
    /// Learned position-table rows (2304 = 48 x 48 for 2B).
    pub num_position_embeddings: u64,
    /// in_channels * temporal_patch_size * patch_size^2 (1536).
    pub patch_dim: u64,
    /// spatial_merge_size (2): a merged token is merge^2 raw patches.
    pub spatial_merge: u64,
    // ---- text (`text_config`)
    pub text_layers: u64,
    pub text_hidden: u64,
    pub text_intermediate: u64,
    pub text_heads: u64,
    pub text_kv_heads: u64,
    pub head_dim: u64,
    pub vocab: u64,
    /// `lm_head` shares `embed_tokens` (not counted twice).
    pub tied: bool,
    /// Bytes the LM's weights of a GGUF checkpoint take when loaded
    /// (`quantization_config.lm_weight_bytes` of its derived config.json); `None` for float
    /// checkpoints, whose bytes follow from the parameter count and dtype.
    pub lm_stored_bytes: Option<u64>,
    /// The decoder layers' linear weights are int8 with a scale per output row (a
    /// compressed-tensors W8A8 checkpoint: `quantization_config.quant_method` is
    /// `compressed-tensors`).
    #[serde(default)]
    pub lm_linears_int8: bool,
    /// The decoder layers' linear weights are 4-bit with a scale per output row and group of
    /// this many inputs (a compressed-tensors W4A16 checkpoint: `format: pack-quantized`).
    #[serde(default)]
    pub lm_linears_int4_group: Option<u64>,
    /// The decoder layers' linear weights are FP8 with a scale per block of this many inputs
    /// (and some rows): `quantization_config.quant_method` is `fp8`, `weight_block_size[1]`.
    #[serde(default)]
    pub lm_linears_fp8_block: Option<u64>,
}

/// Parameter counts by part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ParamCount {
    pub visual: u64,
    pub text: u64,
    /// Of `visual`/`text`: 1-D norm weights and biases (kept in f32 by the CPU backend).
    pub visual_vectors: u64,
    pub text_vectors: u64,
    /// Of `text`: the decoder layers' linear weights, and their output rows.
    pub text_linears: u64,
    pub text_linear_rows: u64,
}

impl ParamCount {
    pub fn total(&self) -> u64 {
        self.visual + self.text
    }
}

impl ModelDims {
    /// Qwen/Qwen3-VL-2B-Instruct.
    pub fn qwen3_vl_2b() -> ModelDims {
        ModelDims {
            vision_depth: 24,
            vision_hidden: 1024,
            vision_intermediate: 4096,
            vision_heads: 16,
            vision_out_hidden: 2048,
            deepstack_levels: 3,
            num_position_embeddings: 2304,
            patch_dim: 3 * 2 * 16 * 16,
            spatial_merge: 2,
            text_layers: 28,
            text_hidden: 2048,
            text_intermediate: 6144,
            text_heads: 16,
            text_kv_heads: 8,
            head_dim: 128,
            vocab: 151_936,
            tied: true,
            lm_stored_bytes: None,
            lm_linears_int8: false,
            lm_linears_int4_group: None,
            lm_linears_fp8_block: None,
        }
    }

    /// A named preset (`qwen3-vl-2b`).
    pub fn preset(name: &str) -> Result<ModelDims, PlanError> {
        match name.to_ascii_lowercase().replace('_', "-").as_str() {
            "qwen3-vl-2b" | "qwen3-vl-2b-instruct" | "qwen/qwen3-vl-2b-instruct" => {
                Ok(Self::qwen3_vl_2b())
            }
            _ => Err(PlanError::Model(format!(
                "unknown model preset `{name}`; known: qwen3-vl-2b"
            ))),
        }
    }

    /// From the text of a checkpoint's `config.json`.
    pub fn from_config_json(text: &str) -> Result<ModelDims, PlanError> {
        let raw: RawConfig = serde_json::from_str(text)
            .map_err(|e| PlanError::Model(format!("config.json: {e}")))?;
        let t = raw.text_config;
        let v = raw.vision_config;
        let heads = t.num_attention_heads;
        if heads == 0 || v.num_heads == 0 {
            return Err(PlanError::Model(
                "config.json: attention heads must be positive".into(),
            ));
        }
        let head_dim = t.head_dim.unwrap_or(t.hidden_size / heads);
        Ok(ModelDims {
            vision_depth: v.depth,
            vision_hidden: v.hidden_size,
            vision_intermediate: v.intermediate_size,
            vision_heads: v.num_heads,
            vision_out_hidden: v.out_hidden_size,
            deepstack_levels: v.deepstack_visual_indexes.len() as u64,
            num_position_embeddings: v.num_position_embeddings,
            patch_dim: v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size,
            spatial_merge: v.spatial_merge_size,
            text_layers: t.num_hidden_layers,
            text_hidden: t.hidden_size,
            text_intermediate: t.intermediate_size,
            text_heads: heads,
            text_kv_heads: t.num_key_value_heads.unwrap_or(heads),
            head_dim,
            vocab: t.vocab_size,
            tied: raw
                .tie_word_embeddings
                .or(t.tie_word_embeddings)
                .unwrap_or(false),
            lm_linears_int8: raw.quantization_config.as_ref().is_some_and(|q| {
                q.quant_method.as_deref() == Some("compressed-tensors")
                    && q.format.as_deref() != Some("pack-quantized")
            }),
            lm_linears_int4_group: raw.quantization_config.as_ref().and_then(|q| {
                if q.quant_method.as_deref() != Some("compressed-tensors")
                    || q.format.as_deref() != Some("pack-quantized")
                {
                    return None;
                }
                // One group size for every config group (the loader refuses others).
                q.config_groups
                    .as_ref()?
                    .as_object()?
                    .values()
                    .find_map(|g| g.get("weights")?.get("group_size")?.as_u64())
            }),
            lm_linears_fp8_block: raw.quantization_config.as_ref().and_then(|q| {
                if q.quant_method.as_deref() != Some("fp8") {
                    return None;
                }
                q.weight_block_size.as_ref()?.get(1).copied()
            }),
            lm_stored_bytes: raw.quantization_config.and_then(|q| q.lm_weight_bytes),
        })
    }

    /// From a checkpoint directory (its `config.json`).
    pub fn from_dir(dir: &std::path::Path) -> Result<ModelDims, PlanError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| PlanError::Model(format!("cannot read {}: {e}", path.display())))?;
        Self::from_config_json(&text)
    }

    /// Parameters of each part, as a Hugging Face checkpoint stores them.
    pub fn params(&self) -> ParamCount {
        let (h, i) = (self.vision_hidden, self.vision_intermediate);
        let merged = h * self.spatial_merge * self.spatial_merge;
        let o = self.vision_out_hidden;
        // Conv3d (no bias in HF? Qwen3-VL's patch embed has a bias) + position table.
        let patch = self.patch_dim * h + h;
        let pos = self.num_position_embeddings * h;
        // norm1, norm2 (LayerNorm weight + bias), qkv, proj, fc1, fc2 (all biased).
        let block_mat = h * 3 * h + h * h + h * i + i * h;
        let block_vec = 4 * h + 3 * h + h + i + h;
        // merger: LayerNorm over `h` (pre-shuffle), fc1 merged->merged, fc2 merged->out.
        let merger_mat = merged * merged + merged * o;
        let merger_vec = 2 * h + merged + o;
        // deepstack mergers: LayerNorm over `merged` (post-shuffle).
        let ds_vec = 2 * merged + merged + o;
        let visual_mat = self.patch_dim * h
            + pos
            + self.vision_depth * block_mat
            + merger_mat
            + self.deepstack_levels * merger_mat;
        let visual_vectors =
            h + self.vision_depth * block_vec + merger_vec + self.deepstack_levels * ds_vec;
        debug_assert_eq!(
            visual_mat + visual_vectors,
            patch
                + pos
                + self.vision_depth * (block_mat + block_vec)
                + merger_mat
                + merger_vec
                + self.deepstack_levels * (merger_mat + ds_vec)
        );

        let th = self.text_hidden;
        let q = self.text_heads * self.head_dim;
        let kv = self.text_kv_heads * self.head_dim;
        let layer_mat = th * q * 2 + th * kv * 2 + 3 * th * self.text_intermediate;
        let layer_vec = 2 * self.head_dim + 2 * th;
        let embed = self.vocab * th;
        let head = if self.tied { 0 } else { self.vocab * th };
        let text_mat = embed + head + self.text_layers * layer_mat;
        let text_vectors = self.text_layers * layer_vec + th;
        ParamCount {
            visual: visual_mat + visual_vectors,
            text: text_mat + text_vectors,
            visual_vectors,
            text_vectors,
            text_linears: self.text_layers * layer_mat,
            text_linear_rows: self.text_layers * (q + 2 * kv + 2 * th + 2 * self.text_intermediate),
        }
    }

    /// KV bytes of one token over all layers (K and V) at `dtype_bytes` per value.
    pub fn kv_bytes_per_token(&self, dtype_bytes: u64) -> u64 {
        2 * self.text_layers * self.text_kv_heads * self.head_dim * dtype_bytes
    }
}

// ---- raw serde shapes of config.json (unknown keys ignored) --------------------------------

#[derive(Deserialize)]
struct RawConfig {
    text_config: RawText,
    vision_config: RawVision,
    tie_word_embeddings: Option<bool>,
    quantization_config: Option<RawQuantization>,
}

#[derive(Deserialize)]
struct RawQuantization {
    lm_weight_bytes: Option<u64>,
    quant_method: Option<String>,
    format: Option<String>,
    config_groups: Option<serde_json::Value>,
    weight_block_size: Option<Vec<u64>>,
}

#[derive(Deserialize)]
struct RawText {
    vocab_size: u64,
    hidden_size: u64,
    intermediate_size: u64,
    num_hidden_layers: u64,
    num_attention_heads: u64,
    num_key_value_heads: Option<u64>,
    head_dim: Option<u64>,
    tie_word_embeddings: Option<bool>,
}

#[derive(Deserialize)]
struct RawVision {
    depth: u64,
    hidden_size: u64,
    intermediate_size: u64,
    num_heads: u64,
    #[serde(default = "d_three")]
    in_channels: u64,
    #[serde(default = "d_patch")]
    patch_size: u64,
    #[serde(default = "d_two")]
    temporal_patch_size: u64,
    #[serde(default = "d_two")]
    spatial_merge_size: u64,
    out_hidden_size: u64,
    #[serde(default = "d_npos")]
    num_position_embeddings: u64,
    #[serde(default)]
    deepstack_visual_indexes: Vec<u64>,
}

fn d_three() -> u64 {
    3
}
fn d_patch() -> u64 {
    16
}
fn d_two() -> u64 {
    2
}
fn d_npos() -> u64 {
    2304
}
