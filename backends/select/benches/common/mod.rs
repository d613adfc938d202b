//! What the benches of this crate share: their `--name value` arguments.

/// The value after `name` in `args`, or `default`.
pub fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_string())
}

/// The checkpoint a bench runs: `$VLM_BENCH_MODEL`, else the tiny test fixture.
pub fn bench_model() -> std::path::PathBuf {
    std::env::var_os("VLM_BENCH_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny")
        })
}
