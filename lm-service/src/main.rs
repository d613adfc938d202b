//! `lm-service`: the LM replica binary. Parses flags (each also an environment variable),
//! loads the deployment config, and calls [`vlm_lm_service::run`].
use clap::Parser;
use std::net::SocketAddr;
use std::path::PathBuf;
use vlm_lm_service::{
    ReplicaSource, ServeConfig, DEFAULT_EMBEDDING_CACHE_BYTES,
    DEFAULT_PREFILL_TOKENS_WHILE_DECODING,
};

#[derive(Debug, Parser)]
#[command(
    name = "lm-service",
    about = "Qwen3-VL LM replica: decoder graphs, paged KV cache, continuous batching"
)]
struct Args {
    /// Checkpoint directory (config.json, *.safetensors), or a GGUF LM file with --mmproj.
    #[arg(long, env = "VLM_MODEL")]
    model: PathBuf,
    /// The GGUF vision file when --model is a GGUF LM file (llama.cpp's flag name).
    #[arg(long, env = "VLM_MMPROJ")]
    mmproj: Option<PathBuf>,
    /// Deployment config (JSON, YAML or TOML); defaults apply when absent.
    #[arg(long, env = "VLM_CONFIG")]
    config: Option<PathBuf>,
    /// gRPC address; port 0 picks a free port (printed on stdout).
    #[arg(long, env = "VLM_LM_LISTEN", default_value = "0.0.0.0:50062")]
    listen: SocketAddr,
    /// Prometheus /metrics address.
    #[arg(long, env = "VLM_LM_METRICS_LISTEN", default_value = "0.0.0.0:9462")]
    metrics_listen: SocketAddr,
    /// Device pool (CPU cores), e.g. "0,1,2,3"; overrides the config's `device`.
    #[arg(long, env = "VLM_LM_DEVICE", value_delimiter = ',')]
    device: Option<Vec<u32>>,
    /// Bytes of image embeddings kept by content hash.
    #[arg(long, env = "VLM_LM_EMBEDDING_CACHE_BYTES", default_value_t = DEFAULT_EMBEDDING_CACHE_BYTES)]
    embedding_cache_bytes: usize,
    /// Prompt tokens a step computes while sequences decode (at most `prefill_chunk_size`; 0:
    /// `prefill_chunk_size`, as when none do). Smaller: running streams get a token sooner
    /// during a long prompt's prefill, at the cost of more steps for that prompt.
    #[arg(
        long,
        env = "VLM_LM_PREFILL_TOKENS_WHILE_DECODING",
        default_value_t = DEFAULT_PREFILL_TOKENS_WHILE_DECODING
    )]
    prefill_tokens_while_decoding: u32,
    /// The vision replicas this LM may pull image embeddings from: `host:port,host:port` or
    /// `dns:///name:port` (a headless Service). Requests name one of them; the LM dials no
    /// other address. Without it, images missing from the embedding cache are refused.
    #[arg(long, env = "VLM_LM_VISION")]
    vision: Option<String>,
    /// File holding the shared token of the internal APIs (a mounted Secret; re-read when it
    /// changes): callers of vlm.v1.Lm must send it, and the LM sends it to vision.
    #[arg(long, env = "VLM_INTERNAL_TOKEN_FILE")]
    internal_token_file: Option<PathBuf>,
    #[command(flatten)]
    internal_tls: vlm_service_kit::internal_tls::args::InternalTlsArgs,
    #[command(flatten)]
    grpc_conn: vlm_service_kit::conn::GrpcConnArgs,
}

fn main() -> anyhow::Result<()> {
    // candle's quantized matmul runs on a barrier pool of its own, sized from this variable
    // when it is first used; the CPU backend runs those products as tasks of its own pool
    // instead (backends/cpu kernels/quantized.rs), so candle's pool is the calling thread.
    // Set before any thread starts.
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    let args = Args::parse();
    let _telemetry = vlm_service_kit::telemetry::init("lm-service");
    // A GGUF pair is read through the checkpoint files derived from it, in $TMPDIR/vlm-gguf.
    let model = vlm_model::gguf::resolve_model(
        &args.model,
        args.mmproj.as_deref(),
        &std::env::temp_dir().join("vlm-gguf"),
    )?;
    let mut deploy = vlm_service_kit::config::load_deploy_config(args.config.as_deref(), &model)
        .map_err(anyhow::Error::msg)?;
    if let Some(device) = args.device {
        anyhow::ensure!(!device.is_empty(), "--device needs at least one core id");
        deploy.num_devices = device.len() as u32;
        deploy.device = device;
    }
    let cfg = ServeConfig {
        model_dir: model,
        deploy,
        listen: args.listen,
        metrics_listen: args.metrics_listen,
        embedding_cache_bytes: args.embedding_cache_bytes,
        prefill_while_decoding: args.prefill_tokens_while_decoding,
        vision: args
            .vision
            .as_deref()
            .map(ReplicaSource::parse)
            .transpose()
            .map_err(|e| anyhow::anyhow!("--vision: {e}"))?,
        internal_token: args
            .internal_token_file
            .as_deref()
            .map(vlm_service_kit::internal_auth::InternalToken::from_file)
            .transpose()?,
        internal_tls: args.internal_tls.load()?,
        grpc_conn: args.grpc_conn.options()?,
    };
    if !cfg.deploy.create_runtimes {
        println!("{}", vlm_lm_service::dry_run(&cfg)?);
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(vlm_lm_service::run(
        cfg,
        vlm_service_kit::shutdown::shutdown_signal(),
    ))?;
    Ok(())
}
