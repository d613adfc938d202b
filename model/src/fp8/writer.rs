//! `vlm quantize --scheme fp8-block`: a float Qwen3-VL checkpoint -> an FP8 block directory in
//! the layout of Qwen's FP8 releases (`quant_method: fp8`, e4m3fn weights, one f32
//! `weight_scale_inv` per block of `block` x `block`): the LM's decoder linears FP8,
//! everything else (head, embeddings, norms, the vision tower) as it was; the other files
//! copied.
use crate::error::{ModelError, Result};
use crate::quant_writer::{rewrite_checkpoint, Out};
use safetensors::Dtype;
use std::path::Path;

/// Largest finite e4m3fn magnitude.
const E4M3_MAX: f32 = 448.0;

/// The `quantization_config` of Qwen's FP8 releases at `block`, `kept` (module names) listed
/// in `modules_to_not_convert`, which vLLM matches exactly, name by name.
pub fn fp8_config(block: usize, kept: &[String]) -> serde_json::Value {
    serde_json::json!({
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
        "modules_to_not_convert": kept
    })
}

/// Block-wise round-to-nearest of `w` (n, k): per block of `block` rows and inputs `scale =
/// max|block| / 448` (f32) and `code = e4m3(w / scale)` (round to nearest even, saturating), so
/// that `e4m3 * scale` is the weight the reference and the kernels multiply by. `k` must be a
/// multiple of `block`. Returns the codes and the (ceil(n / block), k / block) scales.
fn quantize_blocks(w: &[f32], n: usize, k: usize, block: usize) -> (Vec<u8>, Vec<f32>) {
    let (rb, cb) = (n.div_ceil(block), k / block);
    let mut scales = vec![0f32; rb * cb];
    for (r, row) in w.chunks_exact(k).enumerate() {
        for (g, vals) in row.chunks_exact(block).enumerate() {
            let s = &mut scales[(r / block) * cb + g];
            *s = vals.iter().fold(*s, |m, v| m.max(v.abs()));
        }
    }
    for s in &mut scales {
        *s /= E4M3_MAX;
    }
    let codes = w
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let s = scales[(i / k / block) * cb + (i % k) / block];
            let x = if s > 0.0 { v / s } else { 0.0 };
            float8::F8E4M3::from_f32(x.clamp(-E4M3_MAX, E4M3_MAX)).to_bits()
        })
        .collect();
    (codes, scales)
}

/// Writes the FP8 directory `dst` for checkpoint `src`, blocks of `block` x `block`. Refuses a
/// linear whose input width is not a multiple of `block`, naming it.
pub fn quantize_checkpoint_fp8(src: &Path, dst: &Path, block: usize) -> Result<()> {
    if block == 0 || !block.is_multiple_of(2) {
        return Err(ModelError::invalid(format!(
            "block size {block}: a positive even number"
        )));
    }
    // The head is listed even when tied to the token table (no tensor of its own).
    let config = |kept: &[String]| {
        let mut names = kept.to_vec();
        if !names.iter().any(|n| n == "lm_head") {
            names.push("lm_head".into());
        }
        fp8_config(block, &names)
    };
    rewrite_checkpoint(src, dst, &config, &|prefix, w, n, k, _| {
        if !k.is_multiple_of(block) {
            return Err(ModelError::invalid(format!(
                "{prefix}.weight has {k} inputs, not a multiple of the block size {block} \
                 (choose one that divides every linear's input width)"
            )));
        }
        let (codes, scales) = quantize_blocks(w, n, k, block);
        let (rb, cb) = (n.div_ceil(block), k / block);
        Ok(vec![
            (
                format!("{prefix}.weight"),
                Out::owned(Dtype::F8_E4M3, vec![n, k], codes),
            ),
            (
                format!("{prefix}.weight_scale_inv"),
                Out::owned(
                    Dtype::F32,
                    vec![rb, cb],
                    scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
                ),
            ),
        ])
    })
}
