//! Logging and tracing setup: `RUST_LOG` filters (default `info`), `VLM_LOG_FORMAT=json` for
//! structured logs.

/// Installs the global subscriber for `service` (idempotent: a second call is a no-op).
pub fn init(service: &'static str) {
    use tracing_subscriber::{fmt, EnvFilter};
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("VLM_LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    let result = if json {
        fmt().with_env_filter(filter).json().with_current_span(true).try_init()
    } else {
        fmt().with_env_filter(filter).with_target(false).try_init()
    };
    if result.is_ok() {
        tracing::debug!(service, "logging initialised");
    }
}
