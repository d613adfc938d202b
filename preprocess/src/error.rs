//! Why an image cannot become ViT input. Always the caller's input (or its limits): services
//! answer it as INVALID_ARGUMENT / 400.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid input: {0}")]
pub struct PreprocessError(pub String);

pub type Result<T> = std::result::Result<T, PreprocessError>;

impl PreprocessError {
    pub fn invalid(msg: impl Into<String>) -> Self {
        PreprocessError(msg.into())
    }
}
