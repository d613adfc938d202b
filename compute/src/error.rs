//! The seam's error: what a backend or the host-side model code reports to a service. No tensor
//! library's error type crosses it; backends convert theirs (see `Backend`).
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ComputeError {
    /// A file of the checkpoint is missing or unreadable.
    #[error("checkpoint file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `config.json` (or another JSON file of the checkpoint) does not parse or is inconsistent.
    #[error("checkpoint config {path}: {message}")]
    Config { path: PathBuf, message: String },
    /// A weight is missing or has the wrong shape (the message names it).
    #[error("weights: {0}")]
    Weights(String),
    /// The caller's input is invalid (bad image, too many patches, ids that do not match the
    /// image grids, ...). The message names the limit and the value.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// The tokenizer files of the checkpoint are unusable (random checkpoints write them).
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The paged KV cache has no room or a block table is wrong (a scheduler bug if it happens).
    #[error("kv cache: {0}")]
    KvCache(String),
    /// A backend option cannot be honoured on this machine or with this model (e.g. `amx: on`
    /// on a CPU without AMX); the message names the option, the value and why.
    #[error("backend options: {0}")]
    Options(String),
    /// The backend failed while computing (its tensor library's message).
    #[error("compute: {0}")]
    Backend(String),
}

pub type Result<T> = std::result::Result<T, ComputeError>;

impl ComputeError {
    pub fn invalid(msg: impl Into<String>) -> Self {
        ComputeError::InvalidInput(msg.into())
    }
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ComputeError::Io {
            path: path.into(),
            source,
        }
    }
    pub fn options(msg: impl Into<String>) -> Self {
        ComputeError::Options(msg.into())
    }
}
