//! One violating config per rule; each message must name the key (and the limit).
use vlm_config::{ConfigError, DeployConfig};

fn err(json: &str) -> ConfigError {
    DeployConfig::from_json(json).expect_err(json)
}

fn assert_names(json: &str, key: &str, also: &[&str]) {
    let e = err(json);
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("`{key}`")),
        "message does not name `{key}`: {msg}"
    );
    for s in also {
        assert!(msg.contains(s), "message lacks {s:?}: {msg}");
    }
}

#[test]
fn batch_size_under_visual_is_an_error() {
    assert_names(
        r#"{"visual": {"batch_size": 2}, "batch_size": 2}"#,
        "visual.batch_size",
        &["top-level"],
    );
}

#[test]
fn num_devices_must_match_device_list() {
    assert_names(
        r#"{"num_devices": 2, "device": [0, 1, 2]}"#,
        "num_devices",
        &["3"],
    );
    assert_names(
        r#"{"visual": {"tensor_parallel_size": 8, "device": [0]}}"#,
        "visual.num_devices",
        &["8", "1"],
    );
}

#[test]
fn decoder_batch_sizes_rules() {
    assert_names(
        r#"{"batch_size": 4, "decoder_batch_sizes": [1, 8]}"#,
        "decoder_batch_sizes",
        &["batch_size (4)"],
    );
    assert_names(
        r#"{"batch_size": 4, "decoder_batch_sizes": [2]}"#,
        "decoder_batch_sizes",
        &["single"],
    );
    assert_names(
        r#"{"batch_size": 4, "decoder_batch_sizes": [0, 4]}"#,
        "decoder_batch_sizes",
        &["between 1"],
    );
    // A largest value below batch_size is appended, with a warning.
    let l =
        DeployConfig::from_json(r#"{"batch_size": 8, "decoder_batch_sizes": [1, 2, 4]}"#).unwrap();
    assert_eq!(l.config.decoder_batch_sizes, vec![1, 2, 4, 8]);
    assert!(
        l.warnings.iter().any(|w| w.contains("appending 8")),
        "{:?}",
        l.warnings
    );
}

#[test]
fn max_seq_len_partition_rules() {
    assert_names(
        r#"{"max_seq_len": 5000, "kvcache_partition_len": 1024}"#,
        "max_seq_len",
        &["multiple", "1024"],
    );
    assert_names(
        r#"{"max_seq_len": 1024, "kvcache_partition_len": 1024}"#,
        "max_seq_len",
        &["two"],
    );
}

#[test]
fn vit_buckets_are_multiples_of_four() {
    assert_names(
        r#"{"visual": {"max_seq_len": [1024, 1030]}}"#,
        "visual.max_seq_len",
        &["1030", "multiple of 4"],
    );
    assert_names(
        r#"{"visual": {"max_seq_lens": 0}}"#,
        "visual.max_seq_len",
        &["multiple of 4"],
    );
    let l = DeployConfig::from_json(r#"{"visual": {"max_seq_lens": 2048}}"#).unwrap();
    assert_eq!(l.config.visual.max_seq_len, vec![2048]);
}

#[test]
fn prefill_chunk_is_a_positive_multiple_of_64() {
    assert_names(
        r#"{"prefill_chunk_size": 100}"#,
        "prefill_chunk_size",
        &["64"],
    );
    assert_names(
        r#"{"prefill_chunk_size": 0}"#,
        "prefill_chunk_size",
        &["64"],
    );
}

#[test]
fn kvcache_num_blocks_holds_one_sequence() {
    assert_names(
        r#"{"max_seq_len": 8192, "kvcache_partition_len": 1024, "kvcache_num_blocks": 4}"#,
        "kvcache_num_blocks",
        &["8 blocks"],
    );
    let l = DeployConfig::from_json(r#"{"max_seq_len": 8192, "kvcache_partition_len": 1024, "kvcache_num_blocks": 8, "batch_size": 2}"#).unwrap();
    assert!(
        l.warnings.iter().any(|w| w.contains("preempted")),
        "{:?}",
        l.warnings
    );
}

#[test]
fn create_runtimes_is_a_bool() {
    assert_names(
        r#"{"create_runtimes": "no"}"#,
        "create_runtimes",
        &["true or false"],
    );
    assert_names(
        r#"{"visual": {"create_runtimes": 0}}"#,
        "visual.create_runtimes",
        &["true or false"],
    );
}

#[test]
fn unknown_keys_suggest_the_nearest() {
    let e = err(r#"{"max_seq_lne": 8192}"#);
    assert_eq!(e.key(), Some("max_seq_lne"));
    assert!(e.to_string().contains("did you mean `max_seq_len`"), "{e}");
    let e = err(r#"{"visual": {"devices": [0]}}"#);
    assert!(
        e.to_string().contains("did you mean `visual.device`"),
        "{e}"
    );
    let e = err(r#"{"frobnicate": 1}"#);
    assert!(e.to_string().contains("unknown key `frobnicate`"), "{e}");
}

#[test]
fn both_spellings_at_once_is_an_error() {
    assert_names(
        r#"{"num_devices": 1, "tensor_parallel_size": 1}"#,
        "tensor_parallel_size",
        &["twice"],
    );
}

#[test]
fn value_types_and_enums() {
    assert_names(r#"{"batch_size": "eight"}"#, "batch_size", &["integer"]);
    assert_names(r#"{"batch_size": 0}"#, "batch_size", &[">= 1"]);
    assert_names(
        r#"{"visual": {"oversize": "crop"}}"#,
        "visual.oversize",
        &["downscale"],
    );
    assert_names(r#"{"dtype": "f64"}"#, "dtype", &["bf16"]);
    assert_names(
        r#"{"visual": {"min_pixels": 100, "max_pixels": 10}}"#,
        "visual.min_pixels",
        &["max_pixels"],
    );
    assert_names(r#"{"visual": 3}"#, "visual", &["mapping"]);
}

#[test]
fn defaults_are_valid() {
    let c = DeployConfig::default_config();
    assert_eq!(c.visual.max_seq_len, vec![1024, 4096, 16384]);
    assert_eq!(c.decoder_batch_sizes, vec![c.batch_size]);
    assert_eq!(c.prefill_chunk_size, 128);
}

#[test]
fn prefix_caching_is_on_by_default_and_a_bool() {
    let on = vlm_config::DeployConfig::from_json("{}").unwrap().config;
    assert!(on.prefix_caching);
    let off = vlm_config::DeployConfig::from_json(r#"{"prefix_caching": false}"#)
        .unwrap()
        .config;
    assert!(!off.prefix_caching);
    let err = vlm_config::DeployConfig::from_json(r#"{"prefix_caching": "yes"}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("prefix_caching"), "{err}");
    let err = vlm_config::DeployConfig::from_json(r#"{"visual": {"prefix_caching": true}}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("prefix_caching"), "{err}");
}

#[test]
fn kv_cache_dtype_is_auto_by_default_and_takes_vllm_s_fp8_names() {
    use vlm_config::{DeployConfig, KvCacheDtype};
    let c = |json: &str| DeployConfig::from_json(json).map(|c| c.config.kv_cache_dtype);
    assert_eq!(c("{}").unwrap(), KvCacheDtype::Auto);
    for name in ["fp8", "fp8_e4m3", "FP8_E4M3"] {
        let json = format!(r#"{{"kv_cache_dtype": "{name}"}}"#);
        assert_eq!(c(&json).unwrap(), KvCacheDtype::Fp8E4m3, "{name}");
    }
    // Written out under its canonical name, and read back the same.
    let cfg = DeployConfig::from_json(r#"{"kv_cache_dtype": "fp8"}"#)
        .unwrap()
        .config;
    let doc = cfg.to_document();
    assert_eq!(doc["kv_cache_dtype"], "fp8_e4m3");
    assert_eq!(c(&doc.to_string()).unwrap(), KvCacheDtype::Fp8E4m3);
    // What vLLM also names but this server does not hold is refused, naming the choices.
    for bad in [r#""fp8_e5m2""#, r#""int8""#, "8"] {
        let err = c(&format!(r#"{{"kv_cache_dtype": {bad}}}"#))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("kv_cache_dtype") && err.contains("fp8_e4m3"),
            "{err}"
        );
    }
}
