//! What can go wrong loading a checkpoint's tokenizer or rendering and encoding a prompt.
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A tokenizer file of the checkpoint is missing or unreadable.
    #[error("checkpoint file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file of the checkpoint does not parse.
    #[error("checkpoint config {path}: {message}")]
    Config { path: PathBuf, message: String },
    /// The tokenizer or the chat template failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The text encodes to more than `limit` tokens (`at_least`: a lower bound on its count,
    /// from its byte length or the tokens counted before encoding stopped).
    #[error("prompt is at least {at_least} tokens, over the limit of {limit}")]
    TooLong { at_least: usize, limit: usize },
    /// The caller's input is invalid (the message names the limit and the value).
    #[error("invalid input: {0}")]
    InvalidInput(String),
}

pub type Result<T> = std::result::Result<T, TokenizerError>;

impl TokenizerError {
    pub fn invalid(msg: impl Into<String>) -> Self {
        TokenizerError::InvalidInput(msg.into())
    }
    /// A `TooLong` with `extra` tokens (counted elsewhere, e.g. images) added to both sides.
    pub(crate) fn plus(self, extra: usize) -> Self {
        match self {
            TokenizerError::TooLong { at_least, limit } => TokenizerError::TooLong {
                at_least: at_least.saturating_add(extra),
                limit: limit.saturating_add(extra),
            },
            e => e,
        }
    }
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        TokenizerError::Io {
            path: path.into(),
            source,
        }
    }
}

/// A failure of the `tokenizers` library or of the template engine, with what was being done.
pub(crate) fn tok_err(context: &str, e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Tokenizer(format!("{context}: {e}"))
}
