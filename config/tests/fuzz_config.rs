//! Property tests of the deploy-config parser (issue 18): random documents made of the known
//! keys (and their older spellings) with random values, unknown keys, wrong types and deep
//! nesting either load or are refused with an error naming a key that is in the document or
//! that a rule is about; the same document written as JSON, YAML or TOML gives the same
//! answer; a config that loads writes out (its `Serialize`) to a document that loads as the same
//! config; a random config inside every documented range loads as asked.
//!
//! Bounded: a fixed number of cases per property. A failing case is kept in
//! `proptest-regressions/fuzz_config.txt` and replayed first on every run.
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use serde_json::{Map, Value};
use vlm_config::keys::{
    canonical, ALIASES, LM_KERNEL_KEYS, LM_KEYS, VISUAL_KERNEL_KEYS, VISUAL_KEYS,
};
use vlm_config::{ConfigError, DeployConfig, Format, Loaded};

/// `PROPTEST_CASES` (e.g. for a longer run by hand) overrides the bounded default.
fn config() -> ProptestConfig {
    ProptestConfig {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(2048),
        // Relative to the crate (cargo runs tests there): `config/proptest-regressions/`.
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "proptest-regressions/fuzz_config.txt",
        ))),
        ..ProptestConfig::default()
    }
}

/// Found by `random_documents_load_or_name_the_key`: a refused value whose JSON text is over
/// 60 bytes with a multi-byte character across byte 60 panicked in `parse::short` (it cut the
/// text at a byte index).
#[test]
fn regression_long_value_cut_inside_a_character() {
    let doc = serde_json::json!({"visual": [null, [false, false, " 0A¡🩠00০A®A ￼a ኊ𐊠\\🌀𐺰"]]});
    let e = DeployConfig::from_value(&doc).unwrap_err();
    assert_eq!(e.key(), Some("visual"), "{e}");
    assert!(e.to_string().contains("..."), "{e}");
}

/// Found by `random_documents_load_or_name_the_key`: with `max_seq_len` not a multiple of a
/// huge `kvcache_partition_len`, the suggested next multiple overflowed u32 (`rules.rs`: a panic
/// in debug builds, a wrong suggestion in release).
#[test]
fn regression_partition_suggestion_past_u32() {
    let doc = serde_json::json!({"max_seq_len": 4_000_000_000u64, "kvcache_partition_len": 3_000_000_000u64});
    let e = DeployConfig::from_value(&doc).unwrap_err();
    assert_eq!(e.key(), Some("max_seq_len"), "{e}");
    assert!(e.to_string().contains("6000000000"), "{e}");
}

/// Found the same way: blocks per sequence times `batch_size` overflowed u32 in the
/// `kvcache_num_blocks` warning (`rules.rs`).
#[test]
fn regression_kv_blocks_for_the_batch_past_u32() {
    let doc = serde_json::json!({
        "max_seq_len": 1u64 << 21, "kvcache_partition_len": 1, "batch_size": 4096,
        "kvcache_num_blocks": 1u64 << 21,
    });
    let l = DeployConfig::from_value(&doc).unwrap();
    assert!(
        l.warnings
            .iter()
            .any(|w| w.contains(&(1u64 << 33).to_string())),
        "{:?}",
        l.warnings
    );
}

/// Bug found by `random_documents_load_or_name_the_key` (not fixed here): `num_devices` (or
/// `tensor_parallel_size`, at either level) has no upper bound, and without a `device` list the
/// parser fills in `0..num_devices` (`parse.rs`, `Section::devices`). `{"num_devices":
/// 4294967295}` allocates 16 GiB and the process is killed (or aborts); `100000000` loads as a
/// config of 10^8 devices. Un-ignore once a bound exists.
#[test]
fn regression_huge_num_devices_is_refused() {
    for doc in [
        serde_json::json!({"num_devices": 100_000_000u64}),
        serde_json::json!({"visual": {"tensor_parallel_size": 100_000_000u64}}),
    ] {
        let e = DeployConfig::from_value(&doc).expect_err("a device count no machine has");
        assert!(e.key().is_some_and(|k| k.ends_with("num_devices")), "{e}");
    }
}

