//! `make-model` writes checkpoints in the real Hugging Face Qwen3-VL layout.
use safetensors::SafeTensors;
use std::collections::BTreeMap;
use std::path::Path;
use vlm_compute::Qwen3VlConfig;
use vlm_make_model::{make_model, preset_manifest, MakeOptions, Preset, WeightDtype};

/// `qwen3-vl-2b-weights.txt` from the reference (shared/reference), kept here so the test runs
/// without the shared folder; compared with the shared copy when that is present.
const WEIGHTS_2B: &str = "\
model.visual.patch_embed.proj.weight (1024, 3, 2, 16, 16)
model.visual.patch_embed.proj.bias (1024,)
model.visual.pos_embed.weight (2304, 1024)
model.visual.blocks.0.norm1.weight (1024,)
model.visual.blocks.0.norm1.bias (1024,)
model.visual.blocks.0.norm2.weight (1024,)
model.visual.blocks.0.norm2.bias (1024,)
model.visual.blocks.0.attn.qkv.weight (3072, 1024)
model.visual.blocks.0.attn.qkv.bias (3072,)
model.visual.blocks.0.attn.proj.weight (1024, 1024)
model.visual.blocks.0.attn.proj.bias (1024,)
model.visual.blocks.0.mlp.linear_fc1.weight (4096, 1024)
model.visual.blocks.0.mlp.linear_fc1.bias (4096,)
model.visual.blocks.0.mlp.linear_fc2.weight (1024, 4096)
model.visual.blocks.0.mlp.linear_fc2.bias (1024,)
model.visual.merger.norm.weight (1024,)
model.visual.merger.norm.bias (1024,)
model.visual.merger.linear_fc1.weight (4096, 4096)
model.visual.merger.linear_fc1.bias (4096,)
model.visual.merger.linear_fc2.weight (2048, 4096)
model.visual.merger.linear_fc2.bias (2048,)
model.visual.deepstack_merger_list.0.norm.weight (4096,)
model.visual.deepstack_merger_list.0.norm.bias (4096,)
model.visual.deepstack_merger_list.0.linear_fc1.weight (4096, 4096)
model.visual.deepstack_merger_list.0.linear_fc1.bias (4096,)
model.visual.deepstack_merger_list.0.linear_fc2.weight (2048, 4096)
model.visual.deepstack_merger_list.0.linear_fc2.bias (2048,)
model.language_model.embed_tokens.weight (151936, 2048)
model.language_model.layers.0.self_attn.q_proj.weight (2048, 2048)
model.language_model.layers.0.self_attn.k_proj.weight (1024, 2048)
model.language_model.layers.0.self_attn.v_proj.weight (1024, 2048)
model.language_model.layers.0.self_attn.o_proj.weight (2048, 2048)
model.language_model.layers.0.self_attn.q_norm.weight (128,)
model.language_model.layers.0.self_attn.k_norm.weight (128,)
model.language_model.layers.0.mlp.gate_proj.weight (6144, 2048)
model.language_model.layers.0.mlp.up_proj.weight (6144, 2048)
model.language_model.layers.0.mlp.down_proj.weight (2048, 6144)
model.language_model.layers.0.input_layernorm.weight (2048,)
model.language_model.layers.0.post_attention_layernorm.weight (2048,)
model.language_model.norm.weight (2048,)
# lm_head.weight (151936, 2048) (tied to model.language_model.embed_tokens.weight; NOT stored in the checkpoint)
# total params (tied counted once): 2127532032
# visual params: 406957056
";

