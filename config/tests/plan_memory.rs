//! The memory plan: parameter counts, the accounting per device, automatic KV blocks, the CPU
//! figures and the checked suggestions.
use vlm_config::plan::{
    self, BufferPolicy, DeviceKind, ModelDims, PlanError, PlanOptions, RblnSizing, GIB, MIB,
};
use vlm_config::{DeployConfig, Dtype};

fn cfg(json: &str) -> DeployConfig {
    DeployConfig::from_json(json).unwrap().config
}

fn dims() -> ModelDims {
    ModelDims::qwen3_vl_2b()
}

// The RBLN kinds' runtime, as the planner models it (the other kinds' sizes come from the
// backends: backends/select/tests/plan.rs).
fn plan_on(c: &DeployConfig, d: &ModelDims, kind: &DeviceKind, opts: &PlanOptions) -> plan::Plan {
    plan::plan(c, d, kind, &RblnSizing::for_kind(kind, opts), opts)
}

fn resolve_on(c: &DeployConfig, d: &ModelDims, kind: &DeviceKind) -> Result<u32, PlanError> {
    let opts = PlanOptions::default();
    plan::resolve_kv_blocks(c, d, kind, &RblnSizing::for_kind(kind, &opts))
}

/// A Qwen3-VL-2B-Instruct config.json, trimmed, with keys this crate ignores.
const CONFIG_JSON: &str = r#"{
  "architectures": ["Qwen3VLForConditionalGeneration"],
  "image_token_id": 151655,
  "model_type": "qwen3_vl",
  "text_config": {
    "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 151643, "dtype": "bfloat16",
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 262144,
    "model_type": "qwen3_vl_text", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": {"mrope_interleaved": true, "mrope_section": [24, 20, 20], "rope_type": "default"},
    "rope_theta": 5000000, "tie_word_embeddings": true, "use_cache": true, "vocab_size": 151936
  },
  "tie_word_embeddings": true,
  "transformers_version": "4.57.0.dev0",
  "video_token_id": 151656,
  "vision_config": {
    "deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1024, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4096,
    "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048,
    "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2
  },
  "vision_end_token_id": 151653,
  "vision_start_token_id": 151652
}"#;

#[test]
fn qwen3_vl_2b_parameter_count_is_exact() {
    let p = dims().params();
    assert_eq!(p.total(), 2_127_532_032);
    assert_eq!(p.visual, 406_957_056);
    assert_eq!(p.text, 2_127_532_032 - 406_957_056);
}

