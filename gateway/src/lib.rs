//! The gateway: the public face of the split Qwen3-VL service. gRPC `vlm.v1.Gateway` and an
//! OpenAI-compatible HTTP API in front of LM and vision replicas.
//!
//! A request flows `validation` (a [`validation::ValidRequest`]) -> `admission` (a permit, or
//! RESOURCE_EXHAUSTED / 429 at once) -> `routing` (an LM and a vision replica) -> `generate`
//! (the LM stream turned into text deltas by `stream`) -> the edge (`service` or `openai`).
pub mod admission;
pub mod auth;
pub mod client;
pub mod cors;
pub mod error;
pub mod fetch;
pub mod generate;
pub mod http_serve;
pub mod logprobs;
pub mod metrics;
pub mod openai;
pub mod response_format;
pub mod routing;
pub mod sampling_defaults;
pub mod service;
pub mod stream;
pub mod tool_calls;
pub mod validation;
pub mod video;

pub use error::{GatewayError, ServeError};

use admission::{Admission, AdmissionLimits};
use auth::ApiKeys;
use routing::{ReplicaSource, Router, RoutingOptions};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use tokio_util::sync::CancellationToken;
use validation::{Limits, Validator};
use vlm_config::DeployConfig;
use vlm_service_kit::server::{self, GrpcListener, GrpcServer};

/// Everything `run` needs, already validated by the binary.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    pub listen: SocketAddr,
    pub http_listen: SocketAddr,
    pub lm: ReplicaSource,
    pub vision: ReplicaSource,
    /// Checkpoint directory (tokenizer and chat template).
    pub model_dir: PathBuf,
    pub deploy: DeployConfig,
    pub api_keys: ApiKeys,
    pub admission: AdmissionLimits,
    pub max_images: usize,
    pub max_body_bytes: usize,
    /// Ceilings on videos (per request, frames, decode work).
    pub max_videos: usize,
    pub max_video_frames: u32,
    pub max_video_source_frames: u32,
    pub video_decode_threads: usize,
    pub media_decoding: vlm_preprocess::worker::MediaDecoding,
    /// Special tokens written in message content are control tokens (injectable); off: text.
    pub control_tokens_in_content: bool,
    /// Where the OpenAI API's sampling defaults come from (`--generation-config`).
    pub generation_config: sampling_defaults::GenerationConfig,
    /// The internal APIs' shared token, sent to the LM and vision replicas.
    pub internal_token: Option<std::sync::Arc<vlm_service_kit::internal_auth::InternalToken>>,
    /// Mutual TLS to the LM and vision replicas (`--internal-tls-*`); `None`: plain HTTP/2.
    pub internal_tls: Option<std::sync::Arc<vlm_service_kit::internal_tls::InternalTls>>,
    /// Keepalive, connection cap and handshake deadline of the gRPC port; the keepalive also
    /// of the channels to the replicas (a frozen LM fails the calls open to it).
    pub grpc_conn: vlm_service_kit::conn::GrpcConnOptions,
    /// Hosts, byte limit, deadline and extra CA roots for http(s) image URLs.
    pub image_fetch: fetch::FetchOptions,
    pub routing: RoutingOptions,
    /// Timeouts and the connection cap of the HTTP port.
    pub http: http_serve::HttpLimits,
    /// Origins browser apps may call the HTTP API from (none: CORS off).
    pub cors: cors::CorsOrigins,
}

/// The checkpoint's `video_preprocessor_config.json` over Qwen3-VL's video defaults (absent:
/// the defaults).
fn read_video_processor(
    dir: &std::path::Path,
) -> Result<vlm_config::video::VideoProcessorConfig, ServeError> {
    let path = dir.join("video_preprocessor_config.json");
    match std::fs::read_to_string(&path) {
        Ok(text) => vlm_config::video::VideoProcessorConfig::from_json(&text)
            .map_err(|m| ServeError::Config(format!("{}: {m}", path.display()))),
        Err(_) => Ok(Default::default()),
    }
}

/// gRPC service name for health.
pub const SERVICE_NAME: &str = "vlm.v1.Gateway";

/// A bound gateway: addresses known, not serving yet.
pub struct Bound {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    grpc: GrpcListener,
    http: tokio::net::TcpListener,
    core: generate::Core,
    cfg: GatewayConfig,
}

