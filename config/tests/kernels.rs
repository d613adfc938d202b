//! The `kernels` sections (top level = LM, `visual.kernels` = ViT): parsing from every format,
//! defaults, the normalized JSON, and one error per rule naming the key, the value and what
//! would be valid.
use vlm_config::{BackendChoice, ConfigError, DeployConfig, Format, KernelConfig, Toggle};

fn err(json: &str) -> ConfigError {
    DeployConfig::from_json(json).expect_err(json)
}

/// The error names `key` (as the message's `key`), and contains each of `also`.
fn assert_names(json: &str, key: &str, also: &[&str]) {
    let e = err(json);
    assert_eq!(e.key(), Some(key), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("`{key}`")),
        "does not name `{key}`: {msg}"
    );
    for s in also {
        assert!(msg.contains(s), "message lacks {s:?}: {msg}");
    }
}

fn lm_and_vit(text: &str, format: Format) -> (KernelConfig, KernelConfig) {
    let c = DeployConfig::from_str_as(text, format)
        .unwrap_or_else(|e| panic!("{format:?}: {e}"))
        .config;
    (c.kernels, c.visual.kernels)
}

fn expected() -> (KernelConfig, KernelConfig) {
    let lm = KernelConfig {
        backend: BackendChoice::Cpu,
        bf16_dot: Toggle::On,
        amx: Toggle::Off,
        simd: Toggle::Off,
        ..KernelConfig::default()
    };
    let vit = KernelConfig {
        backend: BackendChoice::Candle,
        bf16_dot: Toggle::Off,
        amx: Toggle::On,
        simd: Toggle::Auto,
        attention_tiles: [128, 1024],
        profile: true,
    };
    (lm, vit)
}

#[test]
fn parses_from_yaml_json_and_toml() {
    let yaml = r#"
kernels:
  backend: cpu
  bf16_dot: on
  amx: off
  simd: off
visual:
  kernels:
    backend: candle
    bf16_dot: off
    amx: on
    attention_tiles: [128, 1024]
    profile: true
"#;
    let json = r#"{
        "kernels": {"backend": "cpu", "bf16_dot": "on", "amx": "off", "simd": "off"},
        "visual": {"kernels": {"backend": "candle", "bf16_dot": "off", "amx": "on",
                               "attention_tiles": [128, 1024], "profile": true}}
    }"#;
    let toml = r#"
[kernels]
backend = "cpu"
bf16_dot = "on"
amx = "off"
simd = "off"

[visual.kernels]
backend = "candle"
bf16_dot = "off"
amx = "on"
attention_tiles = [128, 1024]
profile = true
"#;
    assert_eq!(lm_and_vit(yaml, Format::Yaml), expected());
    assert_eq!(lm_and_vit(json, Format::Json), expected());
    assert_eq!(lm_and_vit(toml, Format::Toml), expected());
}