#[test]
fn dims_from_config_json_match_the_preset() {
    assert_eq!(ModelDims::from_config_json(CONFIG_JSON).unwrap(), dims());
    assert_eq!(ModelDims::preset("qwen3-vl-2b").unwrap(), dims());
    // Untied head: counted twice.
    let untied = CONFIG_JSON.replace(
        "\"tie_word_embeddings\": true",
        "\"tie_word_embeddings\": false",
    );
    let d = ModelDims::from_config_json(&untied).unwrap();
    assert!(!d.tied);
    assert_eq!(d.params().text - dims().params().text, 151_936 * 2048);
    let err = ModelDims::from_config_json(r#"{"text_config": {}}"#).unwrap_err();
    assert!(err.to_string().contains("config.json"), "{err}");
    assert!(ModelDims::preset("llama").is_err());
}

#[test]
fn device_kinds_and_byte_counts() {
    assert_eq!(DeviceKind::atom().usable(), 16 * GIB - 288 * MIB);
    assert_eq!(DeviceKind::rebel().usable(), 140 * GIB);
    assert_eq!(DeviceKind::h200().capacity, 141_000_000_000);
    let cpu = DeviceKind::cpu().unwrap();
    assert!(cpu.shared_pool && cpu.capacity > 0);
    assert_eq!(plan::parse_bytes("16GiB").unwrap(), 16 * GIB);
    assert_eq!(plan::parse_bytes("141GB").unwrap(), 141_000_000_000);
    assert_eq!(plan::parse_bytes("1_024").unwrap(), 1024);
    assert!(plan::parse_bytes("lots").is_err());
    assert!(DeviceKind::by_name("tpu")
        .unwrap_err()
        .to_string()
        .contains("known: atom"));
}

/// Disjoint layout on ATOM: each part's bytes split over its devices, the reservation on each.
#[test]
fn parts_split_over_their_devices() {
    let c = cfg(r#"{
        "visual": {"max_seq_len": [1024, 4096], "device": [0, 1]},
        "device": [2, 3, 4, 5], "max_seq_len": 8192, "kvcache_partition_len": 1024,
        "kvcache_num_blocks": 32, "batch_size": 4, "decoder_batch_sizes": [2, 4]
    }"#);
    let kind = DeviceKind::atom();
    let p = plan_on(&c, &dims(), &kind, &PlanOptions::default());
    assert!(p.fits);
    assert_eq!(p.devices.len(), 6);
    let pc = dims().params();
    // bf16 on ATOM.
    assert_eq!(p.visual.weights, pc.visual * 2);
    assert_eq!(p.lm.weights, pc.text * 2);
    // Per graph: both ViT buckets, the prefill graph and both decode graphs are held.
    assert_eq!(kind.buffers, BufferPolicy::PerGraph);
    assert_eq!(p.visual.graphs.len(), 2);
    assert_eq!(p.lm.graphs.len(), 3);
    assert_eq!(
        p.visual.buffers,
        p.visual.graphs.iter().map(|g| g.bytes).sum::<u64>()
    );
    // KV: 32 blocks x 1024 tokens x 112 KiB, over 4 devices.
    assert_eq!(p.lm.kv_cache, 32 * 1024 * 112 * 1024);
    let d2 = p.devices.iter().find(|d| d.id == "2").unwrap();
    let kv = d2
        .items
        .iter()
        .find(|i| i.what.starts_with("kv cache"))
        .unwrap();
    assert_eq!(kv.bytes, p.lm.kv_cache / 4);
    let w = d2.items.iter().find(|i| i.what == "weights").unwrap();
    assert_eq!(w.bytes, (pc.text * 2).div_ceil(4));
    let d0 = p.devices.iter().find(|d| d.id == "0").unwrap();
    assert!(d0.items.iter().all(|i| i.part == plan::Part::Visual));
    for d in &p.devices {
        assert_eq!(
            d.used,
            d.items.iter().map(|i| i.bytes).sum::<u64>() + 288 * MIB
        );
        assert_eq!(d.headroom, 16 * GIB as i64 - d.used as i64);
    }
}

#[test]
fn a_dtype_override_changes_weights_kv_and_activations() {
    let c = cfg(r#"{"max_seq_len": 8192, "kvcache_partition_len": 1024, "kvcache_num_blocks": 8}"#);
    let bf16 = plan_on(&c, &dims(), &DeviceKind::atom(), &PlanOptions::default());
    let f32 = plan_on(
        &c,
        &dims(),
        &DeviceKind::atom(),
        &PlanOptions {
            dtype: Some(Dtype::F32),
            ..Default::default()
        },
    );
    assert_eq!(f32.lm.weights, 2 * bf16.lm.weights);
    assert_eq!(f32.lm.kv_cache, 2 * bf16.lm.kv_cache);
    assert_eq!(f32.visual.buffers, 2 * bf16.visual.buffers);
    assert_eq!(f32.kv.bytes_per_token, 224 * 1024);
}

#[test]
fn an_fp8_kv_cache_halves_the_bytes_per_token_and_doubles_the_blocks() {
    // A batch whose full-length sequences do not fit: memory sets the count.
    let c = cfg(r#"{
        "max_seq_len": 65536, "kvcache_partition_len": 4096,
        "batch_size": 16, "decoder_batch_sizes": [8, 16]
    }"#);
    let mut fp8 = c.clone();
    fp8.kv_cache_dtype = vlm_config::KvCacheDtype::Fp8E4m3;
    let kind = DeviceKind::atom();
    let (p16, p8) = (
        plan_on(&c, &dims(), &kind, &PlanOptions::default()),
        plan_on(&fp8, &dims(), &kind, &PlanOptions::default()),
    );
    assert_eq!(p8.kv.dtype.as_str(), "fp8_e4m3");
    assert_eq!(p8.kv.bytes_per_token, 56 * 1024);
    assert_eq!(2 * p8.kv.bytes_per_token, p16.kv.bytes_per_token);
    // The same memory holds twice the blocks (give or take the rounding of what is left).
    let (b16, b8) = (
        resolve_on(&c, &dims(), &kind).unwrap(),
        resolve_on(&fp8, &dims(), &kind).unwrap(),
    );
    assert!(b8 >= 2 * b16 && b8 <= 2 * b16 + 1, "{b16} vs {b8}");
    assert!(plan::report::render(&p8, &dims()).contains("fp8_e4m3"));
}

#[test]
fn automatic_blocks_fill_what_is_left_and_the_vit_takes_its_share() {
    let kind = DeviceKind::atom();
    let shared = cfg(r#"{
        "visual": {"max_seq_len": [16384], "device": [0, 1]},
        "device": [0, 1], "max_seq_len": 65536, "kvcache_partition_len": 4096,
        "batch_size": 16, "decoder_batch_sizes": [8, 16]
    }"#);
    let mut apart = shared.clone();
    apart.visual.device = vec![2, 3];
    let bs = resolve_on(&shared, &dims(), &kind).unwrap();
    let ba = resolve_on(&apart, &dims(), &kind).unwrap();
    assert!(bs < ba, "shared {bs} vs apart {ba}");
    // The resolved count is the largest that fits: one more block does not.
    for c in [&shared, &apart] {
        let b = resolve_on(c, &dims(), &kind).unwrap();
        let mut fixed = c.clone();
        fixed.kvcache_num_blocks = b;
        assert!(plan_on(&fixed, &dims(), &kind, &PlanOptions::default()).fits);
        fixed.kvcache_num_blocks = b + 1;
        assert!(!plan_on(&fixed, &dims(), &kind, &PlanOptions::default()).fits);
        // The plan of the automatic config places exactly that many.
        let p = plan_on(c, &dims(), &kind, &PlanOptions::default());
        assert_eq!(p.kv.blocks, b);
        assert!(p.kv.automatic);
    }
    // An explicit count is returned as is.
    let mut fixed = shared.clone();
    fixed.kvcache_num_blocks = 20;
    assert_eq!(resolve_on(&fixed, &dims(), &kind).unwrap(), 20);
}

#[test]
fn automatic_blocks_are_capped_at_a_full_batch() {
    let c = cfg(r#"{"max_seq_len": 4096, "kvcache_partition_len": 1024, "batch_size": 2}"#);
    assert_eq!(resolve_on(&c, &dims(), &DeviceKind::rebel()).unwrap(), 8);
    let p = plan_on(&c, &dims(), &DeviceKind::rebel(), &PlanOptions::default());
    assert!(p.fits && p.full_batch);
}

#[test]
fn fewer_blocks_than_one_sequence_is_an_error_that_says_so() {
    // One ATOM cannot hold 262,144 tokens (28 GiB) of KV.
    let c = cfg(r#"{"max_seq_len": 262144, "kvcache_partition_len": 16384}"#);
    let err = resolve_on(&c, &dims(), &DeviceKind::atom()).unwrap_err();
    match &err {
        PlanError::KvTooSmall {
            needed,
            fits,
            device,
            ..
        } => {
            assert_eq!(*needed, 16);
            assert!(*fits < 16);
            assert_eq!(device, "0");
        }
        e => panic!("{e:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("one full-length sequence") && msg.contains("16 blocks"),
        "{msg}"
    );
    let p = plan_on(&c, &dims(), &DeviceKind::atom(), &PlanOptions::default());
    assert!(!p.fits);
    assert!(p.problems[0].contains("one full-length sequence"));
    assert!(p.problems.iter().any(|x| x.contains("short by")));
    // Suggestions: a shorter context, more devices; each re-planned and fitting.
    assert!(p
        .suggestions
        .iter()
        .any(|s| s.patch.get("max_seq_len").is_some()));
    assert!(p
        .suggestions
        .iter()
        .any(|s| s.patch.get("num_devices").is_some()));
    for s in &p.suggestions {
        assert!(s.min_headroom >= 0, "{s:?}");
    }
}

#[test]
fn suggestions_apply_and_fit() {
    // Both parts on two shared ATOMs, explicit blocks too many for them.
    let c = cfg(r#"{
        "visual": {"max_seq_len": [4096, 16384], "device": [0, 1]},
        "device": [0, 1], "max_seq_len": 131072, "kvcache_partition_len": 16384,
        "kvcache_num_blocks": 16, "batch_size": 2
    }"#);
    let kind = DeviceKind::atom();
    let p = plan_on(&c, &dims(), &kind, &PlanOptions::default());
    assert!(!p.fits);
    assert!(
        p.problems
            .iter()
            .any(|x| x.starts_with("devices 0, 1 (atom): each needs") && x.contains("short by")),
        "{:?}",
        p.problems
    );
    let kinds: Vec<String> = p.suggestions.iter().map(|s| s.change.clone()).collect();
    assert!(
        kinds.iter().any(|s| s.starts_with("kvcache_num_blocks")),
        "{kinds:?}"
    );
    assert!(
        kinds.iter().any(|s| s.starts_with("num_devices")),
        "{kinds:?}"
    );
    // Apply each patch by hand and plan again.
    for s in &p.suggestions {
        let mut v = serde_json::to_value(&c).unwrap();
        if s.patch.get("device_memory").is_some() {
            continue;
        }
        merge(&mut v, &s.patch);
        let fixed = DeployConfig::from_value(&v).unwrap().config;
        let q = plan_on(&fixed, &dims(), &kind, &PlanOptions::default());
        assert!(q.fits, "{}: {:?}", s.change, q.problems);
    }
}

fn merge(into: &mut serde_json::Value, patch: &serde_json::Value) {
    for (k, v) in patch.as_object().unwrap() {
        if v.is_object() {
            merge(into.get_mut(k).unwrap(), v);
        } else {
            into[k] = v.clone();
        }
    }
}

#[test]
fn the_report_names_devices_and_verdict() {
    let c = cfg(
        r#"{"visual": {"device": 0}, "device": 0, "max_seq_len": 262144, "kvcache_partition_len": 16384}"#,
    );
    let p = plan_on(&c, &dims(), &DeviceKind::atom(), &PlanOptions::default());
    let text = plan::report::render(&p, &dims());
    assert!(text.contains("device 0 (visual + lm)"), "{text}");
    assert!(text.contains("fits: NO"), "{text}");
    assert!(text.contains("prefix caching: on"), "{text}");
    let mut off = c.clone();
    off.prefix_caching = false;
    let q = plan_on(&off, &dims(), &DeviceKind::atom(), &PlanOptions::default());
    assert!(!plan::report::render(&q, &dims()).contains("prefix caching"));
    assert!(
        text.contains("changes that fit (each re-planned):"),
        "{text}"
    );
    let json = serde_json::to_value(&p).unwrap();
    assert_eq!(json["fits"], false);
    assert_eq!(json["devices"][0]["id"], "0");
}
