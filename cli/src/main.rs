//! `vlm`: the operator's command line.
use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod cmd;

#[derive(Parser, Debug)]
#[command(
    name = "vlm",
    version,
    about = "Split Qwen3-VL serving: operator tools"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the whole system locally: vision-service, lm-service and gateway as child processes
    /// on loopback (the tiny random checkpoint when no --model is given).
    Up(cmd::up::UpArgs),
    /// Send a prompt (and images) to a gateway and print the stream as it arrives.
    Generate(cmd::generate::GenerateArgs),
    /// Work with the nested deployment config.
    #[command(subcommand)]
    Config(cmd::config::ConfigCommand),
    /// Show the resize, patch count, image tokens and ViT bucket of an image size, or the
    /// decode graph of an active batch.
    Bucket(cmd::bucket::BucketArgs),
    /// Will a layout fit? Memory per device before loading, and bucket advice from traffic.
    Plan(Box<cmd::plan::PlanArgs>),
    /// Write a checkpoint in the real Hugging Face layout with random weights.
    MakeModel(cmd::make_model::MakeModelArgs),
    /// Write a checkpoint as the GGUF pair llama.cpp loads (LM quantized: q8_0, q4_k_m, f16,
    /// bf16; vision f16), which `vlm up --model LM.gguf --mmproj V.gguf` serves, or as a
    /// compressed-tensors W8A8 or W4A16 directory (w8a8, w4a16), which `vlm up --model DIR`
    /// and vLLM serve.
    Quantize(cmd::quantize::QuantizeArgs),
    /// Run preprocessing, the ViT, prefill and greedy decoding in-process and write every
    /// intermediate to a safetensors file.
    Inspect(cmd::inspect::InspectArgs),
    /// Write a new CA and a certificate for the internal APIs' mutual TLS
    /// (--internal-tls-cert/-key/-ca), for a local stack or a test cluster.
    Certs(cmd::certs::CertsArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Up(a) => cmd::up::run(a),
        Command::Generate(a) => cmd::generate::run(a),
        Command::Config(c) => cmd::config::run(c),
        Command::Bucket(a) => cmd::bucket::run(a),
        Command::Plan(a) => cmd::plan::run(*a),
        Command::MakeModel(a) => cmd::make_model::run(a).map(|()| ExitCode::SUCCESS),
        Command::Quantize(a) => cmd::quantize::run(a),
        Command::Inspect(a) => cmd::inspect::run(a).map(|()| ExitCode::SUCCESS),
        Command::Certs(a) => cmd::certs::run(a).map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
