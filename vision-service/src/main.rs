//! `vision-service`: parses flags (each also an environment variable), reads the deployment
//! config, applies the overrides, and runs the service until SIGTERM / Ctrl-C.
use anyhow::Context;
use clap::Parser;
use std::net::SocketAddr;
use std::path::PathBuf;
use vlm_vision_service::Options;

#[derive(Debug, Parser)]
#[command(
    name = "vision-service",
    version,
    about = "Qwen3-VL ViT behind gRPC (vlm.v1.Vision)"
)]
struct Args {
    /// Checkpoint directory (config.json + *.safetensors), or a GGUF LM file with --mmproj.
    #[arg(long, env = "VLM_MODEL")]
    model: PathBuf,
    /// The GGUF vision file when --model is a GGUF LM file (llama.cpp's flag name).
    #[arg(long, env = "VLM_MMPROJ")]
    mmproj: Option<PathBuf>,
    /// Deployment config (JSON, YAML or TOML); without it, vlm-config's defaults.
    #[arg(long, env = "VLM_CONFIG")]
    config: Option<PathBuf>,
    /// gRPC address (port 0: any free port; the bound one is printed).
    #[arg(long, env = "VLM_VISION_LISTEN", default_value = "0.0.0.0:50061")]
    listen: SocketAddr,
    /// Prometheus `/metrics` address.
    #[arg(
        long,
        env = "VLM_VISION_METRICS_LISTEN",
        default_value = "0.0.0.0:9461"
    )]
    metrics_listen: SocketAddr,
    /// Device pool, overriding `visual.device` (comma-separated ids: CPU cores, or GPU ordinals
    /// in the CUDA build).
    #[arg(long, env = "VLM_VISION_DEVICE", value_delimiter = ',')]
    device: Option<Vec<u32>>,
    /// Images admitted and not finished at most; more wait their turn.
    #[arg(long, env = "VLM_VISION_QUEUE_CAPACITY", default_value_t = 16)]
    queue_capacity: usize,
    /// Images waiting for a queue slot at most; more is RESOURCE_EXHAUSTED.
    #[arg(long, env = "VLM_VISION_MAX_WAITING_IMAGES", default_value_t = vlm_vision_service::DEFAULT_MAX_WAITING_IMAGES)]
    max_waiting_images: usize,
    /// How long a request's images may wait for their first queue slots (ms); then
    /// RESOURCE_EXHAUSTED.
    #[arg(long, env = "VLM_VISION_MAX_QUEUE_WAIT_MS", default_value_t = vlm_vision_service::DEFAULT_MAX_QUEUE_WAIT.as_millis() as u64)]
    max_queue_wait_ms: u64,
    /// Images whose header says more pixels than this are refused before decoding.
    #[arg(long, env = "VLM_VISION_MAX_DECODE_PIXELS", default_value_t = vlm_preprocess::DEFAULT_MAX_DECODE_PIXELS)]
    max_decode_pixels: u64,
    /// Most raw value bytes per streamed chunk (at most 1 MiB).
    #[arg(long, env = "VLM_VISION_MAX_CHUNK_BYTES", default_value_t = 1 << 20)]
    max_chunk_bytes: usize,
    /// Largest Encode request accepted, in bytes.
    #[arg(long, env = "VLM_VISION_MAX_REQUEST_BYTES", default_value_t = 64 << 20)]
    max_request_bytes: usize,
    /// On SIGTERM, milliseconds to keep accepting calls after reporting NOT_SERVING.
    #[arg(long, env = "VLM_VISION_DRAIN_DELAY_MS", default_value_t = 0)]
    drain_delay_ms: u64,
    /// Run an image that is alone in the pool on all of the pool's cores (false: every image on
    /// one device, several images side by side).
    #[arg(long, env = "VLM_VISION_SPREAD_LONE_IMAGES", default_value_t = true, action = clap::ArgAction::Set)]
    spread_lone_images: bool,
    /// MiB of embeddings kept for images and video temporal groups sent again (keyed by the
    /// SHA-256 of their bytes and resize; entries not read since they came in go first); 0 turns
    /// it off.
    #[arg(long, env = "VLM_VISION_EMBED_CACHE_MIB", default_value_t = vlm_vision_service::DEFAULT_EMBED_CACHE_BYTES >> 20)]
    embed_cache_mib: u64,
    /// File holding the shared token callers of vlm.v1.Vision must send (a mounted Secret;
    /// re-read when it changes). Health and reflection stay open.
    #[arg(long, env = "VLM_INTERNAL_TOKEN_FILE")]
    internal_token_file: Option<PathBuf>,
    #[command(flatten)]
    internal_tls: vlm_service_kit::internal_tls::args::InternalTlsArgs,
    #[command(flatten)]
    grpc_conn: vlm_service_kit::conn::GrpcConnArgs,
    /// AVIF images are parsed by FFmpeg in a child process per image (a fault ends that
    /// request only); `in-process` parses them in the service itself. Other formats decode in
    /// process with the image crate.
    #[arg(long, env = "VLM_VISION_MEDIA_DECODING", default_value = "isolated", value_parser = ["isolated", "in-process"])]
    media_decoding: String,
}

