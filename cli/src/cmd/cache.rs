//! Where `vlm` keeps what it derives: the tiny checkpoint, the default config, GGUF pairs' files.
use std::path::PathBuf;

/// `$XDG_CACHE_HOME/vlm`, else `~/.cache/vlm`.
pub fn cache_dir() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(x).join("vlm");
    }
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".cache").join("vlm"),
        None => std::env::temp_dir().join("vlm-cache"),
    }
}