/// Name -> shape that a Qwen3-VL checkpoint must hold, written out from the config
/// independently of the generator (modeling_qwen3_vl's module tree).
fn expected_layout(cfg: &Qwen3VlConfig) -> BTreeMap<String, Vec<usize>> {
    let v = &cfg.vision;
    let t = &cfg.text;
    let mut m = BTreeMap::new();
    let mut put = |n: String, s: &[usize]| {
        m.insert(n, s.to_vec());
    };
    let d = v.hidden_size;
    let m4 = d * v.spatial_merge_size * v.spatial_merge_size;
    put(
        "model.visual.patch_embed.proj.weight".into(),
        &[
            d,
            v.in_channels,
            v.temporal_patch_size,
            v.patch_size,
            v.patch_size,
        ],
    );
    put("model.visual.patch_embed.proj.bias".into(), &[d]);
    put(
        "model.visual.pos_embed.weight".into(),
        &[v.num_position_embeddings, d],
    );
    for i in 0..v.depth {
        let p = format!("model.visual.blocks.{i}");
        for n in ["norm1", "norm2"] {
            put(format!("{p}.{n}.weight"), &[d]);
            put(format!("{p}.{n}.bias"), &[d]);
        }
        put(format!("{p}.attn.qkv.weight"), &[3 * d, d]);
        put(format!("{p}.attn.qkv.bias"), &[3 * d]);
        put(format!("{p}.attn.proj.weight"), &[d, d]);
        put(format!("{p}.attn.proj.bias"), &[d]);
        put(
            format!("{p}.mlp.linear_fc1.weight"),
            &[v.intermediate_size, d],
        );
        put(format!("{p}.mlp.linear_fc1.bias"), &[v.intermediate_size]);
        put(
            format!("{p}.mlp.linear_fc2.weight"),
            &[d, v.intermediate_size],
        );
        put(format!("{p}.mlp.linear_fc2.bias"), &[d]);
    }
    let mut merger = |p: String, norm: usize| {
        put(format!("{p}.norm.weight"), &[norm]);
        put(format!("{p}.norm.bias"), &[norm]);
        put(format!("{p}.linear_fc1.weight"), &[m4, m4]);
        put(format!("{p}.linear_fc1.bias"), &[m4]);
        put(format!("{p}.linear_fc2.weight"), &[v.out_hidden_size, m4]);
        put(format!("{p}.linear_fc2.bias"), &[v.out_hidden_size]);
    };
    merger("model.visual.merger".into(), d);
    for k in 0..v.deepstack_visual_indexes.len() {
        merger(format!("model.visual.deepstack_merger_list.{k}"), m4);
    }
    let h = t.hidden_size;
    let (q, kv) = (
        t.num_attention_heads * t.head_dim,
        t.num_key_value_heads * t.head_dim,
    );
    put(
        "model.language_model.embed_tokens.weight".into(),
        &[t.vocab_size, h],
    );
    for i in 0..t.num_hidden_layers {
        let p = format!("model.language_model.layers.{i}");
        put(format!("{p}.self_attn.q_proj.weight"), &[q, h]);
        put(format!("{p}.self_attn.k_proj.weight"), &[kv, h]);
        put(format!("{p}.self_attn.v_proj.weight"), &[kv, h]);
        put(format!("{p}.self_attn.o_proj.weight"), &[h, q]);
        put(format!("{p}.self_attn.q_norm.weight"), &[t.head_dim]);
        put(format!("{p}.self_attn.k_norm.weight"), &[t.head_dim]);
        put(
            format!("{p}.mlp.gate_proj.weight"),
            &[t.intermediate_size, h],
        );
        put(format!("{p}.mlp.up_proj.weight"), &[t.intermediate_size, h]);
        put(
            format!("{p}.mlp.down_proj.weight"),
            &[h, t.intermediate_size],
        );
        put(format!("{p}.input_layernorm.weight"), &[h]);
        put(format!("{p}.post_attention_layernorm.weight"), &[h]);
    }
    put("model.language_model.norm.weight".into(), &[h]);
    if !cfg.tie_word_embeddings {
        put("lm_head.weight".into(), &[t.vocab_size, h]);
    }
    m
}

/// Name -> (shape, dtype) of every tensor in the checkpoint's safetensors files.
fn read_layout(dir: &Path) -> BTreeMap<String, (Vec<usize>, String)> {
    let mut out = BTreeMap::new();
    for file in vlm_model::weights::safetensors_files(dir).unwrap() {
        let bytes = std::fs::read(&file).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in st.tensors() {
            let prev = out.insert(
                name.clone(),
                (view.shape().to_vec(), format!("{:?}", view.dtype())),
            );
            assert!(prev.is_none(), "{name} stored twice");
        }
    }
    out
}

fn shapes_only(m: &BTreeMap<String, (Vec<usize>, String)>) -> BTreeMap<String, Vec<usize>> {
    m.iter().map(|(k, (s, _))| (k.clone(), s.clone())).collect()
}

fn make(
    preset: Preset,
    dir: &Path,
    f: impl FnOnce(&mut MakeOptions),
) -> vlm_make_model::MadeCheckpoint {
    let mut opts = MakeOptions::new(preset);
    f(&mut opts);
    make_model(dir, &opts).unwrap()
}

