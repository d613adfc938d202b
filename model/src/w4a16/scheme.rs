//! The compressed-tensors W4A16 scheme served: `format: pack-quantized`, every config group
//! with 4-bit symmetric int weights per group of inputs (`strategy: group`, an even
//! `group_size`, no `actorder`) and no quantized activations -- llm-compressor's `W4A16`
//! preset. Anything else is refused at start, naming the key and the value.
use crate::quant_config::check_extras;
use serde_json::Value;

/// The group size when `q` (a config.json's `quantization_config` with `format:
/// pack-quantized`) is the served scheme; else what differs, as a sentence.
pub fn check_quantization_config(q: &Value) -> Result<usize, String> {
    let format = q.get("format").and_then(Value::as_str).unwrap_or("");
    if format != "pack-quantized" {
        return Err(format!(
            "quantization_config.format `{format}` is not W4A16 (`pack-quantized`)"
        ));
    }
    let groups = check_extras(q)?;
    let mut size = None;
    for (name, g) in groups {
        let at = format!("quantization_config.config_groups.{name}");
        let w = g
            .get("weights")
            .filter(|v| v.is_object())
            .ok_or_else(|| format!("{at} has no weights"))?;
        let field = |k: &str| w.get(k).cloned().unwrap_or(Value::Null);
        let want = [
            ("num_bits", Value::from(4)),
            ("type", Value::from("int")),
            ("symmetric", Value::from(true)),
            ("strategy", Value::from("group")),
        ];
        for (k, v) in want {
            if field(k) != v {
                return Err(format!(
                    "{at}.weights.{k} is {}; served: {v} (4-bit symmetric int, per group)",
                    field(k)
                ));
            }
        }
        if field("dynamic").as_bool().unwrap_or(false) {
            return Err(format!("{at}.weights.dynamic is true; served: false"));
        }
        if let Some(a) = w.get("actorder").filter(|v| !v.is_null()) {
            return Err(format!(
                "{at}.weights.actorder is {a}; served: null (groups in file order, no \
                 weight_g_idx)"
            ));
        }
        let g_size = field("group_size")
            .as_u64()
            .filter(|&s| s > 0 && s % 2 == 0)
            .ok_or_else(|| {
                format!(
                    "{at}.weights.group_size is {}; served: a positive even size",
                    field("group_size")
                )
            })? as usize;
        if size.is_some_and(|s| s != g_size) {
            return Err(format!(
                "{at}.weights.group_size is {g_size}, another group's is {}; served: one size",
                size.unwrap_or(0)
            ));
        }
        size = Some(g_size);
        if let Some(a) = g.get("input_activations").filter(|v| !v.is_null()) {
            return Err(format!(
                "{at}.input_activations {a} is not served (W4A16: activations in floats)"
            ));
        }
        if let Some(o) = g.get("output_activations").filter(|v| !v.is_null()) {
            return Err(format!("{at}.output_activations {o} is not served"));
        }
    }
    size.ok_or_else(|| "quantization_config has no config_groups".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_w4a16_preset_is_served_and_its_neighbours_are_named() {
        let base = super::super::w4a16_config(128);
        assert_eq!(check_quantization_config(&base), Ok(128));
        let refused = |edit: &dyn Fn(&mut Value), words: &[&str]| {
            let mut q = base.clone();
            edit(&mut q);
            let e = check_quantization_config(&q).unwrap_err();
            for w in words {
                assert!(e.contains(w), "{e} lacks {w}");
            }
        };
        let w = |q: &mut Value| q["config_groups"]["group_0"]["weights"].take();
        let set = |k: &'static str, v: Value| {
            move |q: &mut Value| {
                let mut ws = w(q);
                ws[k] = v.clone();
                q["config_groups"]["group_0"]["weights"] = ws;
            }
        };
        refused(&set("symmetric", false.into()), &["weights.symmetric"]);
        refused(&set("num_bits", 8.into()), &["weights.num_bits", "8"]);
        refused(&set("strategy", "channel".into()), &["weights.strategy"]);
        refused(&set("actorder", "group".into()), &["actorder", "g_idx"]);
        refused(&set("group_size", 7.into()), &["group_size", "7"]);
        refused(
            &|q| {
                q["config_groups"]["group_0"]["input_activations"] =
                    serde_json::json!({"num_bits": 8})
            },
            &["input_activations"],
        );
        refused(
            &|q| q["kv_cache_scheme"] = serde_json::json!({"num_bits": 8}),
            &["kv_cache_scheme"],
        );
    }
}
