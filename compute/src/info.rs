//! What a backend says about itself: logged at start and reported by `Lm.Info` / `Vision.Info`.

/// A loaded backend's identity and its kernel choices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendInfo {
    /// `cpu`, `candle`, ...
    pub backend: &'static str,
    /// Where it runs, in words (`cpu cores [0, 1]`, `cuda:0`).
    pub device: String,
    /// Weight storage dtype.
    pub dtype: crate::HostDtype,
    /// Each kernel choice as (what, which): `("linear", "amx-bf16")`, `("attention", ...)`.
    pub kernels: Vec<(String, String)>,
}

impl BackendInfo {
    /// `what=which` pairs joined by spaces, for one log line.
    pub fn kernels_line(&self) -> String {
        self.kernels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}