#[test]
fn tiny_loads_back_with_the_reference_layout() {
    let dir = tempfile::tempdir().unwrap();
    let made = make(Preset::Tiny, dir.path(), |_| {});
    let cfg = Qwen3VlConfig::from_dir(dir.path()).unwrap();
    assert_eq!(cfg, made.config);
    // the dims of shared/reference/configs/tiny.json, with the generator's vocabulary
    let (t, v) = (&cfg.text, &cfg.vision);
    assert_eq!(
        (t.hidden_size, t.intermediate_size, t.num_hidden_layers),
        (64, 128, 3)
    );
    assert_eq!(
        (t.num_attention_heads, t.num_key_value_heads, t.head_dim),
        (4, 2, 16)
    );
    assert_eq!(
        (t.mrope_section, t.rope_theta, t.vocab_size),
        ([4, 2, 2], 5e6, 1024)
    );
    assert_eq!(
        (v.depth, v.hidden_size, v.num_heads, v.out_hidden_size),
        (3, 64, 2, 64)
    );
    assert_eq!(
        (
            v.num_position_embeddings,
            v.deepstack_visual_indexes.clone()
        ),
        (64, vec![0, 2])
    );
    assert!(cfg.tie_word_embeddings);
    assert_eq!(
        made.weight_files,
        vec![dir.path().join("model.safetensors")]
    );

    let stored = read_layout(dir.path());
    assert_eq!(shapes_only(&stored), expected_layout(&cfg));
    assert!(stored.values().all(|(_, dt)| dt == "F32"));
    assert!(!stored.contains_key("lm_head.weight"));
    assert_eq!(made.tensors, stored.len());

    // candle reads it through the crate's own loader
    let vb = vlm_model::weights::var_builder(
        dir.path(),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let w = vb
        .get((64, 3, 2, 16, 16), "model.visual.patch_embed.proj.weight")
        .unwrap();
    let std = w
        .flatten_all()
        .unwrap()
        .sqr()
        .unwrap()
        .mean_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        .sqrt();
    assert!(
        (std - 1.0 / 1536f32.sqrt()).abs() < 0.002,
        "patch embed std {std}"
    );
    let norm = vb
        .get(64, "model.language_model.norm.weight")
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert!(norm.iter().all(|&x| x == 1.0));

    // both rope spellings, the marker, and the other files
    let raw: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    let tc = &raw["text_config"];
    assert_eq!(
        tc["rope_parameters"]["mrope_section"],
        serde_json::json!([4, 2, 2])
    );
    assert_eq!(
        tc["rope_scaling"]["mrope_interleaved"],
        serde_json::json!(true)
    );
    assert_eq!(tc["rope_theta"], serde_json::json!(5e6));
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "preprocessor_config.json",
    ] {
        assert!(dir.path().join(f).is_file(), "{f}");
    }
    let pp: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("preprocessor_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(pp["patch_size"], 16);
    assert_eq!(pp["merge_size"], 2);
    assert_eq!(pp["temporal_patch_size"], 2);
    assert_eq!(pp["image_mean"], serde_json::json!([0.5, 0.5, 0.5]));
    assert_eq!(
        pp["size"],
        serde_json::json!({"shortest_edge": 65536, "longest_edge": 16777216})
    );
}

#[test]
fn weights_are_deterministic_in_the_seed() {
    let (a, b, c) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    make(Preset::Tiny, a.path(), |o| o.seed = 3);
    make(Preset::Tiny, b.path(), |o| o.seed = 3);
    make(Preset::Tiny, c.path(), |o| o.seed = 4);
    let read = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert_eq!(read(a.path()), read(b.path()));
    assert_ne!(read(a.path()), read(c.path()));
    assert_eq!(
        std::fs::read(a.path().join("tokenizer.json")).unwrap(),
        std::fs::read(c.path().join("tokenizer.json")).unwrap()
    );
}

#[test]
fn sharded_output_has_an_index_and_loads() {
    let dir = tempfile::tempdir().unwrap();
    let made = make(Preset::Tiny, dir.path(), |o| {
        o.max_shard_bytes = Some(300_000);
        o.dtype = Some(WeightDtype::BF16);
    });
    let n = made.weight_files.len();
    assert!(n >= 3, "{n} shards");
    for (k, f) in made.weight_files.iter().enumerate() {
        assert_eq!(
            f.file_name().unwrap().to_str().unwrap(),
            format!("model-{:05}-of-{n:05}.safetensors", k + 1)
        );
        // no shard over the limit unless it holds a single larger tensor
        let st_bytes = std::fs::read(f).unwrap();
        let st = SafeTensors::deserialize(&st_bytes).unwrap();
        let data: usize = st.tensors().iter().map(|(_, v)| v.data().len()).sum();
        assert!(
            data <= 300_000 || st.len() == 1,
            "shard {k} holds {data} bytes"
        );
    }
    assert!(!dir.path().join("model.safetensors").exists());
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let map = index["weight_map"].as_object().unwrap();
    let stored = read_layout(dir.path());
    assert_eq!(map.len(), stored.len());
    assert!(stored.values().all(|(_, dt)| dt == "BF16"));
    assert_eq!(
        index["metadata"]["total_size"].as_u64().unwrap(),
        made.weight_bytes
    );
    assert_eq!(shapes_only(&stored), expected_layout(&made.config));
    let raw: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(raw["dtype"], "bfloat16");

    // the same directory made again as a single file: no stale shard is left behind
    make(Preset::Tiny, dir.path(), |_| {});
    assert_eq!(
        vlm_model::weights::safetensors_files(dir.path()).unwrap(),
        vec![dir.path().join("model.safetensors")]
    );
    assert!(!dir.path().join("model.safetensors.index.json").exists());
    let vb = vlm_model::weights::var_builder(
        dir.path(),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    assert!(vb
        .get((1024, 64), "model.language_model.embed_tokens.weight")
        .is_ok());
}

#[test]
fn untied_tiny_would_store_lm_head() {
    let mut cfg = vlm_make_model::preset_config(Preset::Tiny).unwrap();
    cfg.tie_word_embeddings = false;
    let specs = vlm_make_model::weight_manifest(&cfg);
    let names: BTreeMap<String, Vec<usize>> = specs
        .iter()
        .map(|s| (s.name.clone(), s.shape.clone()))
        .collect();
    assert_eq!(names, expected_layout(&cfg));
    assert_eq!(names["lm_head.weight"], vec![1024, 64]);
}

#[test]
fn refuses_to_overwrite_a_foreign_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), "{}").unwrap();
    std::fs::write(dir.path().join("model.safetensors"), "precious").unwrap();
    let err = make_model(dir.path(), &MakeOptions::new(Preset::Tiny)).unwrap_err();
    assert!(err.to_string().contains("did not write"), "{err}");
    assert_eq!(
        std::fs::read(dir.path().join("model.safetensors")).unwrap(),
        b"precious"
    );
}

