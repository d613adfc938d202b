//! Reading a config document from JSON, YAML or TOML into a generic value.
use crate::error::ConfigError;
use serde_json::Value;
use std::path::Path;

/// The syntax of a config document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Json,
    Yaml,
    Toml,
}

impl Format {
    /// By file extension; anything else is tried as YAML (a superset of JSON).
    pub fn from_path(path: &Path) -> Format {
        match path
            .extension()
            .and_then(|e| e.to_str())
            .map(|e| e.to_ascii_lowercase())
            .as_deref()
        {
            Some("json") => Format::Json,
            Some("toml") => Format::Toml,
            _ => Format::Yaml,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Format::Json => "JSON",
            Format::Yaml => "YAML",
            Format::Toml => "TOML",
        }
    }
}

/// Parses `text` as `format`. `origin` names the source in messages.
pub fn parse_document(text: &str, format: Format, origin: &str) -> Result<Value, ConfigError> {
    let err = |message: String| ConfigError::Parse {
        path: origin.to_string(),
        format: format.name(),
        message,
    };
    match format {
        Format::Json => serde_json::from_str(text).map_err(|e| err(e.to_string())),
        Format::Yaml => {
            let v: serde_yaml::Value =
                serde_yaml::from_str(text).map_err(|e| err(e.to_string()))?;
            serde_json::to_value(v).map_err(|e| err(e.to_string()))
        }
        Format::Toml => {
            let v: toml::Value = toml::from_str(text).map_err(|e| err(e.to_string()))?;
            serde_json::to_value(v).map_err(|e| err(e.to_string()))
        }
    }
}

/// Reads and parses a config file.
pub fn read_document(path: &Path) -> Result<Value, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    parse_document(&text, Format::from_path(path), &path.display().to_string())
}