/// Loads the tokenizer and binds both listeners.
pub async fn bind(cfg: GatewayConfig) -> Result<Bound, ServeError> {
    let _ = vlm_service_kit::metrics_http::recorder();
    crate::metrics::describe();
    let tokenizer = vlm_tokenizer::ChatTokenizer::from_dir(&cfg.model_dir)
        .map_err(|e| ServeError::Tokenizer {
            dir: cfg.model_dir.display().to_string(),
            message: e.to_string(),
        })?
        .with_control_tokens_in_content(cfg.control_tokens_in_content);
    tracing::info!(
        max_body_bytes = cfg.max_body_bytes,
        max_images = cfg.max_images,
        max_seq_len = cfg.deploy.max_seq_len,
        control_tokens_in_content = cfg.control_tokens_in_content,
        max_videos = cfg.max_videos,
        max_video_frames = cfg.max_video_frames,
        max_video_source_frames = cfg.max_video_source_frames,
        video_decode_threads = cfg.video_decode_threads,
        media_decoding = %cfg.media_decoding.describe(),
        internal_tls = ?cfg.internal_tls.as_ref().map(|t| t.files()),
        internal_token = cfg.internal_token.is_some(),
        http_header_read_timeout_ms = cfg.http.header_read_timeout.as_millis() as u64,
        http_body_read_timeout_ms = cfg.http.body_read_timeout.as_millis() as u64,
        http_idle_timeout_ms = cfg.http.idle_timeout.as_millis() as u64,
        http_max_connections = cfg.http.max_connections,
        cors_allow_origins = ?cfg.cors.shown(),
        "gateway limits"
    );
    let video_processor = read_video_processor(&cfg.model_dir)?;
    tracing::info!(?video_processor, "video processor");
    let model_id = cfg
        .model_dir
        .canonicalize()
        .unwrap_or_else(|_| cfg.model_dir.clone())
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let mut limits = Limits::from_config(&cfg.deploy, cfg.max_images, cfg.max_body_bytes);
    limits.video = video::VideoLimits {
        max_videos: cfg.max_videos,
        max_frames: cfg.max_video_frames,
        max_source_frames: cfg.max_video_source_frames,
        decode_threads: cfg.video_decode_threads,
        decoding: cfg.media_decoding.clone(),
        ..video::VideoLimits::from_processor(&video_processor)
    };
    let sampling_defaults =
        sampling_defaults::SamplingDefaults::read(&cfg.model_dir, cfg.generation_config)?;
    tracing::info!(
        generation_config = ?cfg.generation_config,
        ?sampling_defaults,
        "OpenAI API sampling defaults for fields a request leaves out"
    );
    let validator = Validator::new(tokenizer, cfg.deploy.visual.clone(), limits, model_id)
        .with_video_processor(video_processor)
        .with_sampling_defaults(sampling_defaults);
    // Prefix routing only pays when the LMs cache prefixes; their blocks are
    // `kvcache_partition_len` tokens (the gateway reads the same deployment config).
    let router = Router::new(cfg.lm.clone(), cfg.vision.clone(), cfg.routing)
        .with_prefix_routing(
            cfg.deploy
                .prefix_caching
                .then_some(cfg.deploy.kvcache_partition_len),
        )
        .with_internal_token(cfg.internal_token.clone())
        .with_internal_tls(cfg.internal_tls.clone())
        .with_keepalive(cfg.grpc_conn.keepalive);
    let core = generate::Core::new(validator, Admission::new(cfg.admission), router);
    let grpc = server::bind_grpc(cfg.listen)
        .await
        .map_err(|e| ServeError::Bind {
            what: e.what,
            addr: e.addr.to_string(),
            source: e.source,
        })?;
    // The HTTP API (OpenAI, /health, /metrics) is the gateway's own.
    let http_error = |source| ServeError::Bind {
        what: "HTTP",
        addr: cfg.http_listen.to_string(),
        source,
    };
    let http = tokio::net::TcpListener::bind(cfg.http_listen)
        .await
        .map_err(http_error)?;
    let http_addr = http.local_addr().map_err(http_error)?;
    Ok(Bound {
        grpc_addr: grpc.addr,
        http_addr,
        grpc,
        http,
        core,
        cfg,
    })
}

impl Bound {
    /// Prints `listening grpc=ADDR http=ADDR` on stdout.
    pub fn announce(&self) {
        server::announce(&[("grpc", self.grpc_addr), ("http", self.http_addr)]);
    }

    /// Serves until `shutdown` completes, then drains: health goes NOT_SERVING, new requests
    /// are refused, and running streams finish before this returns. Health follows replica
    /// readiness until then.
    pub async fn serve(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        let Bound {
            grpc,
            http,
            core,
            cfg,
            ..
        } = self;
        let stop = CancellationToken::new();
        let router = core.router().clone();
        router.start(stop.clone()).await;

        // A message over the decoding limit is RESOURCE_EXHAUSTED (GrpcServer::add_service).
        let svc = tonic::service::interceptor::InterceptedService::new(
            vlm_proto::v1::gateway_server::GatewayServer::new(service::GatewayService::new(
                core.clone(),
            ))
            // Room over the body limit, so that validation answers an oversized request with
            // INVALID_ARGUMENT naming --max-body-bytes instead of a transport error.
            .max_decoding_message_size(cfg.max_body_bytes.saturating_mul(4).max(64 << 20)),
            cfg.api_keys.interceptor(),
        );
        let drain_stop = stop.clone();
        let admission = core.admission().clone();
        let grpc_task = GrpcServer::on_listener(grpc, SERVICE_NAME)
            .add_service(svc)
            .conn(cfg.grpc_conn)
            .health_follows(router.ready())
            .on_drain(async move {
                tracing::info!("draining: refusing new requests, finishing running ones");
                // Stops the replica polling and the HTTP API (which finishes its streams).
                drain_stop.cancel();
                admission.drain();
            })
            // Nothing to load: the tokenizer was loaded by `bind`; readiness is the replicas'.
            .serve(async { Ok::<(), Infallible>(()) }, shutdown);

        let state = openai::HttpState {
            core: core.clone(),
            keys: cfg.api_keys.clone(),
            ready: router.ready(),
            metrics: vlm_service_kit::metrics_http::recorder(),
            images: fetch::ImageFetcher::new(cfg.image_fetch.clone()),
        };
        let app = cfg.cors.apply(openai::router(state));
        let http_task = http_serve::serve(http, app, cfg.http, stop.clone());
        let (g, ()) = tokio::join!(grpc_task, http_task);
        let stopped = g.map_err(|e| match e {
            server::ServeError::Reflection(e) => ServeError::Reflection(e.to_string()),
            server::ServeError::Load(never) => match never {},
        })?;
        stopped
            .served
            .map_err(|e| ServeError::Grpc(e.to_string()))?;
        Ok(())
    }
}

/// [`bind`] then [`Bound::serve`].
pub async fn run(
    cfg: GatewayConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    bind(cfg).await?.serve(shutdown).await
}
