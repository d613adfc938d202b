//! The architectures `make-model` can generate and the `config.json` each one gets.
use super::vocab::VocabLayout;
use super::WeightDtype;
use serde_json::{json, Value};
use std::fmt;
use std::str::FromStr;

/// A generated checkpoint's architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// The dims of the reference's `configs/tiny.json` (vision depth 3, hidden 64; text 3 layers,
    /// hidden 64), with a 1024-token vocabulary whose top 26 ids are the Qwen added tokens.
    Tiny,
    /// The real Qwen3-VL-2B-Instruct dims, vocabulary size and special-token ids.
    Qwen3Vl2b,
    /// Tiny with a 256-wide LM (intermediate 512, head_dim 64): the narrowest whose linear
    /// weights GGUF's k-quants (256-value blocks) quantize, for the quantized tests. Its norm
    /// weights are 1 ± 10% (as trained ones are not all 1): with all-1 norms an integer-scaled
    /// GGUF embedding row reaches the activation rounding with exact .5 ties, which 1-ulp
    /// differences between two correct implementations then round apart.
    Tiny256,
}

impl Preset {
    pub const ALL: [Preset; 3] = [Preset::Tiny, Preset::Qwen3Vl2b, Preset::Tiny256];

    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Tiny256 => "tiny-256",
            Preset::Qwen3Vl2b => "qwen3-vl-2b",
        }
    }

    /// f32 for tiny (test-friendly), bf16 for 2B (like the real checkpoint).
    pub fn default_dtype(self) -> WeightDtype {
        match self {
            Preset::Tiny | Preset::Tiny256 => WeightDtype::F32,
            Preset::Qwen3Vl2b => WeightDtype::BF16,
        }
    }

    /// Largest shard in bytes; `None` writes a single `model.safetensors`.
    pub fn default_max_shard_bytes(self) -> Option<u64> {
        match self {
            Preset::Tiny | Preset::Tiny256 => None,
            Preset::Qwen3Vl2b => Some(2_000_000_000),
        }
    }

    pub(crate) fn dims(self) -> Dims {
        match self {
            Preset::Tiny => Dims {
                vocab: VocabLayout {
                    learned_merges: 742,
                    first_added_id: 998,
                    vocab_size: 1024,
                },
                hidden: 64,
                intermediate: 128,
                layers: 3,
                heads: 4,
                kv_heads: 2,
                head_dim: 16,
                max_positions: 4096,
                rope_theta: 5_000_000.0,
                mrope_section: [4, 2, 2],
                tie: true,
                v_depth: 3,
                v_hidden: 64,
                v_intermediate: 128,
                v_heads: 2,
                v_out: 64,
                v_positions: 64,
                deepstack: vec![0, 2],
            },
            Preset::Tiny256 => Dims {
                hidden: 256,
                intermediate: 512,
                layers: 2,
                head_dim: 64,
                mrope_section: [16, 8, 8],
                v_out: 256,
                ..Preset::Tiny.dims()
            },
            Preset::Qwen3Vl2b => Dims {
                vocab: VocabLayout {
                    learned_merges: 742,
                    first_added_id: 151643,
                    vocab_size: 151936,
                },
                hidden: 2048,
                intermediate: 6144,
                layers: 28,
                heads: 16,
                kv_heads: 8,
                head_dim: 128,
                max_positions: 262144,
                rope_theta: 5_000_000.0,
                mrope_section: [24, 20, 20],
                tie: true,
                v_depth: 24,
                v_hidden: 1024,
                v_intermediate: 4096,
                v_heads: 16,
                v_out: 2048,
                v_positions: 2304,
                deepstack: vec![5, 11, 17],
            },
        }
    }

    /// Whether the norm weights are jittered around their constant ([`Preset::Tiny256`]).
    pub fn jittered_norms(self) -> bool {
        self == Preset::Tiny256
    }

    /// Where the tokenizer puts its pieces (and so the special-token ids of config.json).
    pub fn vocab_layout(self) -> VocabLayout {
        self.dims().vocab
    }

    /// The checkpoint's `config.json`, both rope spellings included.
    pub fn config_json(self, dtype: WeightDtype) -> Value {
        self.dims().config_json(dtype)
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Preset {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "tiny" => Ok(Preset::Tiny),
            "tiny-256" => Ok(Preset::Tiny256),
            "qwen3-vl-2b" | "qwen3-vl-2b-instruct" | "2b" => Ok(Preset::Qwen3Vl2b),
            other => Err(format!(
                "unknown preset {other:?}; use one of: tiny, tiny-256, qwen3-vl-2b"
            )),
        }
    }
}

/// The numbers a preset fixes.
#[derive(Debug, Clone)]
pub(crate) struct Dims {
    pub vocab: VocabLayout,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub max_positions: usize,
    pub rope_theta: f64,
    pub mrope_section: [usize; 3],
    pub tie: bool,
    pub v_depth: usize,
    pub v_hidden: usize,
    pub v_intermediate: usize,
    pub v_heads: usize,
    pub v_out: usize,
    pub v_positions: usize,
    pub deepstack: Vec<usize>,
}

impl Dims {
    fn config_json(&self, dtype: WeightDtype) -> Value {
        let v = &self.vocab;
        let rope_scaling = json!({
            "mrope_interleaved": true,
            "mrope_section": self.mrope_section,
            "rope_type": "default"
        });
        let rope_parameters = json!({
            "mrope_interleaved": true,
            "mrope_section": self.mrope_section,
            "rope_theta": self.rope_theta,
            "rope_type": "default"
        });
        json!({
            "architectures": ["Qwen3VLForConditionalGeneration"],
            "model_type": "qwen3_vl",
            "dtype": dtype.torch_name(),
            "image_token_id": v.image_pad_id(),
            "video_token_id": v.video_pad_id(),
            "vision_start_token_id": v.vision_start_id(),
            "vision_end_token_id": v.vision_end_id(),
            "tie_word_embeddings": self.tie,
            "text_config": {
                "model_type": "qwen3_vl_text",
                "attention_bias": false,
                "attention_dropout": 0.0,
                "bos_token_id": v.endoftext_id(),
                "eos_token_id": v.im_end_id(),
                "dtype": dtype.torch_name(),
                "head_dim": self.head_dim,
                "hidden_act": "silu",
                "hidden_size": self.hidden,
                "initializer_range": 0.02,
                "intermediate_size": self.intermediate,
                "max_position_embeddings": self.max_positions,
                "num_attention_heads": self.heads,
                "num_hidden_layers": self.layers,
                "num_key_value_heads": self.kv_heads,
                "rms_norm_eps": 1e-6,
                "rope_parameters": rope_parameters,
                "rope_scaling": rope_scaling,
                "rope_theta": self.rope_theta,
                "tie_word_embeddings": self.tie,
                "use_cache": true,
                "vocab_size": v.vocab_size
            },
            "vision_config": {
                "model_type": "qwen3_vl_vision",
                "deepstack_visual_indexes": self.deepstack,
                "depth": self.v_depth,
                "hidden_act": "gelu_pytorch_tanh",
                "hidden_size": self.v_hidden,
                "in_channels": 3,
                "initializer_range": 0.02,
                "intermediate_size": self.v_intermediate,
                "num_heads": self.v_heads,
                "num_position_embeddings": self.v_positions,
                "out_hidden_size": self.v_out,
                "patch_size": 16,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2
            }
        })
    }
}
