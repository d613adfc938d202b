//! The FP8 scheme served: `quant_method: fp8`, `fmt: e4m3` (or absent), dynamic activations,
//! block scales (`weight_block_size: [bn, bk]`, bk even). Anything else is refused at start,
//! naming the key and the value.
use serde_json::Value;

/// The block size `[bn, bk]` when `q` (a config.json's `quantization_config` with
/// `quant_method: fp8`) is the served scheme; else what differs, as a sentence.
pub fn check_quantization_config(q: &Value) -> Result<[usize; 2], String> {
    if let Some(f) = q.get("fmt").filter(|v| !v.is_null()) {
        if f.as_str() != Some("e4m3") {
            return Err(format!(
                "quantization_config.fmt is {f}; served: \"e4m3\" (float8 e4m3fn weights)"
            ));
        }
    }
    let scheme = q.get("activation_scheme").cloned().unwrap_or(Value::Null);
    if scheme != "dynamic" {
        return Err(format!(
            "quantization_config.activation_scheme is {scheme}; served: \"dynamic\" (static \
             activation scales are not)"
        ));
    }
    let block = q.get("weight_block_size").cloned().unwrap_or(Value::Null);
    match serde_json::from_value::<[usize; 2]>(block.clone()) {
        Ok([bn, bk]) if bn > 0 && bk > 0 && bk % 2 == 0 => Ok([bn, bk]),
        _ if block.is_null() => Err(
            "quantization_config.weight_block_size is missing: per-tensor FP8 is not served \
             (block scales, as Qwen's FP8 releases have, are)"
                .into(),
        ),
        _ => Err(format!(
            "quantization_config.weight_block_size is {block}; served: [rows, inputs], both \
             positive, inputs even"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwens_fp8_layout_is_served_and_its_neighbours_are_named() {
        let base = super::super::fp8_config(128, &["lm_head".into()]);
        assert_eq!(check_quantization_config(&base), Ok([128, 128]));
        let refused = |edit: &dyn Fn(&mut Value), words: &[&str]| {
            let mut q = base.clone();
            edit(&mut q);
            let e = check_quantization_config(&q).unwrap_err();
            for w in words {
                assert!(e.contains(w), "{e} lacks {w}");
            }
        };
        refused(&|q| q["fmt"] = "e5m2".into(), &["fmt", "e5m2"]);
        refused(
            &|q| q["activation_scheme"] = "static".into(),
            &["activation_scheme", "static"],
        );
        refused(
            &|q| q["weight_block_size"] = Value::Null,
            &["weight_block_size", "per-tensor"],
        );
        refused(
            &|q| q["weight_block_size"] = serde_json::json!([128, 7]),
            &["weight_block_size", "[128,7]"],
        );
    }
}
