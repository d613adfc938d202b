//! The one compressed-tensors scheme served: `format: int-quantized`, every config group with
//! 8-bit symmetric int weights per channel (`strategy: channel`) and 8-bit symmetric int
//! activations per token, dynamic (`strategy: token`, `dynamic: true`) -- llm-compressor's
//! `W8A8` preset. Anything else is refused at start, naming the key and the value.
use crate::quant_config::check_extras;
use serde_json::Value;

/// `Ok` when `q` (a config.json's `quantization_config` with `quant_method:
/// compressed-tensors`) is the served scheme; else what differs, as a sentence.
pub fn check_quantization_config(q: &Value) -> Result<(), String> {
    let format = q.get("format").and_then(Value::as_str).unwrap_or("");
    if format != "int-quantized" {
        return Err(format!(
            "quantization_config.format `{format}` is not served (compressed-tensors \
             `int-quantized` W8A8 is)"
        ));
    }
    let groups = check_extras(q)?;
    for (name, g) in groups {
        let at = format!("quantization_config.config_groups.{name}");
        check_args(&at, "weights", g.get("weights"), "channel", false)?;
        match g.get("input_activations").filter(|v| !v.is_null()) {
            Some(a) => check_args(&at, "input_activations", Some(a), "token", true)?,
            None => {
                return Err(format!(
                    "{at} has no input_activations: weight-only int8 (W8A16) is not served, \
                     W8A8 is"
                ))
            }
        }
        if let Some(o) = g.get("output_activations").filter(|v| !v.is_null()) {
            return Err(format!("{at}.output_activations {o} is not served"));
        }
    }
    Ok(())
}

fn check_args(
    at: &str,
    what: &str,
    args: Option<&Value>,
    strategy: &str,
    dynamic: bool,
) -> Result<(), String> {
    let a = args
        .filter(|v| v.is_object())
        .ok_or_else(|| format!("{at} has no {what}"))?;
    let field = |k: &str| a.get(k).cloned().unwrap_or(Value::Null);
    let want = [
        ("num_bits", Value::from(8)),
        ("type", Value::from("int")),
        ("symmetric", Value::from(true)),
        ("strategy", Value::from(strategy)),
    ];
    for (k, v) in want {
        if field(k) != v {
            return Err(format!(
                "{at}.{what}.{k} is {}; served: {v} (8-bit symmetric int, per {strategy})",
                field(k)
            ));
        }
    }
    if field("dynamic").as_bool().unwrap_or(false) != dynamic {
        return Err(format!(
            "{at}.{what}.dynamic is {}; served: {dynamic}",
            field("dynamic")
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn w8a8() -> Value {
        json!({
            "quant_method": "compressed-tensors",
            "format": "int-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "int", "symmetric": true,
                            "strategy": "channel", "dynamic": false},
                "input_activations": {"num_bits": 8, "type": "int", "symmetric": true,
                                      "strategy": "token", "dynamic": true},
                "output_activations": null
            }},
            "ignore": ["lm_head"],
            "kv_cache_scheme": null,
            "sparsity_config": {}
        })
    }

    #[test]
    fn the_w8a8_preset_is_served_and_its_neighbours_are_named() {
        assert_eq!(check_quantization_config(&w8a8()), Ok(()));
        let refused = |edit: &dyn Fn(&mut Value), words: &[&str]| {
            let mut q = w8a8();
            edit(&mut q);
            let e = check_quantization_config(&q).unwrap_err();
            for w in words {
                assert!(e.contains(w), "{e} lacks {w}");
            }
        };
        refused(
            &|q| q["format"] = "pack-quantized".into(),
            &["format", "pack-quantized"],
        );
        refused(
            &|q| q["config_groups"]["group_0"]["weights"]["strategy"] = "group".into(),
            &["weights.strategy", "group"],
        );
        refused(
            &|q| q["config_groups"]["group_0"]["weights"]["num_bits"] = 4.into(),
            &["weights.num_bits", "4"],
        );
        refused(
            &|q| q["config_groups"]["group_0"]["input_activations"]["symmetric"] = false.into(),
            &["input_activations.symmetric"],
        );
        refused(
            &|q| q["config_groups"]["group_0"]["input_activations"]["dynamic"] = false.into(),
            &["input_activations.dynamic", "false"],
        );
        refused(
            &|q| q["config_groups"]["group_0"]["input_activations"] = Value::Null,
            &["W8A16"],
        );
        refused(
            &|q| q["kv_cache_scheme"] = json!({"num_bits": 8}),
            &["kv_cache_scheme"],
        );
    }
}