/// (name, shape) lines and the "# key: number" totals of a weights list.
type WeightList = (Vec<(String, Vec<usize>)>, BTreeMap<String, u64>);

fn parse_weights_txt(text: &str) -> WeightList {
    let mut tensors = Vec::new();
    let mut totals = BTreeMap::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix("# ") {
            if let Some((k, v)) = rest.split_once(": ") {
                if let Ok(n) = v.trim().parse::<u64>() {
                    totals.insert(k.to_string(), n);
                }
            }
            continue;
        }
        let (name, shape) = line.split_once(' ').unwrap();
        let shape = shape
            .trim_matches(|c| c == '(' || c == ')')
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| s.trim().parse().unwrap())
            .collect();
        tensors.push((name.to_string(), shape));
    }
    (tensors, totals)
}

#[test]
fn the_2b_manifest_matches_the_reference_weight_list() {
    let specs = preset_manifest(Preset::Qwen3Vl2b).unwrap();
    let made: BTreeMap<String, Vec<usize>> = specs
        .iter()
        .map(|s| (s.name.clone(), s.shape.clone()))
        .collect();
    assert_eq!(made.len(), specs.len(), "duplicate names");
    let cfg = vlm_make_model::preset_config(Preset::Qwen3Vl2b).unwrap();
    assert_eq!(made, expected_layout(&cfg));
    assert!(!made.contains_key("lm_head.weight"), "2B is tied");

    let shared = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/reference/qwen3-vl-2b-weights.txt");
    let mut sources = vec![WEIGHTS_2B.to_string()];
    if let Ok(text) = std::fs::read_to_string(&shared) {
        sources.push(text);
    }
    for text in sources {
        let (listed, totals) = parse_weights_txt(&text);
        assert_eq!(listed.len(), 40);
        for (name, shape) in listed {
            // block 0 / layer 0 / deepstack 0 stand for every block, layer and level
            let mut variants = vec![name.clone()];
            for (pat, n) in [
                (".blocks.0.", 24),
                (".layers.0.", 28),
                (".deepstack_merger_list.0.", 3),
            ] {
                if name.contains(pat) {
                    let stem = pat.trim_end_matches("0.");
                    variants = (0..n)
                        .map(|i| name.replace(pat, &format!("{stem}{i}.")))
                        .collect();
                }
            }
            for n in variants {
                assert_eq!(made.get(&n), Some(&shape), "{n}");
            }
        }
        let total: u64 = specs.iter().map(|s| s.numel() as u64).sum();
        assert_eq!(Some(&total), totals.get("total params (tied counted once)"));
        let visual: u64 = specs
            .iter()
            .filter(|s| s.name.starts_with("model.visual."))
            .map(|s| s.numel() as u64)
            .sum();
        assert_eq!(Some(&visual), totals.get("visual params"));
    }
}