fn options(args: Args) -> anyhow::Result<Options> {
    // A GGUF pair is read through the checkpoint files derived from it, in $TMPDIR/vlm-gguf.
    let model = vlm_model::gguf::resolve_model(
        &args.model,
        args.mmproj.as_deref(),
        &std::env::temp_dir().join("vlm-gguf"),
    )?;
    let cfg = vlm_service_kit::config::load_deploy_config(args.config.as_deref(), &model)
        .map_err(anyhow::Error::msg)?;
    let mut visual = cfg.visual;
    if let Some(device) = args.device {
        anyhow::ensure!(!device.is_empty(), "--device lists no device");
        visual.num_devices = device.len() as u32;
        visual.device = device;
    }
    let opts = Options {
        model_dir: model,
        visual,
        listen: args.listen,
        metrics_listen: args.metrics_listen,
        queue_capacity: args.queue_capacity,
        max_waiting_images: args.max_waiting_images,
        max_queue_wait: std::time::Duration::from_millis(args.max_queue_wait_ms),
        max_decode_pixels: args.max_decode_pixels,
        media_decoding: match args.media_decoding.as_str() {
            "in-process" => vlm_preprocess::worker::MediaDecoding::InProcess,
            _ => vlm_preprocess::worker::MediaDecoding::Isolated {
                exe: std::env::current_exe().context("locating the vision-service executable")?,
            },
        },
        max_chunk_bytes: args.max_chunk_bytes,
        max_request_bytes: args.max_request_bytes,
        drain_delay: std::time::Duration::from_millis(args.drain_delay_ms),
        spread_lone_images: args.spread_lone_images,
        embed_cache_bytes: args.embed_cache_mib << 20,
        internal_token: args
            .internal_token_file
            .as_deref()
            .map(vlm_service_kit::internal_auth::InternalToken::from_file)
            .transpose()?,
        internal_tls: args.internal_tls.load()?,
        grpc_conn: args.grpc_conn.options()?,
    };
    opts.validate()?;
    Ok(opts)
}

fn main() -> anyhow::Result<()> {
    // A child started to parse one file with FFmpeg (`vlm_preprocess::worker`).
    if std::env::args().nth(1).as_deref() == Some(vlm_preprocess::worker::WORKER_FLAG) {
        std::process::exit(vlm_preprocess::worker::serve_stdio());
    }
    let args = Args::parse();
    let _telemetry = vlm_service_kit::telemetry::init("vision-service");
    let opts = options(args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("vision-io")
        .enable_all()
        .build()
        .context("tokio runtime")?;
    runtime.block_on(vlm_vision_service::run(
        opts,
        vlm_service_kit::shutdown::shutdown_signal(),
    ))?;
    Ok(())
}
