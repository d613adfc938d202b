//! What this crate's forward holds and allocates, as functions of the model's dimensions: the
//! figures every backend that runs it reports to the planner (`vlm_config::plan::Sizing`), from
//! one place.
use vlm_config::plan::{graph_lm_elems, Dtypes, ModelDims, Part};
use vlm_config::{DeployConfig, Dtype, KvDtype};

/// The dtypes of a part whose config says `dtype`: weights in it, activations in f32, the KV
/// cache per [`crate::dtype::kv_dtype`] (bf16 for bf16 weights, else f32).
pub fn dtypes(dtype: Dtype) -> Dtypes {
    Dtypes {
        weights: dtype,
        activations: Dtype::F32,
        kv: if dtype == Dtype::Bf16 {
            KvDtype::Bf16
        } else {
            KvDtype::F32
        },
    }
}

/// Bytes of a part's weights as this crate loads them with matrices stored as `weights` (a
/// bf16 matrix packed by a backend takes the same bytes): 1-D norm weights and biases in f32,
/// everything else counted as the planner counts it (`ModelDims::params`).
///
/// A GGUF LM takes the bytes its derived config states (`vlm_model::gguf::materialize`), plus
/// an untied embedding table expanded to `weights`. A W8A8 LM's decoder linears take a byte
/// per value and 8 per output row (scale and row sum, `Int8Weight`), a W4A16 LM's half a byte
/// a value and 4 a group scale (`Int4Weight`), an FP8 LM's a byte a value and 4 per row and
/// block of inputs (`Fp8Weight`), the rest as above.
pub fn weight_bytes(d: &ModelDims, part: Part, weights: Dtype) -> u64 {
    if let (Part::Lm, Some(stored)) = (part, d.lm_stored_bytes) {
        let table = if d.tied {
            0
        } else {
            d.vocab * d.text_hidden * weights.bytes()
        };
        return stored + table;
    }
    let p = d.params();
    let (all, vectors) = match part {
        Part::Visual => (p.visual, p.visual_vectors),
        Part::Lm => (p.text, p.text_vectors),
    };
    if part == Part::Lm {
        // The decoder linears of a quantized directory, as the CPU holds them.
        let l = p.text_linears;
        let linears = if d.lm_linears_int8 {
            Some(l + 8 * p.text_linear_rows)
        } else if let Some(block) = d.lm_linears_fp8_block.filter(|&b| b > 0) {
            Some(l + 4 * (l / block))
        } else {
            d.lm_linears_int4_group
                .filter(|&g| g > 0)
                .map(|group| l / 2 + 4 * (l / group))
        };
        if let Some(linears) = linears {
            return (all - vectors - l) * weights.bytes() + linears + vectors * 4;
        }
    }
    (all - vectors) * weights.bytes() + vectors * 4
}

/// KV blocks a [`crate::text::PagedKvCache`] allocates beyond the usable ones: the dummy block
/// padded decode rows write to.
pub const KV_EXTRA_BLOCKS: u32 = 1;

/// Bytes of one text step's live activations (allocated per op, freed after the step): f32,
/// the scores of every cached block side by side over `max_seq_len` keys.
pub fn lm_step_bytes(d: &ModelDims, cfg: &DeployConfig, rows: u64, logit_rows: u64) -> u64 {
    4 * graph_lm_elems(d, rows, logit_rows, cfg.max_seq_len as u64)
}
