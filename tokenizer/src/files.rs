//! A checkpoint's tokenizer files: JSON read when present, token settings, the chat template.
use crate::error::{Result, TokenizerError};
use serde_json::Value;
use std::path::Path;

pub(crate) fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| TokenizerError::io(path, e))?;
    let value = serde_json::from_str(&text).map_err(|e| TokenizerError::Config {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    Ok(Some(value))
}

/// A token in tokenizer_config.json: a string, or an AddedToken object with "content".
pub(crate) fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    }
}

pub(crate) fn id_list(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|n| n.as_u64())
            .map(|n| n as u32)
            .collect(),
        _ => Vec::new(),
    }
}

/// The chat template text: chat_template.jinja, tokenizer_config's chat_template (a string,
/// or a list of {name, template} from which "default" is taken), chat_template.json.
pub(crate) fn find_template(
    dir: &Path,
    tokenizer_config: Option<&Value>,
) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        return std::fs::read_to_string(&jinja)
            .map(Some)
            .map_err(|e| TokenizerError::io(&jinja, e));
    }
    let from_value = |v: &Value| -> Option<String> {
        match v {
            Value::String(s) => Some(s.clone()),
            Value::Array(list) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .or(list.first())
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_string),
            _ => None,
        }
    };
    if let Some(t) = tokenizer_config
        .and_then(|c| c.get("chat_template"))
        .and_then(from_value)
    {
        return Ok(Some(t));
    }
    if let Some(v) = read_json(&dir.join("chat_template.json"))? {
        if let Some(t) = v.get("chat_template").and_then(from_value) {
            return Ok(Some(t));
        }
    }
    Ok(None)
}
