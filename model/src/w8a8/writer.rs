//! `vlm quantize --scheme w8a8`: a float Qwen3-VL checkpoint -> a compressed-tensors
//! `int-quantized` directory as llm-compressor's `W8A8` preset with round-to-nearest writes it
//! (what vLLM loads as `CompressedTensorsW8A8Int8`): the LM's linear weights int8 with one
//! symmetric scale per output channel, everything else (head, embeddings, norms, the vision
//! tower) as it was; the other files copied.
use crate::error::Result;
use crate::quant_writer::{rewrite_checkpoint, scale_bytes, stored, Out};
use candle_core::DType;
use safetensors::Dtype;
use std::path::Path;

/// The `quantization_config` llm-compressor writes for its `W8A8` preset (minmax observer,
/// the head and the vision tower ignored).
pub fn w8a8_config() -> serde_json::Value {
    let args = |strategy: &str, dynamic: bool, observer: serde_json::Value| {
        serde_json::json!({
            "num_bits": 8, "type": "int", "symmetric": true, "strategy": strategy,
            "dynamic": dynamic, "group_size": null, "block_structure": null, "actorder": null,
            "observer": observer, "observer_kwargs": {}
        })
    };
    serde_json::json!({
        "quant_method": crate::quant_config::COMPRESSED_TENSORS,
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": args("channel", false, "minmax".into()),
            "input_activations": args("token", true, serde_json::Value::Null),
            "output_activations": null
        }},
        "ignore": ["re:.*lm_head", "re:.*visual.*"],
        "kv_cache_scheme": null,
        "sparsity_config": {},
        "global_compression_ratio": null
    })
}

/// Row-wise round-to-nearest of `w` (n, k): `scale = max|row| / 127`, stored in `dtype` (the
/// checkpoint's), and `q = clamp(round_half_even(w / stored scale), -128, 127)`, so that `q *
/// scale` is the weight the reference and the kernels multiply by.
pub fn quantize_rows(w: &[f32], n: usize, k: usize, dtype: DType) -> (Vec<i8>, Vec<f32>) {
    let mut q = vec![0i8; n * k];
    let mut scales = vec![0f32; n];
    for r in 0..n {
        let row = &w[r * k..(r + 1) * k];
        let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = stored(amax / 127.0, dtype);
        scales[r] = s;
        if s > 0.0 {
            for (o, v) in q[r * k..(r + 1) * k].iter_mut().zip(row) {
                *o = (v / s).round_ties_even().clamp(-128.0, 127.0) as i8;
            }
        }
    }
    (q, scales)
}

/// Writes the W8A8 directory `dst` for checkpoint `src`.
pub fn quantize_checkpoint_w8a8(src: &Path, dst: &Path) -> Result<()> {
    rewrite_checkpoint(src, dst, &|_| w8a8_config(), &|prefix, w, n, k, dtype| {
        let (q, scales) = quantize_rows(w, n, k, dtype);
        let (sdtype, sdata) = scale_bytes(&scales, dtype);
        Ok(vec![
            (
                format!("{prefix}.weight_scale"),
                Out::owned(sdtype, vec![n, 1], sdata),
            ),
            (
                format!("{prefix}.weight"),
                Out::owned(
                    Dtype::I8,
                    vec![n, k],
                    q.into_iter().map(|v| v as u8).collect(),
                ),
            ),
        ])
    })
}
