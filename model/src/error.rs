//! The model crate's error type; backends hand it to the services as the seam's
//! [`ComputeError`] (tensor-library errors become its `Backend` variant).
use std::path::PathBuf;
use vlm_compute::ComputeError;

/// Everything that can go wrong in loading or running the model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file of the checkpoint is missing or unreadable.
    #[error("checkpoint file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file of the checkpoint does not parse or is inconsistent.
    #[error("checkpoint config {path}: {message}")]
    Config { path: PathBuf, message: String },
    /// A weight is missing or has the wrong shape (the message names it).
    #[error("weights: {0}")]
    Weights(String),
    /// The caller's input is invalid (bad image, too many patches, ids that do not match the
    /// image grids, ...). The message names the limit and the value.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// The paged KV cache has no room (a scheduler bug if it happens: it must check first).
    #[error("kv cache: {0}")]
    KvCache(String),
    /// From the seam's host-side code (config.json, rope index, host tensors).
    #[error(transparent)]
    Compute(#[from] ComputeError),
    /// A tensor operation failed.
    #[error("tensor: {0}")]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, ModelError>;

impl ModelError {
    pub fn invalid(msg: impl Into<String>) -> Self {
        ModelError::InvalidInput(msg.into())
    }
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }
}

impl From<ModelError> for ComputeError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Io { path, source } => ComputeError::Io { path, source },
            ModelError::Config { path, message } => ComputeError::Config { path, message },
            ModelError::Weights(m) => ComputeError::Weights(m),
            ModelError::InvalidInput(m) => ComputeError::InvalidInput(m),
            ModelError::KvCache(m) => ComputeError::KvCache(m),
            ModelError::Compute(c) => c,
            ModelError::Candle(c) => ComputeError::Backend(c.to_string()),
        }
    }
}