/// Whether `doc` asks for a device count whose `0..n` list would take more memory than a test
/// may use (see [`regression_huge_num_devices_is_refused`]); such cases are skipped.
fn huge_device_count(doc: &Value) -> bool {
    let count = |m: &Map<String, Value>| {
        ["num_devices", "tensor_parallel_size"]
            .iter()
            .any(|k| match m.get(*k) {
                Some(Value::Number(n)) => n.as_u64().is_some_and(|n| n > 1 << 20),
                Some(Value::String(s)) => s.chars().filter(char::is_ascii_digit).count() > 6,
                _ => false,
            })
    };
    let Some(top) = doc.as_object() else {
        return false;
    };
    count(top)
        || top
            .get("visual")
            .and_then(Value::as_object)
            .is_some_and(count)
}

/// Numbers where the rules change: 0, 1, small powers of two, multiples of 4 and 64, the ends of
/// u32 and u64, negatives, fractions, huge floats.
fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        prop::sample::select(vec![
            0u64,
            1,
            2,
            3,
            4,
            7,
            8,
            16,
            63,
            64,
            128,
            256,
            1000,
            1024,
            3136,
            4096,
            8192,
            16384,
            u32::MAX as u64,
            u32::MAX as u64 + 1,
            u64::MAX,
        ])
        .prop_map(Value::from),
        (0u64..20_000).prop_map(Value::from),
        (-5000i64..0).prop_map(Value::from),
        prop::sample::select(vec![0.5f64, -1.0, 1e300, -1e300, 4096.0, 1.5e19])
            .prop_map(Value::from),
    ]
}

/// Strings the parser reads specially (choices, dtypes, digit strings with `_`), and others.
fn string() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "auto",
            "on",
            "off",
            "AUTO",
            "Off",
            "cpu",
            "candle",
            "CPU",
            "f32",
            "float32",
            "f16",
            "float16",
            "bf16",
            "BFloat16",
            "reject",
            "downscale",
            "Reject",
            "1024",
            "1_024",
            "262_144",
            "4_096",
            "_1",
            "1__0",
            "",
            "-1",
            "0x10",
            "1e3",
            "true",
            "null",
            "~",
            "<|im_start|>",
            "日本語",
            "🦀",
        ])
        .prop_map(str::to_string),
        "[a-z_]{0,12}",
        any::<String>(),
    ]
}

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number(),
        string().prop_map(Value::String),
    ]
}

