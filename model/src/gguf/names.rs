//! Hugging Face tensor names (what the model code asks for) -> the names llama.cpp's
//! `convert_hf_to_gguf.py` gives them: `Qwen3VLTextModel` (the LM file, `TENSOR_NAMES` of
//! `gguf-py/gguf/constants.py` for `MODEL_ARCH.QWEN3VL`) and `Qwen3VLVisionModel.modify_tensors`
//! (the `--mmproj` file).

/// Where an HF tensor lives in the GGUF pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GgufName {
    /// In the LM file under this name.
    Lm(String),
    /// In the mmproj file under this name.
    Mmproj(String),
    /// The Conv3d patch embedding, which the converter splits into its two temporal slices
    /// (`v.patch_embd.weight`, `v.patch_embd.weight.1`): stacked back on dim 2.
    PatchEmbedSlices,
}

const LM_LAYER: [(&str, &str); 11] = [
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
];

const VISION_BLOCK: [(&str, &str); 6] = [
    ("norm1", "ln1"),
    ("norm2", "ln2"),
    ("attn.qkv", "attn_qkv"),
    ("attn.proj", "attn_out"),
    ("mlp.linear_fc1", "ffn_up"),
    ("mlp.linear_fc2", "ffn_down"),
];

/// `name` split at its last dot: (module, "weight" | "bias").
fn split_param(name: &str) -> Option<(&str, &str)> {
    name.rsplit_once('.')
}

/// `"<n>.<rest>"` -> (n, rest).
fn split_index(s: &str) -> Option<(usize, &str)> {
    let (n, rest) = s.split_once('.')?;
    Some((n.parse().ok()?, rest))
}

/// The GGUF location of HF tensor `name`; `deepstack` are the vision layers the deepstack
/// mergers read (`deepstack_visual_indexes`), which name their tensors in the mmproj.
pub fn gguf_name(name: &str, deepstack: &[usize]) -> Option<GgufName> {
    if let Some(rest) = name.strip_prefix("model.language_model.") {
        let (module, param) = split_param(rest)?;
        let lm = |s: &str| Some(GgufName::Lm(format!("{s}.{param}")));
        return match module {
            "embed_tokens" => lm("token_embd"),
            "norm" => lm("output_norm"),
            _ => {
                let (i, sub) = split_index(module.strip_prefix("layers.")?)?;
                let (_, g) = LM_LAYER.iter().find(|(hf, _)| *hf == sub)?;
                lm(&format!("blk.{i}.{g}"))
            }
        };
    }
    if name == "lm_head.weight" {
        return Some(GgufName::Lm("output.weight".into()));
    }
    let rest = name.strip_prefix("model.visual.")?;
    if rest == "patch_embed.proj.weight" {
        return Some(GgufName::PatchEmbedSlices);
    }
    let (module, param) = split_param(rest)?;
    let mm = |s: &str| Some(GgufName::Mmproj(format!("{s}.{param}")));
    match module {
        "patch_embed.proj" => mm("v.patch_embd"),
        "pos_embed" => mm("v.position_embd"),
        "merger.norm" => mm("v.post_ln"),
        "merger.linear_fc1" => mm("mm.0"),
        "merger.linear_fc2" => mm("mm.2"),
        _ => {
            if let Some(b) = module.strip_prefix("blocks.") {
                let (i, sub) = split_index(b)?;
                let (_, g) = VISION_BLOCK.iter().find(|(hf, _)| *hf == sub)?;
                return mm(&format!("v.blk.{i}.{g}"));
            }
            let (k, sub) = split_index(module.strip_prefix("deepstack_merger_list.")?)?;
            let layer = deepstack.get(k)?;
            let g = match sub {
                "norm" => "norm",
                "linear_fc1" => "fc1",
                "linear_fc2" => "fc2",
                _ => return None,
            };
            mm(&format!("v.deepstack.{layer}.{g}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_the_converter_names() {
        let lm = |s: &str| Some(GgufName::Lm(s.into()));
        let mm = |s: &str| Some(GgufName::Mmproj(s.into()));
        let ds = [5, 11, 17];
        let cases = [
            (
                "model.language_model.embed_tokens.weight",
                lm("token_embd.weight"),
            ),
            ("model.language_model.norm.weight", lm("output_norm.weight")),
            ("lm_head.weight", lm("output.weight")),
            (
                "model.language_model.layers.27.self_attn.k_norm.weight",
                lm("blk.27.attn_k_norm.weight"),
            ),
            (
                "model.language_model.layers.3.mlp.down_proj.weight",
                lm("blk.3.ffn_down.weight"),
            ),
            (
                "model.visual.blocks.0.attn.qkv.bias",
                mm("v.blk.0.attn_qkv.bias"),
            ),
            ("model.visual.merger.linear_fc2.weight", mm("mm.2.weight")),
            (
                "model.visual.deepstack_merger_list.1.linear_fc1.weight",
                mm("v.deepstack.11.fc1.weight"),
            ),
            (
                "model.visual.patch_embed.proj.bias",
                mm("v.patch_embd.bias"),
            ),
            (
                "model.visual.patch_embed.proj.weight",
                Some(GgufName::PatchEmbedSlices),
            ),
            ("model.visual.deepstack_merger_list.3.norm.weight", None),
            (
                "model.language_model.layers.0.self_attn.rotary.weight",
                None,
            ),
        ];
        for (hf, want) in cases {
            assert_eq!(gguf_name(hf, &ds), want, "{hf}");
        }
    }
}
