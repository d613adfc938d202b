//! The Jinja environment, configured like transformers' chat-template environment.
use crate::error::{tok_err, Result};
use minijinja::value::{Kwargs, Value as JinjaValue, ValueKind};
use minijinja::{Environment, ErrorKind};

/// A Jinja environment configured like transformers' chat-template environment.
pub(crate) fn template_env(template: Option<String>) -> Result<Environment<'static>> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| tok_err("chat template syntax", e))?;
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<JinjaValue, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_filter("tojson", tojson);
    if let Some(t) = template {
        env.add_template_owned("chat", t)
            .map_err(|e| tok_err("chat template does not parse", e))?;
    }
    Ok(env)
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)`, as transformers' `tojson`
/// (no HTML escaping, `", "` and `": "` separators).
pub(crate) fn tojson(
    value: &JinjaValue,
    kwargs: Kwargs,
) -> std::result::Result<JinjaValue, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, indent, 0)?;
    Ok(JinjaValue::from_safe_string(out))
}

pub(crate) fn write_json(
    out: &mut String,
    v: &JinjaValue,
    indent: Option<usize>,
    depth: usize,
) -> std::result::Result<(), minijinja::Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64() {
                out.push_str(&i.to_string());
            } else {
                let f = f64::try_from(v.clone())?;
                out.push_str(&serde_json::to_string(&f).unwrap_or_else(|_| "NaN".into()));
            }
        }
        ValueKind::String => {
            out.push_str(&serde_json::to_string(v.as_str().unwrap_or("")).unwrap_or_default())
        }
        ValueKind::Map => {
            out.push('{');
            let mut first = true;
            for key in v.try_iter()? {
                if !first {
                    out.push_str(sep);
                }
                first = false;
                newline(out, depth + 1);
                let k = key
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| key.to_string());
                out.push_str(&serde_json::to_string(&k).unwrap_or_default());
                out.push_str(": ");
                write_json(out, &v.get_item(&key)?, indent, depth + 1)?;
            }
            if !first {
                newline(out, depth);
            }
            out.push('}');
        }
        _ => {
            out.push('[');
            let mut first = true;
            for item in v.try_iter()? {
                if !first {
                    out.push_str(sep);
                }
                first = false;
                newline(out, depth + 1);
                write_json(out, &item, indent, depth + 1)?;
            }
            if !first {
                newline(out, depth);
            }
            out.push(']');
        }
    }
    Ok(())
}