/// Any JSON value, nested up to a few levels, with keys that are sometimes known ones.
fn any_value() -> impl Strategy<Value = Value> {
    let key = prop_oneof![
        prop::sample::select(all_keys()).prop_map(str::to_string),
        "[a-z_]{1,10}",
    ];
    scalar().prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((key.clone(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

fn all_keys() -> Vec<&'static str> {
    let mut k: Vec<&'static str> = LM_KEYS
        .iter()
        .chain(VISUAL_KEYS)
        .chain(VISUAL_KERNEL_KEYS)
        .copied()
        .collect();
    k.extend(ALIASES.iter().map(|(old, _)| *old));
    k.push("batch_size");
    k.sort_unstable();
    k.dedup();
    k
}

/// A value for a known key: mostly of a plausible type (a number, a list of numbers, a bool, a
/// choice), sometimes anything.
fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => number(),
        3 => prop::collection::vec(number(), 0..5).prop_map(Value::Array),
        2 => any::<bool>().prop_map(Value::Bool),
        2 => string().prop_map(Value::String),
        1 => any_value(),
    ]
}

/// A section: a random subset of `known` (each key sometimes under its older spelling, rarely
/// both), with random values, sometimes an unknown key.
fn section(
    known: &'static [&'static str],
    nested: Vec<(&'static str, BoxedStrategy<Value>)>,
) -> impl Strategy<Value = Map<String, Value>> {
    let plain: Vec<&'static str> = known
        .iter()
        .copied()
        .filter(|k| !nested.iter().any(|(n, _)| n == k))
        .collect();
    let n = plain.len();
    let entries = prop::collection::vec(
        (
            prop::sample::select(plain),
            value(),
            prop::bool::weighted(0.2),
        ),
        0..n.min(7),
    );
    let nested = nested
        .into_iter()
        .map(|(k, s)| {
            prop::option::weighted(0.5, s)
                .prop_map(move |v| v.map(|v| (k, v)))
                .boxed()
        })
        .collect::<Vec<_>>();
    let unknown = prop::option::weighted(0.15, ("[a-z_]{1,14}", value()));
    (entries, nested, unknown).prop_map(|(entries, nested, unknown)| {
        let mut m = Map::new();
        for (k, v, old) in entries {
            let alias = ALIASES.iter().find(|(_, new)| *new == k).map(|(o, _)| *o);
            let key = match alias {
                Some(a) if old => a,
                _ => k,
            };
            m.insert(key.to_string(), v);
        }
        for (k, v) in nested.into_iter().flatten() {
            m.insert(k.to_string(), v);
        }
        if let Some((k, v)) = unknown {
            m.insert(k, v);
        }
        m
    })
}

fn kernels(known: &'static [&'static str]) -> BoxedStrategy<Value> {
    prop_oneof![
        6 => section(known, vec![]).prop_map(Value::Object),
        1 => any_value(),
    ]
    .boxed()
}

/// A whole document: mostly a mapping of the top-level keys with `visual` and `kernels`
/// sections; sometimes any value at all.
fn document() -> impl Strategy<Value = Value> {
    let visual = prop_oneof![
        8 => section(VISUAL_KEYS, vec![("kernels", kernels(VISUAL_KERNEL_KEYS))]).prop_map(Value::Object),
        1 => any_value(),
    ]
    .boxed();
    prop_oneof![
        12 => section(
            LM_KEYS,
            vec![("visual", visual), ("kernels", kernels(LM_KERNEL_KEYS))]
        )
        .prop_map(Value::Object),
        1 => any_value(),
    ]
}

/// The keys a section of `doc` at `path` (`""`, `"visual."`, ...) holds, as written.
fn section_keys<'a>(doc: &'a Value, path: &str) -> Option<&'a Map<String, Value>> {
    let mut v = doc;
    for part in path.split('.').filter(|p| !p.is_empty()) {
        v = v.get(part)?;
    }
    v.as_object()
}

/// Checks that a refusal names a key of the document (or one a rule is about), in backquotes.
fn check_refusal(doc: &Value, e: &ConfigError) -> Result<(), TestCaseError> {
    let msg = e.to_string();
    prop_assert!(!msg.is_empty());
    let key = e.key();
    prop_assert!(key.is_some(), "an error without a key: {e:?}");
    let key = key.unwrap();
    prop_assert!(
        msg.contains(&format!("`{key}`")),
        "the message does not name `{key}`: {msg}"
    );
    if key == "(root)" {
        prop_assert!(!doc.is_object(), "(root) refused for a mapping: {msg}");
        return Ok(());
    }
    // The section the key is in: the longest prefix under which the rest is a key written
    // there or known there (a written key may itself hold dots).
    let sections: [(&str, &[&str]); 4] = [
        ("visual.kernels.", VISUAL_KERNEL_KEYS),
        ("visual.", VISUAL_KEYS),
        ("kernels.", LM_KERNEL_KEYS),
        ("", LM_KEYS),
    ];
    let found = sections.iter().find_map(|(prefix, known)| {
        let last = key.strip_prefix(prefix)?;
        let written = section_keys(doc, prefix).is_some_and(|m| m.contains_key(last));
        (written || known.contains(&canonical(last))).then_some((written, *known, last))
    });
    let Some((written, known, last)) = found else {
        return Err(TestCaseError::fail(format!(
            "refusal names {key:?}, neither in the document nor a known key: {msg}"
        )));
    };
    match e {
        ConfigError::UnknownKey { .. } => {
            prop_assert!(written, "unknown key {key:?} is not in the document: {msg}");
            prop_assert!(
                !known.contains(&canonical(last)),
                "a known key refused as unknown: {msg}"
            );
        }
        ConfigError::Invalid { .. } => {}
        _ => return Err(TestCaseError::fail(format!("not a key error: {e:?}"))),
    }
    Ok(())
}

