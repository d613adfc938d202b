//! `vlm quantize`: a Hugging Face Qwen3-VL checkpoint -> the GGUF pair llama.cpp loads
//! (`vlm_model::gguf::quantize_checkpoint`), which `vlm up --model LM.gguf --mmproj V.gguf`
//! serves.
use anyhow::Context;
use std::path::PathBuf;
use std::process::ExitCode;
use vlm_model::gguf::{quantize_checkpoint, Scheme};

#[derive(clap::Args, Debug)]
pub struct QuantizeArgs {
    /// What the LM's linear weights become: q8_0, q4_k_m (llama.cpp's mix), f16 or bf16.
    /// Round-to-nearest; the vision file is f16.
    #[arg(long)]
    pub scheme: Scheme,
    /// The checkpoint directory (safetensors).
    pub src: PathBuf,
    /// The LM GGUF file to write; the vision file goes beside it as `mmproj-<name>`.
    pub dst: PathBuf,
}

pub fn run(args: QuantizeArgs) -> anyhow::Result<ExitCode> {
    let name = args
        .dst
        .file_name()
        .context("DST must be a file name")?
        .to_string_lossy()
        .into_owned();
    let mmproj = args.dst.with_file_name(format!("mmproj-{name}"));
    quantize_checkpoint(&args.src, args.scheme, &args.dst, &mmproj)
        .with_context(|| format!("quantizing {}", args.src.display()))?;
    println!("wrote {} and {}", args.dst.display(), mmproj.display());
    Ok(ExitCode::SUCCESS)
}
