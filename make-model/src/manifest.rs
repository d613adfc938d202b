//! Every tensor a Qwen3-VL checkpoint holds, named and shaped as in the Hugging Face layout
//! (`qwen3-vl-2b-weights.txt`), derived from the config, with the init each one gets.
use vlm_compute::Qwen3VlConfig;

/// How a generated tensor is filled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Every value the same (norm weights: 1).
    Constant(f32),
    /// Zero-mean, this standard deviation (bell-shaped, bounded at ~3.5 std).
    Normal { std: f32 },
    /// `center` plus zero-mean noise of this standard deviation.
    Around { center: f32, std: f32 },
}

/// The manifest with every constant (norm) weight jittered by 10% around its value.
pub fn jitter_constants(specs: Vec<TensorSpec>) -> Vec<TensorSpec> {
    specs
        .into_iter()
        .map(|s| match s.init {
            Init::Constant(c) => TensorSpec {
                init: Init::Around {
                    center: c,
                    std: 0.1 * c.abs(),
                },
                ..s
            },
            _ => s,
        })
        .collect()
}

/// One tensor of the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
}

impl TensorSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Weight of the decoder's q_norm / k_norm: attention scores get a spread of about
/// QK_NORM_WEIGHT^2 (about 6) instead of 1 (near-uniform attention).
pub const QK_NORM_WEIGHT: f32 = 2.5;

/// Std of a bias: small, non-zero so that a loader that drops biases is caught.
const BIAS_STD: f32 = 0.02;

fn linear_std(fan_in: usize) -> f32 {
    1.0 / (fan_in as f32).sqrt()
}

struct Builder(Vec<TensorSpec>);

impl Builder {
    fn push(&mut self, name: String, shape: Vec<usize>, init: Init) {
        self.0.push(TensorSpec { name, shape, init });
    }
    /// `{p}.weight` (out, in) with std 1/sqrt(in), and `{p}.bias` when `bias`.
    fn linear(&mut self, p: &str, out: usize, inp: usize, bias: bool) {
        self.push(
            format!("{p}.weight"),
            vec![out, inp],
            Init::Normal {
                std: linear_std(inp),
            },
        );
        if bias {
            self.push(
                format!("{p}.bias"),
                vec![out],
                Init::Normal { std: BIAS_STD },
            );
        }
    }
    fn layer_norm(&mut self, p: &str, dim: usize) {
        self.push(format!("{p}.weight"), vec![dim], Init::Constant(1.0));
        self.push(
            format!("{p}.bias"),
            vec![dim],
            Init::Normal { std: BIAS_STD },
        );
    }
    fn rms_norm(&mut self, p: &str, dim: usize) {
        self.push(format!("{p}.weight"), vec![dim], Init::Constant(1.0));
    }
    /// q_norm / k_norm: weight QK_NORM_WEIGHT, see [`weight_manifest`].
    fn qk_norm(&mut self, p: &str, dim: usize) {
        self.push(
            format!("{p}.weight"),
            vec![dim],
            Init::Constant(QK_NORM_WEIGHT),
        );
    }
}

/// The checkpoint's tensors in `state_dict` order: vision tower, language model, then
/// `lm_head.weight` only when the embeddings are untied.
///
/// Init keeps activations O(1) and greedy decoding lively: linears N(0, 1/fan_in), norms 1,
/// biases N(0, 0.02^2), embeddings N(0, 1/hidden) (tied logits get unit spread and the
/// residual stream is not dominated by the input token's own embedding), and q_norm / k_norm
/// weights [`QK_NORM_WEIGHT`]: with weight 1 the attention of a random model is nearly uniform,
/// its output is the same context average at every step, and greedy decoding falls into
/// repeating one token (see tests/make_generation.rs).
pub fn weight_manifest(cfg: &Qwen3VlConfig) -> Vec<TensorSpec> {
    let v = &cfg.vision;
    let t = &cfg.text;
    let mut b = Builder(Vec::new());

    // ---- vision tower
    let d = v.hidden_size;
    let pv = "model.visual";
    let patch_shape = vec![
        d,
        v.in_channels,
        v.temporal_patch_size,
        v.patch_size,
        v.patch_size,
    ];
    b.push(
        format!("{pv}.patch_embed.proj.weight"),
        patch_shape,
        Init::Normal {
            std: linear_std(v.patch_dim()),
        },
    );
    b.push(
        format!("{pv}.patch_embed.proj.bias"),
        vec![d],
        Init::Normal { std: BIAS_STD },
    );
    b.push(
        format!("{pv}.pos_embed.weight"),
        vec![v.num_position_embeddings, d],
        Init::Normal { std: 0.1 },
    );
    for i in 0..v.depth {
        let p = format!("{pv}.blocks.{i}");
        b.layer_norm(&format!("{p}.norm1"), d);
        b.layer_norm(&format!("{p}.norm2"), d);
        b.linear(&format!("{p}.attn.qkv"), 3 * d, d, true);
        b.linear(&format!("{p}.attn.proj"), d, d, true);
        b.linear(&format!("{p}.mlp.linear_fc1"), v.intermediate_size, d, true);
        b.linear(&format!("{p}.mlp.linear_fc2"), d, v.intermediate_size, true);
    }
    let merged = d * v.merge_unit();
    let merger = |b: &mut Builder, p: &str, norm_dim: usize| {
        b.layer_norm(&format!("{p}.norm"), norm_dim);
        b.linear(&format!("{p}.linear_fc1"), merged, merged, true);
        b.linear(&format!("{p}.linear_fc2"), v.out_hidden_size, merged, true);
    };
    merger(&mut b, &format!("{pv}.merger"), d);
    for k in 0..v.deepstack_visual_indexes.len() {
        merger(&mut b, &format!("{pv}.deepstack_merger_list.{k}"), merged);
    }

    // ---- language model
    let h = t.hidden_size;
    let pl = "model.language_model";
    let embed_std = 1.0 / (h as f32).sqrt();
    b.push(
        format!("{pl}.embed_tokens.weight"),
        vec![t.vocab_size, h],
        Init::Normal { std: embed_std },
    );
    let q = t.num_attention_heads * t.head_dim;
    let kv = t.num_key_value_heads * t.head_dim;
    for i in 0..t.num_hidden_layers {
        let p = format!("{pl}.layers.{i}");
        b.linear(&format!("{p}.self_attn.q_proj"), q, h, t.attention_bias);
        b.linear(&format!("{p}.self_attn.k_proj"), kv, h, t.attention_bias);
        b.linear(&format!("{p}.self_attn.v_proj"), kv, h, t.attention_bias);
        b.linear(&format!("{p}.self_attn.o_proj"), h, q, t.attention_bias);
        b.qk_norm(&format!("{p}.self_attn.q_norm"), t.head_dim);
        b.qk_norm(&format!("{p}.self_attn.k_norm"), t.head_dim);
        b.linear(&format!("{p}.mlp.gate_proj"), t.intermediate_size, h, false);
        b.linear(&format!("{p}.mlp.up_proj"), t.intermediate_size, h, false);
        b.linear(&format!("{p}.mlp.down_proj"), h, t.intermediate_size, false);
        b.rms_norm(&format!("{p}.input_layernorm"), h);
        b.rms_norm(&format!("{p}.post_attention_layernorm"), h);
    }
    b.rms_norm(&format!("{pl}.norm"), h);
    if !cfg.tie_word_embeddings {
        b.push(
            "lm_head.weight".into(),
            vec![t.vocab_size, h],
            Init::Normal { std: embed_std },
        );
    }
    b.0
}