/// What a config obeys once it has loaded (the rules, after normalization).
fn check_loaded(l: &Loaded) -> Result<(), TestCaseError> {
    let c = &l.config;
    prop_assert!(
        c.kvcache_partition_len > 0 && c.max_seq_len.is_multiple_of(c.kvcache_partition_len)
    );
    prop_assert!(c.max_seq_len / c.kvcache_partition_len >= 2);
    prop_assert!(c.prefill_chunk_size > 0 && c.prefill_chunk_size.is_multiple_of(64));
    prop_assert!(c.decoder_batch_sizes.windows(2).all(|w| w[0] < w[1]));
    prop_assert_eq!(c.decoder_batch_sizes.last(), Some(&c.batch_size));
    prop_assert_eq!(c.device.len(), c.num_devices as usize);
    prop_assert_eq!(c.visual.device.len(), c.visual.num_devices as usize);
    prop_assert!(!c.visual.max_seq_len.is_empty());
    prop_assert!(c.visual.max_seq_len.windows(2).all(|w| w[0] < w[1]));
    prop_assert!(c.visual.max_seq_len.iter().all(|b| *b > 0 && b % 4 == 0));
    prop_assert!(c.visual.min_pixels <= c.visual.max_pixels);
    Ok(())
}

/// The written-out config (what `vlm config check` prints) loads as the same config, from JSON,
/// YAML and TOML text.
fn check_round_trip(l: &Loaded) -> Result<(), TestCaseError> {
    let out = l.config.to_document();
    let again = DeployConfig::from_value(&out)
        .map_err(|e| TestCaseError::fail(format!("written-out config refused: {e}\n{out}")))?;
    prop_assert_eq!(&again.config, &l.config);
    let yaml = serde_yaml::to_string(&out).unwrap();
    let from_yaml = DeployConfig::from_str_as(&yaml, Format::Yaml)
        .map_err(|e| TestCaseError::fail(format!("YAML of the config refused: {e}\n{yaml}")))?;
    prop_assert_eq!(&from_yaml.config, &l.config);
    let toml = toml::to_string(&out).unwrap();
    let from_toml = DeployConfig::from_str_as(&toml, Format::Toml)
        .map_err(|e| TestCaseError::fail(format!("TOML of the config refused: {e}\n{toml}")))?;
    prop_assert_eq!(&from_toml.config, &l.config);
    Ok(())
}

/// The outcome in comparable form: the config, or a refusal. (Which key a document with
/// several faults is refused for depends on key order, which TOML does not keep.)
fn outcome(r: &Result<Loaded, ConfigError>) -> Result<DeployConfig, ()> {
    match r {
        Ok(l) => Ok(l.config.clone()),
        Err(_) => Err(()),
    }
}

