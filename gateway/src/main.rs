//! `gateway`: parses flags (each also an environment variable), validates, calls the library.
use anyhow::Context;
use clap::Parser;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use vlm_gateway::admission::AdmissionLimits;
use vlm_gateway::auth::ApiKeys;
use vlm_gateway::cors::CorsOrigins;
use vlm_gateway::fetch::FetchOptions;
use vlm_gateway::http_serve::HttpLimits;
use vlm_gateway::routing::{ReplicaSource, RoutingOptions};
use vlm_gateway::{video, GatewayConfig};

#[derive(Parser, Debug)]
#[command(
    name = "gateway",
    version,
    about = "vlm gateway: gRPC and OpenAI-compatible HTTP in front of LM and vision replicas"
)]
struct Args {
    /// gRPC listen address.
    #[arg(long, env = "VLM_GATEWAY_LISTEN", default_value = "0.0.0.0:50051")]
    listen: SocketAddr,
    /// HTTP listen address (OpenAI API, /health, /metrics).
    #[arg(long, env = "VLM_GATEWAY_HTTP_LISTEN", default_value = "0.0.0.0:8080")]
    http_listen: SocketAddr,
    /// Vision replicas: host:port,... or dns:///name:port.
    #[arg(long, env = "VLM_VISION_ADDRS")]
    vision: String,
    /// LM replicas: host:port,... or dns:///name:port.
    #[arg(long, env = "VLM_LM_ADDRS")]
    lm: String,
    /// Checkpoint directory (tokenizer.json and the chat template), or a GGUF LM file with
    /// --mmproj (the tokenizer and template from its metadata).
    #[arg(long, env = "VLM_MODEL")]
    model: PathBuf,
    /// The GGUF vision file when --model is a GGUF LM file (llama.cpp's flag name).
    #[arg(long, env = "VLM_MMPROJ")]
    mmproj: Option<PathBuf>,
    /// Deployment config (JSON, YAML or TOML); the defaults when absent.
    #[arg(long, env = "VLM_CONFIG")]
    config: Option<PathBuf>,
    /// File of API keys, one per line.
    #[arg(long, env = "VLM_API_KEY_FILE")]
    api_key_file: Option<PathBuf>,
    /// Requests generating at once.
    #[arg(long, env = "VLM_GATEWAY_MAX_IN_FLIGHT", default_value_t = 64)]
    max_in_flight: usize,
    /// Requests waiting for admission; beyond this, RESOURCE_EXHAUSTED / 429.
    #[arg(long, env = "VLM_GATEWAY_MAX_QUEUE", default_value_t = 256)]
    max_queue: usize,
    /// KV tokens (prompt + max_tokens) of running requests; 0 = no budget.
    #[arg(long, env = "VLM_GATEWAY_MAX_KV_TOKENS_IN_FLIGHT", default_value_t = 0)]
    max_kv_tokens_in_flight: u64,
    /// Images per request.
    #[arg(long, env = "VLM_GATEWAY_MAX_IMAGES", default_value_t = 8)]
    max_images: usize,
    /// Videos per request (0 refuses videos).
    #[arg(long, env = "VLM_GATEWAY_MAX_VIDEOS", default_value_t = video::DEFAULT_MAX_VIDEOS)]
    max_videos: usize,
    /// Frames sampled from one video, whatever its fps or num_frames asks.
    #[arg(long, env = "VLM_GATEWAY_MAX_VIDEO_FRAMES", default_value_t = video::DEFAULT_MAX_VIDEO_FRAMES)]
    max_video_frames: u32,
    /// Frames of a video file the gateway decodes to reach the sampled ones (the decode work of
    /// one video): 18000 is 10 minutes at 30 fps.
    #[arg(
        long,
        env = "VLM_GATEWAY_MAX_VIDEO_SOURCE_FRAMES",
        default_value_t = video::DEFAULT_MAX_VIDEO_SOURCE_FRAMES
    )]
    max_video_source_frames: u32,
    /// Video files and AVIF images are parsed by FFmpeg in a child process per call (a fault
    /// ends that request only); `in-process` parses them in the gateway itself.
    #[arg(long, env = "VLM_GATEWAY_MEDIA_DECODING", default_value = "isolated", value_parser = ["isolated", "in-process"])]
    media_decoding: String,
    /// Decoder threads of one video file (0: FFmpeg takes one per core).
    #[arg(long, env = "VLM_GATEWAY_VIDEO_DECODE_THREADS", default_value_t = video::DEFAULT_VIDEO_DECODE_THREADS)]
    video_decode_threads: usize,
    /// Bytes of one request body.
    #[arg(long, env = "VLM_GATEWAY_MAX_BODY_BYTES", default_value_t = 32 << 20)]
    max_body_bytes: usize,
    /// Special tokens written in message content (`<|im_start|>`, ...) encode as control
    /// tokens, as transformers' apply_chat_template does. Off by default: they are text, so a
    /// user cannot close their turn and open a system one.
    #[arg(long, env = "VLM_GATEWAY_CONTROL_TOKENS_IN_CONTENT")]
    control_tokens_in_content: bool,
    /// The OpenAI API's defaults for temperature, top_p, top_k, min_p and repetition_penalty
    /// when a request leaves them out: `auto`, the checkpoint's generation_config.json (as
    /// vLLM's default); `none`, OpenAI's (temperature 1, nothing truncated).
    #[arg(
        long,
        env = "VLM_GATEWAY_GENERATION_CONFIG",
        value_enum,
        default_value = "auto"
    )]
    generation_config: vlm_gateway::sampling_defaults::GenerationConfig,
    /// File holding the shared token the LM and vision replicas require (a mounted Secret;
    /// re-read when it changes).
    #[arg(long, env = "VLM_INTERNAL_TOKEN_FILE")]
    internal_token_file: Option<PathBuf>,
    #[command(flatten)]
    internal_tls: vlm_service_kit::internal_tls::args::InternalTlsArgs,
    #[command(flatten)]
    grpc_conn: vlm_service_kit::conn::GrpcConnArgs,
    /// Hosts http:// and https:// image URLs may be fetched from (repeatable or
    /// comma-separated); none by default.
    #[arg(
        long = "allow-image-host",
        env = "VLM_GATEWAY_ALLOW_IMAGE_HOSTS",
        value_delimiter = ','
    )]
    allow_image_host: Vec<String>,
    /// Bytes of one image fetched from an http(s) URL; default: --max-body-bytes.
    #[arg(long, env = "VLM_GATEWAY_IMAGE_FETCH_MAX_BYTES")]
    image_fetch_max_bytes: Option<usize>,
    /// Deadline for fetching one image URL (connect, TLS handshake, headers and body), in
    /// milliseconds.
    #[arg(
        long,
        env = "VLM_GATEWAY_IMAGE_FETCH_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    image_fetch_timeout_ms: u64,
    /// PEM file of CA certificates (one or more) trusted for https:// image URLs besides the
    /// bundled Mozilla roots: for hosts whose certificates a private CA signs.
    #[arg(long, env = "VLM_GATEWAY_IMAGE_FETCH_CA_FILE")]
    image_fetch_ca_file: Option<PathBuf>,
    /// How often replicas are polled for health and load, in milliseconds.
    #[arg(long, env = "VLM_GATEWAY_POLL_MS", default_value_t = 500)]
    poll_ms: u64,
    /// Prefix routing: a request's preferred LM replica (the one its first KV block hashes to)
    /// is passed over for the least-loaded one when it has more than this many requests open
    /// from this gateway beyond that one (or it has requests waiting and another has none).
    #[arg(long, env = "VLM_GATEWAY_PREFIX_BUSY_MARGIN", default_value_t = 4)]
    prefix_busy_margin: usize,
    /// HTTP: a request's headers must be complete within this many milliseconds of the
    /// connection's accept (or of the request's first byte, on a kept-alive connection).
    #[arg(
        long,
        env = "VLM_GATEWAY_HTTP_HEADER_READ_TIMEOUT_MS",
        default_value_t = 30_000
    )]
    http_header_read_timeout_ms: u64,
    /// HTTP: a request's body must arrive within this many milliseconds of its headers.
    #[arg(
        long,
        env = "VLM_GATEWAY_HTTP_BODY_READ_TIMEOUT_MS",
        default_value_t = 60_000
    )]
    http_body_read_timeout_ms: u64,
    /// HTTP: a kept-alive connection with no request for this many milliseconds is closed.
    #[arg(
        long,
        env = "VLM_GATEWAY_HTTP_IDLE_TIMEOUT_MS",
        default_value_t = 75_000
    )]
    http_idle_timeout_ms: u64,
    /// HTTP connections open at once; one over the cap is closed as it is accepted (keep it
    /// under the process's file limit, `ulimit -n`).
    #[arg(long, env = "VLM_GATEWAY_HTTP_MAX_CONNECTIONS", default_value_t = 4096)]
    http_max_connections: usize,
    /// Origins (scheme://host[:port], or *) whose browser apps may call the HTTP API
    /// (repeatable or comma-separated); none by default: CORS off.
    #[arg(
        long = "cors-allow-origin",
        env = "VLM_GATEWAY_CORS_ALLOW_ORIGINS",
        value_delimiter = ','
    )]
    cors_allow_origin: Vec<String>,
}

