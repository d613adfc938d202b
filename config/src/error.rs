//! Errors of the deployment config. Every message names the key (as a dotted path), the value
//! found and what would be valid.

/// A config that cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {message}")]
    Read { path: String, message: String },
    /// The file is not valid JSON, YAML or TOML.
    #[error("cannot parse config file {path} as {format}: {message}")]
    Parse {
        path: String,
        format: &'static str,
        message: String,
    },
    /// A key that no rule knows.
    #[error("unknown key `{key}`{}", suggestion.as_ref().map(|s| format!("; did you mean `{s}`?")).unwrap_or_default())]
    UnknownKey {
        key: String,
        suggestion: Option<String>,
    },
    /// A value of the wrong type or outside its range, or a broken cross-field rule.
    #[error("`{key}` = {value}: {message}")]
    Invalid {
        key: String,
        value: String,
        message: String,
    },
}

impl ConfigError {
    pub(crate) fn invalid(
        key: &str,
        value: impl std::fmt::Display,
        message: impl Into<String>,
    ) -> Self {
        ConfigError::Invalid {
            key: key.to_string(),
            value: value.to_string(),
            message: message.into(),
        }
    }

    /// The dotted key the error is about, when there is one.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::UnknownKey { key, .. } | ConfigError::Invalid { key, .. } => Some(key),
            _ => None,
        }
    }
}

/// Why no ViT bucket or decoder graph fits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BucketError {
    #[error(
        "image has {patches} patches (16-px, after resize), over the largest ViT bucket of {largest} \
         (visual.max_seq_len {buckets:?}); send a smaller image, add a larger bucket, or set \
         visual.oversize = \"downscale\""
    )]
    OverLargestVitBucket {
        patches: u64,
        largest: u32,
        buckets: Vec<u32>,
    },
    #[error("active batch {active} is over batch_size {batch_size}")]
    OverBatchSize { active: u32, batch_size: u32 },
    #[error("active batch must be at least 1")]
    EmptyBatch,
}
