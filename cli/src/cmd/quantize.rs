//! `vlm quantize`: a Hugging Face Qwen3-VL checkpoint -> the GGUF pair llama.cpp loads
//! (`vlm_model::gguf::quantize_checkpoint`), which `vlm up --model LM.gguf --mmproj V.gguf`
//! serves; or -> a compressed-tensors W8A8 or W4A16 directory (`vlm_model::w8a8`,
//! `vlm_model::w4a16`), which `vlm up --model DIR` and vLLM serve.
use anyhow::Context;
use std::path::PathBuf;
use std::process::ExitCode;
use vlm_model::gguf::{quantize_checkpoint, Scheme};

/// A GGUF scheme, or a compressed-tensors directory layout.
#[derive(Debug, Clone, Copy)]
pub enum QuantScheme {
    Gguf(Scheme),
    W8A8,
    W4A16,
    Fp8Block,
}

impl std::str::FromStr for QuantScheme {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("w8a8") {
            return Ok(QuantScheme::W8A8);
        }
        if s.eq_ignore_ascii_case("w4a16") {
            return Ok(QuantScheme::W4A16);
        }
        if s.eq_ignore_ascii_case("fp8-block") {
            return Ok(QuantScheme::Fp8Block);
        }
        s.parse::<Scheme>().map(QuantScheme::Gguf).map_err(|_| {
            format!("scheme {s} is not written (f16, bf16, q8_0, q4_k_m, w8a8, w4a16, fp8-block)")
        })
    }
}

#[derive(clap::Args, Debug)]
pub struct QuantizeArgs {
    /// What the LM's linear weights become: q8_0, q4_k_m (llama.cpp's mix), f16 or bf16 (a
    /// GGUF pair; the vision file is f16), or w8a8 (a compressed-tensors `int-quantized`
    /// directory: int8 per output channel, activations int8 per token at run time), or w4a16
    /// (a compressed-tensors `pack-quantized` directory: 4-bit symmetric per group of
    /// `--group-size` inputs, activations in floats), or fp8-block (Qwen's FP8 layout: e4m3
    /// weights, a scale per block of `--group-size` x `--group-size`). For the directories the
    /// head and the vision tower stay as they are. Round-to-nearest.
    #[arg(long)]
    pub scheme: QuantScheme,
    /// w4a16: inputs per scale; fp8-block: the block's edge (even, dividing every linear's
    /// input width; 128 is the presets' size for both).
    #[arg(long, default_value_t = vlm_model::w4a16::DEFAULT_GROUP)]
    pub group_size: usize,
    /// The checkpoint directory (safetensors).
    pub src: PathBuf,
    /// The LM GGUF file to write, the vision file going beside it as `mmproj-<name>`; for
    /// w8a8, w4a16 and fp8-block the directory to write.
    pub dst: PathBuf,
}

pub fn run(args: QuantizeArgs) -> anyhow::Result<ExitCode> {
    let dir = match args.scheme {
        QuantScheme::Gguf(s) => Err(s),
        QuantScheme::W8A8 => Ok(vlm_model::w8a8::quantize_checkpoint_w8a8(
            &args.src, &args.dst,
        )),
        QuantScheme::W4A16 => Ok(vlm_model::w4a16::quantize_checkpoint_w4a16(
            &args.src,
            &args.dst,
            args.group_size,
        )),
        QuantScheme::Fp8Block => Ok(vlm_model::fp8::quantize_checkpoint_fp8(
            &args.src,
            &args.dst,
            args.group_size,
        )),
    };
    let scheme = match dir {
        Err(s) => s,
        Ok(written) => {
            written.with_context(|| format!("quantizing {}", args.src.display()))?;
            println!("wrote {}", args.dst.display());
            return Ok(ExitCode::SUCCESS);
        }
    };
    let name = args
        .dst
        .file_name()
        .context("DST must be a file name")?
        .to_string_lossy()
        .into_owned();
    let mmproj = args.dst.with_file_name(format!("mmproj-{name}"));
    quantize_checkpoint(&args.src, scheme, &args.dst, &mmproj)
        .with_context(|| format!("quantizing {}", args.src.display()))?;
    println!("wrote {} and {}", args.dst.display(), mmproj.display());
    Ok(ExitCode::SUCCESS)
}
