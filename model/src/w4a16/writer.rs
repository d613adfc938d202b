//! `vlm quantize --scheme w4a16`: a float Qwen3-VL checkpoint -> a compressed-tensors
//! `pack-quantized` directory as llm-compressor's `W4A16` preset with round-to-nearest writes
//! it (what vLLM loads as `CompressedTensorsWNA16`): the LM's linear weights 4-bit with one
//! symmetric scale per output row and group of inputs, everything else (head, embeddings,
//! norms, the vision tower) as it was; the other files copied.
use crate::error::{ModelError, Result};
use crate::quant_writer::{rewrite_checkpoint, scale_bytes, stored, Out};
use candle_core::DType;
use safetensors::Dtype;
use std::path::Path;

/// The `quantization_config` llm-compressor writes for its `W4A16` preset at `group` (minmax
/// observer, the head and the vision tower ignored).
pub fn w4a16_config(group: usize) -> serde_json::Value {
    serde_json::json!({
        "quant_method": crate::quant_config::COMPRESSED_TENSORS,
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4, "type": "int", "symmetric": true, "strategy": "group",
                "group_size": group, "dynamic": false, "block_structure": null,
                "actorder": null, "observer": "minmax", "observer_kwargs": {}
            },
            "input_activations": null,
            "output_activations": null
        }},
        "ignore": ["re:.*lm_head", "re:.*visual.*"],
        "kv_cache_scheme": null,
        "sparsity_config": {},
        "global_compression_ratio": null
    })
}

/// Group-wise round-to-nearest of `w` (n, k), as compressed-tensors' symmetric minmax does it:
/// `scale = max|group| / 7.5` (half of the range -8..=7), stored in `dtype` (the
/// checkpoint's), and `q = clamp(round_half_even(w / stored scale), -8, 7)`, so that `q *
/// scale` is the weight the reference and the kernels multiply by. `k` must be a multiple of
/// `group`.
fn quantize_groups(
    w: &[f32],
    n: usize,
    k: usize,
    group: usize,
    dtype: DType,
) -> (Vec<i8>, Vec<f32>) {
    let groups = k / group;
    let mut q = vec![0i8; n * k];
    let mut scales = vec![0f32; n * groups];
    for r in 0..n {
        for g in 0..groups {
            let at = r * k + g * group;
            let vals = &w[at..at + group];
            let amax = vals.iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = stored(amax / 7.5, dtype);
            scales[r * groups + g] = s;
            if s > 0.0 {
                for (o, v) in q[at..at + group].iter_mut().zip(vals) {
                    *o = (v / s).round_ties_even().clamp(-8.0, 7.0) as i8;
                }
            }
        }
    }
    (q, scales)
}

/// `q` (n, k) as compressed-tensors' `pack_to_int32` stores it: `+ 8`, eight values a
/// little-endian int32, value `i` of a word in bits `4i..4i + 4`, the last word zero-padded.
fn pack(q: &[i8], n: usize, k: usize) -> Vec<u8> {
    let words = k.div_ceil(8);
    let mut out = vec![0u8; n * words * 4];
    for r in 0..n {
        for (i, &v) in q[r * k..(r + 1) * k].iter().enumerate() {
            let nibble = (v + 8) as u8 & 0xF;
            out[r * words * 4 + i / 2] |= if i % 2 == 0 { nibble } else { nibble << 4 };
        }
    }
    out
}

/// Writes the W4A16 directory `dst` for checkpoint `src`, groups of `group` inputs. Refuses a
/// linear whose input width is not a multiple of `group`, naming it.
pub fn quantize_checkpoint_w4a16(src: &Path, dst: &Path, group: usize) -> Result<()> {
    if group == 0 || !group.is_multiple_of(2) {
        return Err(ModelError::invalid(format!(
            "group size {group}: a positive even number of inputs"
        )));
    }
    rewrite_checkpoint(
        src,
        dst,
        &|_| w4a16_config(group),
        &|prefix, w, n, k, dtype| {
            if !k.is_multiple_of(group) {
                return Err(ModelError::invalid(format!(
                    "{prefix}.weight has {k} inputs, not a multiple of the group size {group} \
                 (choose one that divides every linear's input width)"
                )));
            }
            let (q, scales) = quantize_groups(w, n, k, group, dtype);
            let (sdtype, sdata) = scale_bytes(&scales, dtype);
            let shape: Vec<u8> = [n as i64, k as i64]
                .iter()
                .flat_map(|d| d.to_le_bytes())
                .collect();
            Ok(vec![
                (
                    format!("{prefix}.weight_packed"),
                    Out::owned(Dtype::I32, vec![n, k.div_ceil(8)], pack(&q, n, k)),
                ),
                (
                    format!("{prefix}.weight_scale"),
                    Out::owned(sdtype, vec![n, k / group], sdata),
                ),
                (
                    format!("{prefix}.weight_shape"),
                    Out::owned(Dtype::I64, vec![2], shape),
                ),
            ])
        },
    )
}