#[test]
fn the_2b_preset_metadata_without_weights() {
    let dir = tempfile::tempdir().unwrap();
    let made = make(Preset::Qwen3Vl2b, dir.path(), |o| o.weights = false);
    assert!(made.weight_files.is_empty());
    assert_eq!(made.parameters, 2_127_532_032);
    let cfg = Qwen3VlConfig::from_dir(dir.path()).unwrap();
    let (t, v) = (&cfg.text, &cfg.vision);
    assert_eq!(
        (
            t.vocab_size,
            t.hidden_size,
            t.intermediate_size,
            t.num_hidden_layers
        ),
        (151936, 2048, 6144, 28)
    );
    assert_eq!(
        (t.num_attention_heads, t.num_key_value_heads, t.head_dim),
        (16, 8, 128)
    );
    assert_eq!(
        (t.rope_theta, t.mrope_section, t.max_position_embeddings),
        (5e6, [24, 20, 20], 262144)
    );
    assert_eq!(
        (
            v.depth,
            v.hidden_size,
            v.intermediate_size,
            v.num_heads,
            v.out_hidden_size
        ),
        (24, 1024, 4096, 16, 2048)
    );
    assert_eq!(
        (
            v.num_position_embeddings,
            v.deepstack_visual_indexes.clone()
        ),
        (2304, vec![5, 11, 17])
    );
    assert!(cfg.tie_word_embeddings);
    assert_eq!(
        (
            cfg.image_token_id,
            cfg.video_token_id,
            cfg.vision_start_token_id,
            cfg.vision_end_token_id
        ),
        (151655, 151656, 151652, 151653)
    );
    assert_eq!(cfg.eos_token_ids, vec![151645, 151643]);
    assert!(vlm_model::weights::safetensors_files(dir.path()).is_err());
}

/// `tokenizer`: a real tokenizer.json (here the 2B preset's own, written by an earlier run, as
/// a stand-in for Qwen's, whose added tokens sit at the same ids) is written as it is, the
/// chat template stays Qwen3-VL's; one whose added tokens sit elsewhere (the tiny preset's) is
/// refused naming the token and both ids.
#[test]
fn a_real_tokenizer_is_written_when_its_added_tokens_match_the_preset() {
    let src = tempfile::tempdir().unwrap();
    make(Preset::Qwen3Vl2b, src.path(), |o| o.weights = false);
    let mut real: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.path().join("tokenizer.json")).unwrap())
            .unwrap();
    real["normalizer"] = serde_json::json!({"type": "NFC"}); // a mark of the source file
    std::fs::write(src.path().join("tokenizer.json"), real.to_string()).unwrap();
    let out = tempfile::tempdir().unwrap();
    let tok = src.path().to_path_buf();
    make(Preset::Qwen3Vl2b, out.path(), |o| {
        o.weights = false;
        o.tokenizer = Some(tok.clone());
    });
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("tokenizer.json")).unwrap())
            .unwrap();
    assert_eq!(written, real);
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.path().join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["chat_template"], vlm_make_model::CHAT_TEMPLATE);

    let tiny = tempfile::tempdir().unwrap();
    make(Preset::Tiny, tiny.path(), |o| o.weights = false);
    let opts = vlm_make_model::MakeOptions {
        weights: false,
        tokenizer: Some(tiny.path().to_path_buf()),
        ..vlm_make_model::MakeOptions::new(Preset::Qwen3Vl2b)
    };
    let e = vlm_make_model::make_model(out.path(), &opts)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("<|endoftext|> has id 998") && e.contains("151643"),
        "{e}"
    );
}
