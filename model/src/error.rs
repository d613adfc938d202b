//! The model crate's error: the seam's [`ComputeError`] (what went wrong, in the terms the
//! services map to a status), or a tensor operation that failed. Backends hand it on as a
//! `ComputeError` (tensor-library errors become its `Backend` variant).
use std::path::PathBuf;
use vlm_compute::ComputeError;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Bad input, a bad checkpoint, a KV cache misuse: see [`ComputeError`].
    #[error(transparent)]
    Compute(#[from] ComputeError),
    /// A tensor operation failed.
    #[error("tensor: {0}")]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, ModelError>;

impl ModelError {
    /// The caller's input is invalid (the message names the limit and the value).
    pub fn invalid(msg: impl Into<String>) -> Self {
        ComputeError::InvalidInput(msg.into()).into()
    }
    /// A weight is missing or has the wrong shape (the message names it).
    pub fn weights(msg: impl Into<String>) -> Self {
        ComputeError::Weights(msg.into()).into()
    }
    /// The paged KV cache cannot take the step (a scheduler bug if it happens).
    pub fn kv_cache(msg: impl Into<String>) -> Self {
        ComputeError::KvCache(msg.into()).into()
    }
    /// A checkpoint file is missing or unreadable.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ComputeError::io(path, source).into()
    }
    /// A JSON file of the checkpoint does not parse or is inconsistent.
    pub fn config(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        ComputeError::Config {
            path: path.into(),
            message: message.into(),
        }
        .into()
    }
}

impl From<ModelError> for ComputeError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Compute(c) => c,
            ModelError::Candle(c) => ComputeError::Backend(c.to_string()),
        }
    }
}