proptest! {
    #![proptest_config(config())]

    /// Never a panic; a document loads (obeying every rule, and round-tripping through its
    /// written-out form) or is refused naming a key.
    #[test]
    fn random_documents_load_or_name_the_key(doc in document()) {
        prop_assume!(!huge_device_count(&doc));
        match DeployConfig::from_value(&doc) {
            Ok(l) => {
                check_loaded(&l)?;
                check_round_trip(&l)?;
            }
            Err(e) => check_refusal(&doc, &e)?,
        }
    }

    /// JSON, YAML and TOML text of one document give the same config, or are all refused,
    /// each naming a key of what it parsed to.
    #[test]
    fn every_format_gives_the_same_answer(doc in document()) {
        prop_assume!(!huge_device_count(&doc));
        let want = outcome(&DeployConfig::from_value(&doc));
        for format in [Format::Json, Format::Yaml, Format::Toml] {
            let text = match format {
                Format::Json => serde_json::to_string(&doc).unwrap(),
                Format::Yaml => serde_yaml::to_string(&doc).unwrap(),
                // TOML has no null and no top-level non-table: such documents are skipped.
                Format::Toml => match toml::to_string(&doc) {
                    Ok(t) => t,
                    Err(_) => continue,
                },
            };
            let got = DeployConfig::from_str_as(&text, format);
            prop_assert_eq!(outcome(&got), want.clone(), "{:?} {}", format, text);
            if let Err(e) = got {
                let parsed = vlm_config::file::parse_document(&text, format, "<t>").unwrap();
                check_refusal(&parsed, &e)?;
            }
        }
    }

    /// Random text never panics: it is a parse error, or the document it parses to is judged as
    /// above.
    #[test]
    fn random_text_is_a_parse_error_or_judged(text in prop_oneof![
        any::<String>(),
        document().prop_map(|d| serde_yaml::to_string(&d).unwrap()),
        (document(), any::<prop::sample::Index>(), any::<char>()).prop_map(|(d, i, c)| {
            // One character of a JSON document replaced.
            let mut s: Vec<char> = serde_json::to_string(&d).unwrap().chars().collect();
            let at = i.index(s.len());
            s[at] = c;
            s.into_iter().collect()
        }),
    ], format in prop::sample::select(vec![Format::Json, Format::Yaml, Format::Toml])) {
        if let Ok(doc) = vlm_config::file::parse_document(&text, format, "<t>") {
            prop_assume!(!huge_device_count(&doc));
        }
        match DeployConfig::from_str_as(&text, format) {
            Ok(l) => check_loaded(&l)?,
            Err(ConfigError::Parse { message, .. }) => prop_assert!(!message.is_empty()),
            Err(e) => {
                let doc = vlm_config::file::parse_document(&text, format, "<t>").unwrap();
                check_refusal(&doc, &e)?;
            }
        }
    }

    /// A config inside every documented range loads, as asked (lists sorted and deduplicated,
    /// `batch_size` appended to `decoder_batch_sizes`), and round-trips.
    #[test]
    fn valid_configs_load_as_asked(v in valid()) {
        let l = DeployConfig::from_value(&v.doc)
            .map_err(|e| TestCaseError::fail(format!("a valid config refused: {e}\n{}", v.doc)))?;
        let c = &l.config;
        prop_assert_eq!(c.max_seq_len, v.max_seq_len);
        prop_assert_eq!(c.kvcache_partition_len, v.kv);
        prop_assert_eq!(c.prefill_chunk_size, v.prefill);
        prop_assert_eq!(c.batch_size, v.batch_size);
        prop_assert_eq!(&c.decoder_batch_sizes, &v.decoder_batch_sizes);
        prop_assert_eq!(&c.device, &v.device);
        prop_assert_eq!(&c.visual.max_seq_len, &v.buckets);
        prop_assert_eq!((c.visual.min_pixels, c.visual.max_pixels), v.pixels);
        prop_assert_eq!(c.visual.kernels.attention_tiles, v.tiles);
        check_loaded(&l)?;
        check_round_trip(&l)?;
    }
}

/// A valid document and what it must load as.
#[derive(Debug, Clone)]
struct Valid {
    doc: Value,
    max_seq_len: u32,
    kv: u32,
    prefill: u32,
    batch_size: u32,
    decoder_batch_sizes: Vec<u32>,
    device: Vec<u32>,
    buckets: Vec<u32>,
    pixels: (u64, u64),
    tiles: [u32; 2],
}