#[test]
fn defaults_when_absent_or_empty() {
    let d = KernelConfig::default();
    assert_eq!(
        d,
        KernelConfig {
            backend: BackendChoice::Auto,
            bf16_dot: Toggle::Auto,
            amx: Toggle::Auto,
            simd: Toggle::Auto,
            attention_tiles: [256, 512],
            profile: false,
        }
    );
    let c = DeployConfig::default_config();
    assert_eq!((c.kernels, c.visual.kernels), (d, d));
    let c = DeployConfig::from_json(r#"{"kernels": {}, "visual": {"kernels": {}}}"#)
        .unwrap()
        .config;
    assert_eq!((c.kernels, c.visual.kernels), (d, d));
    // One key set; the others keep their defaults. Choices are case-insensitive, as dtype is.
    let c = DeployConfig::from_json(r#"{"visual": {"kernels": {"amx": "OFF"}}}"#)
        .unwrap()
        .config;
    assert_eq!(
        c.visual.kernels,
        KernelConfig {
            amx: Toggle::Off,
            ..d
        }
    );
    assert_eq!(c.kernels, d);
}

#[test]
fn normalized_json_lists_both_sections_in_lowercase_and_reads_back() {
    let c = DeployConfig::from_json(
        r#"{"kernels": {"backend": "candle"}, "visual": {"kernels": {"profile": true}}}"#,
    )
    .unwrap()
    .config;
    let v = c.to_document();
    // The top level writes only its own keys: the ViT-only ones would not read back there.
    assert_eq!(
        v["kernels"],
        serde_json::json!({"backend": "candle", "bf16_dot": "auto", "amx": "auto",
                           "simd": "auto"})
    );
    assert_eq!(
        v["visual"]["kernels"],
        serde_json::json!({"backend": "auto", "bf16_dot": "auto", "amx": "auto",
                           "simd": "auto", "attention_tiles": [256, 512], "profile": true})
    );
    assert_eq!(DeployConfig::from_value(&v).unwrap().config, c);
}

#[test]
fn choices_outside_their_set_are_errors() {
    assert_names(
        r#"{"kernels": {"backend": "rocm"}}"#,
        "kernels.backend",
        &["\"rocm\"", "\"auto\", \"cpu\", \"candle\", \"cuda\""],
    );
    assert_names(
        r#"{"visual": {"kernels": {"bf16_dot": "yes"}}}"#,
        "visual.kernels.bf16_dot",
        &["\"yes\"", "\"auto\", \"on\", \"off\""],
    );
    assert_names(
        r#"{"kernels": {"amx": true}}"#,
        "kernels.amx",
        &["true", "\"auto\", \"on\", \"off\""],
    );
}

#[test]
fn simd_on_is_an_error() {
    assert_names(
        r#"{"kernels": {"simd": "on"}}"#,
        "kernels.simd",
        &["\"on\"", "\"auto\", \"off\"", "scalar"],
    );
    assert_names(
        r#"{"visual": {"kernels": {"simd": "on"}}}"#,
        "visual.kernels.simd",
        &["\"auto\", \"off\""],
    );
}

#[test]
fn vit_only_keys_at_the_top_level_point_to_visual_kernels() {
    assert_names(
        r#"{"kernels": {"attention_tiles": [256, 512]}}"#,
        "kernels.attention_tiles",
        &["[256,512]", "`visual.kernels` key"],
    );
    assert_names(
        r#"{"kernels": {"profile": true}}"#,
        "kernels.profile",
        &["`visual.kernels` key"],
    );
}

#[test]
fn attention_tiles_are_two_integers_of_at_least_8() {
    assert_names(
        r#"{"visual": {"kernels": {"attention_tiles": [4, 512]}}}"#,
        "visual.kernels.attention_tiles",
        &["[4,512]", "query rows must be >= 8"],
    );
    assert_names(
        r#"{"visual": {"kernels": {"attention_tiles": [256, 0]}}}"#,
        "visual.kernels.attention_tiles",
        &["keys per tile must be >= 8"],
    );
    assert_names(
        r#"{"visual": {"kernels": {"attention_tiles": [256]}}}"#,
        "visual.kernels.attention_tiles",
        &["two integers", "got 1 values"],
    );
    assert_names(
        r#"{"visual": {"kernels": {"attention_tiles": 256}}}"#,
        "visual.kernels.attention_tiles",
        &["two integers"],
    );
    assert_names(
        r#"{"visual": {"kernels": {"attention_tiles": [256, "wide"]}}}"#,
        "visual.kernels.attention_tiles",
        &["two integers"],
    );
    // The minimum itself is valid.
    let c = DeployConfig::from_json(r#"{"visual": {"kernels": {"attention_tiles": [8, 8]}}}"#)
        .unwrap()
        .config;
    assert_eq!(c.visual.kernels.attention_tiles, [8, 8]);
}

#[test]
fn profile_is_a_bool() {
    assert_names(
        r#"{"visual": {"kernels": {"profile": "yes"}}}"#,
        "visual.kernels.profile",
        &["true or false"],
    );
}

#[test]
fn unknown_kernel_keys_suggest_the_nearest() {
    let e = err(r#"{"kernels": {"bf16dot": "on"}}"#);
    assert_eq!(e.key(), Some("kernels.bf16dot"));
    assert!(
        e.to_string().contains("did you mean `kernels.bf16_dot`"),
        "{e}"
    );
    let e = err(r#"{"visual": {"kernels": {"attention_tile": [8, 8]}}}"#);
    assert!(
        e.to_string()
            .contains("did you mean `visual.kernels.attention_tiles`"),
        "{e}"
    );
    let e = err(r#"{"kernel": {}}"#);
    assert!(e.to_string().contains("did you mean `kernels`"), "{e}");
}

#[test]
fn kernels_must_be_a_mapping() {
    assert_names(r#"{"kernels": "fast"}"#, "kernels", &["mapping"]);
    assert_names(
        r#"{"visual": {"kernels": [1]}}"#,
        "visual.kernels",
        &["mapping"],
    );
}

#[test]
fn cuda_is_a_backend_choice() {
    let c = DeployConfig::from_json(
        r#"{"kernels": {"backend": "cuda"}, "visual": {"kernels": {"backend": "cuda"}}}"#,
    )
    .unwrap()
    .config;
    assert_eq!(c.kernels.backend, BackendChoice::Cuda);
    assert_eq!(c.visual.kernels.backend, BackendChoice::Cuda);
}