fn main() -> anyhow::Result<()> {
    // A child started to parse one file with FFmpeg (`vlm_preprocess::worker`).
    if std::env::args().nth(1).as_deref() == Some(vlm_preprocess::worker::WORKER_FLAG) {
        std::process::exit(vlm_preprocess::worker::serve_stdio());
    }
    let _telemetry = vlm_service_kit::telemetry::init("gateway");
    let a = Args::parse();
    if a.max_in_flight == 0 {
        anyhow::bail!("--max-in-flight must be at least 1");
    }
    if a.http_header_read_timeout_ms == 0
        || a.http_body_read_timeout_ms == 0
        || a.http_idle_timeout_ms == 0
        || a.http_max_connections == 0
    {
        anyhow::bail!(
            "--http-header-read-timeout-ms, --http-body-read-timeout-ms, --http-idle-timeout-ms \
             and --http-max-connections must be at least 1"
        );
    }
    if a.image_fetch_max_bytes == Some(0) || a.image_fetch_timeout_ms == 0 {
        anyhow::bail!("--image-fetch-max-bytes and --image-fetch-timeout-ms must be at least 1");
    }
    let extra_roots = match &a.image_fetch_ca_file {
        Some(path) => vlm_gateway::fetch::read_ca_file(path).map_err(anyhow::Error::msg)?,
        None => Vec::new(),
    };
    let cors = CorsOrigins::parse(&a.cors_allow_origin)?;
    // A GGUF pair is read through the checkpoint files derived from it, in $TMPDIR/vlm-gguf.
    let model = vlm_model::gguf::resolve_model(
        &a.model,
        a.mmproj.as_deref(),
        &std::env::temp_dir().join("vlm-gguf"),
    )?;
    let deploy = vlm_service_kit::config::load_deploy_config(a.config.as_deref(), &model)
        .map_err(anyhow::Error::msg)?;
    let api_keys = ApiKeys::load(a.api_key_file.as_deref(), std::env::var("VLM_API_KEY").ok())
        .with_context(|| format!("reading --api-key-file {:?}", a.api_key_file))?;
    let cfg = GatewayConfig {
        listen: a.listen,
        http_listen: a.http_listen,
        lm: ReplicaSource::parse(&a.lm).map_err(|e| anyhow::anyhow!("--lm: {e}"))?,
        vision: ReplicaSource::parse(&a.vision).map_err(|e| anyhow::anyhow!("--vision: {e}"))?,
        model_dir: model,
        deploy,
        api_keys,
        admission: AdmissionLimits {
            max_in_flight: a.max_in_flight,
            max_queue: a.max_queue,
            max_kv_tokens: a.max_kv_tokens_in_flight,
        },
        max_images: a.max_images,
        max_body_bytes: a.max_body_bytes,
        max_videos: a.max_videos,
        max_video_frames: a.max_video_frames,
        max_video_source_frames: a.max_video_source_frames,
        video_decode_threads: a.video_decode_threads,
        media_decoding: match a.media_decoding.as_str() {
            "in-process" => vlm_preprocess::worker::MediaDecoding::InProcess,
            _ => vlm_preprocess::worker::MediaDecoding::Isolated {
                exe: std::env::current_exe().context("locating the gateway executable")?,
            },
        },
        control_tokens_in_content: a.control_tokens_in_content,
        generation_config: a.generation_config,
        internal_token: a
            .internal_token_file
            .as_deref()
            .map(vlm_service_kit::internal_auth::InternalToken::from_file)
            .transpose()?,
        internal_tls: a.internal_tls.load()?,
        grpc_conn: a.grpc_conn.options()?,
        image_fetch: FetchOptions {
            allow_hosts: a.allow_image_host,
            max_bytes: a.image_fetch_max_bytes.unwrap_or(a.max_body_bytes),
            timeout: Duration::from_millis(a.image_fetch_timeout_ms),
            extra_roots,
        },
        routing: RoutingOptions {
            poll_interval: Duration::from_millis(a.poll_ms.max(10)),
            prefix_busy_margin: a.prefix_busy_margin,
            ..Default::default()
        },
        http: HttpLimits {
            header_read_timeout: Duration::from_millis(a.http_header_read_timeout_ms),
            body_read_timeout: Duration::from_millis(a.http_body_read_timeout_ms),
            idle_timeout: Duration::from_millis(a.http_idle_timeout_ms),
            max_connections: a.http_max_connections,
        },
        cors,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let bound = vlm_gateway::bind(cfg).await?;
        bound.announce();
        bound
            .serve(vlm_service_kit::shutdown::shutdown_signal())
            .await?;
        tracing::info!("drained; bye");
        Ok(())
    })
}