/// A number as an integer or, sometimes, as a digit string with `_` separators.
fn num(n: u64, as_text: bool) -> Value {
    if !as_text {
        return Value::from(n);
    }
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push('_');
        }
        out.push(c);
    }
    Value::String(out)
}

fn valid() -> impl Strategy<Value = Valid> {
    let lm = (
        prop::sample::select(vec![16u32, 64, 128, 256, 512, 1024, 4096]),
        2u32..=16,
        1u32..=32,
        1u32..=64,
        prop::collection::vec(1u32..=64, 1..6),
        prop::collection::btree_set(0u32..16, 1..5),
        any::<bool>(),
    );
    let vis = (
        prop::collection::vec(1u32..=8192, 1..5),
        (1u64..1 << 22, 0u64..1 << 24),
        (8u32..2048, 8u32..2048),
        prop::sample::select(vec!["reject", "downscale"]),
        prop::sample::select(vec!["f32", "F16", "bfloat16"]),
        prop::sample::select(vec!["auto", "cpu", "Candle"]),
        prop::sample::select(vec!["auto", "on", "off"]),
        any::<bool>(),
    );
    (lm, vis).prop_map(|(lm, vis)| {
        let (kv, parts, chunks, batch_size, sizes, devices, as_text) = lm;
        let (raw_buckets, (min_px, extra_px), tiles, oversize, dtype, backend, toggle, aliases) =
            vis;
        let max_seq_len = kv * parts;
        let prefill = 64 * chunks;
        // Sizes within 1..=batch_size; one value only when it is batch_size.
        let mut sizes: Vec<u32> = sizes.into_iter().map(|s| 1 + (s - 1) % batch_size).collect();
        if sizes.len() == 1 {
            sizes[0] = batch_size;
        }
        let mut decoder_batch_sizes = sizes.clone();
        decoder_batch_sizes.sort_unstable();
        decoder_batch_sizes.dedup();
        if decoder_batch_sizes.last() != Some(&batch_size) {
            decoder_batch_sizes.push(batch_size);
        }
        let device: Vec<u32> = devices.into_iter().collect();
        let raw_buckets: Vec<u32> = raw_buckets.into_iter().map(|b| 4 * b).collect();
        let mut buckets = raw_buckets.clone();
        buckets.sort_unstable();
        buckets.dedup();
        let pixels = (min_px, min_px + extra_px);
        let (seq_key, tp_key) = if aliases {
            ("max_seq_lens", "tensor_parallel_size")
        } else {
            ("max_seq_len", "num_devices")
        };
        let doc = serde_json::json!({
            "max_seq_len": num(max_seq_len as u64, as_text),
            "kvcache_partition_len": kv,
            "kvcache_num_blocks": if as_text { 0 } else { parts * batch_size },
            "batch_size": batch_size,
            "decoder_batch_sizes": sizes,
            "prefill_chunk_size": num(prefill as u64, as_text),
            tp_key: device.len(),
            "device": device,
            "dtype": dtype,
            "prefix_caching": as_text,
            "create_runtimes": !as_text,
            "kernels": {"backend": backend, "bf16_dot": toggle, "amx": toggle, "simd": "off"},
            "visual": {
                seq_key: raw_buckets,
                "device": [0],
                "min_pixels": num(pixels.0, as_text),
                "max_pixels": pixels.1,
                "oversize": oversize,
                "dtype": dtype,
                "kernels": {"backend": backend, "attention_tiles": [tiles.0, tiles.1], "profile": aliases},
            },
        });
        Valid {
            doc,
            max_seq_len,
            kv,
            prefill,
            batch_size,
            decoder_batch_sizes,
            device,
            buckets,
            pixels,
            tiles: [tiles.0, tiles.1],
        }
    })
}
