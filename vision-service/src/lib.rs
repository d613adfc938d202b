//! The vision service: the Qwen3-VL ViT, prepared at every configured input-length bucket,
//! behind `vlm.v1.Vision` (Encode streams merged embeddings and deepstack features in chunks;
//! Info describes the replica and its queue), with `grpc.health.v1`, reflection, Prometheus
//! metrics on a separate HTTP port and a graceful drain on SIGTERM.
//!
//! [`run`] is the whole life of the service; [`bind`] + [`Bound::serve`] are its two halves for
//! embedders that want the bound addresses first (benchmarks, tests).
pub mod convert;
pub mod encoder;
pub mod error;
pub mod service;

pub use error::{ServeError, VisionError};

use encoder::{DeviceSlot, Encoder, EncoderConfig};
use service::{EncoderSlot, VisionService};
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use vlm_config::VisualConfig;
use vlm_service_kit::server::{self, GrpcServer, Listeners};

/// The gRPC service name reported by `grpc.health.v1`.
pub const SERVICE_NAME: &str = "vlm.v1.Vision";

/// Everything the service runs with, validated by the binary.
/// Default size of the embedding cache: 256 MiB (about 180 images of 1024x1024 from the 2B
/// ViT in bf16: 1024 tokens x 2048 x 3 tensors x 2 bytes each).
pub const DEFAULT_EMBED_CACHE_BYTES: u64 = 256 << 20;

/// Images that may wait for a queue slot: enough for 64 concurrent requests of 8 images (the
/// gateway's default of 64 requests in flight, 8 images each); waiting costs only the
/// request's encoded bytes, which the call holds anyway.
pub const DEFAULT_MAX_WAITING_IMAGES: usize = 512;

/// How long a request's images may wait for their first slots: 64 requests of one 1024x1024
/// image each take ~10 min on two cores, so a burst that size is served, and a replica that
/// stopped making progress still answers within a bound.
pub const DEFAULT_MAX_QUEUE_WAIT: std::time::Duration = std::time::Duration::from_secs(600);

#[derive(Debug, Clone)]
pub struct Options {
    /// Checkpoint directory (config.json + safetensors).
    pub model_dir: PathBuf,
    /// The `visual` section of the deployment config (device overrides applied).
    pub visual: VisualConfig,
    pub listen: SocketAddr,
    pub metrics_listen: SocketAddr,
    /// Images admitted and unfinished at most.
    pub queue_capacity: usize,
    /// Images waiting for a queue slot at most; past that an Encode is refused at once.
    pub max_waiting_images: usize,
    /// How long a request's images may wait for their first queue slots.
    pub max_queue_wait: std::time::Duration,
    /// Header width * height above which an image is refused before decoding.
    pub max_decode_pixels: u64,
    /// Where FFmpeg parses AVIF images (`--media-decoding`): a child process per image, or
    /// this process.
    pub media_decoding: vlm_preprocess::worker::MediaDecoding,
    /// Most raw bytes per streamed chunk (at most 1 MiB).
    pub max_chunk_bytes: usize,
    /// Largest Encode request accepted, in bytes.
    pub max_request_bytes: usize,
    /// On shutdown, how long to keep accepting calls after reporting NOT_SERVING (so that load
    /// balancers and the gateway's health checks see it first).
    pub drain_delay: std::time::Duration,
    /// Run an image that is alone in the pool on all of the pool's cores (CPU pools of several
    /// cores); false: every image on one device.
    pub spread_lone_images: bool,
    /// Bytes of embeddings kept for images and video groups seen again (0: off).
    pub embed_cache_bytes: u64,
    /// The shared token callers of `vlm.v1.Vision` must send (`--internal-token-file`);
    /// `None`: no check.
    pub internal_token: Option<std::sync::Arc<vlm_service_kit::internal_auth::InternalToken>>,
    /// Mutual TLS on the gRPC port (`--internal-tls-*`); `None`: plain HTTP/2.
    pub internal_tls: Option<std::sync::Arc<vlm_service_kit::internal_tls::InternalTls>>,
    /// Keepalive, connection cap and handshake deadline of the gRPC port (`--grpc-*`).
    pub grpc_conn: vlm_service_kit::conn::GrpcConnOptions,
}

impl Options {
    /// Defaults for everything but the checkpoint; the config's `visual` defaults.
    pub fn new(model_dir: impl Into<PathBuf>) -> Options {
        Options {
            model_dir: model_dir.into(),
            visual: vlm_config::DeployConfig::default_config().visual,
            listen: SocketAddr::from(([0, 0, 0, 0], 50061)),
            metrics_listen: SocketAddr::from(([0, 0, 0, 0], 9461)),
            queue_capacity: 16,
            max_waiting_images: DEFAULT_MAX_WAITING_IMAGES,
            max_queue_wait: DEFAULT_MAX_QUEUE_WAIT,
            max_decode_pixels: vlm_preprocess::DEFAULT_MAX_DECODE_PIXELS,
            media_decoding: vlm_preprocess::worker::MediaDecoding::InProcess,
            max_chunk_bytes: encoder::chunk::MAX_CHUNK_BYTES,
            max_request_bytes: 64 << 20,
            drain_delay: std::time::Duration::ZERO,
            spread_lone_images: true,
            embed_cache_bytes: DEFAULT_EMBED_CACHE_BYTES,
            internal_token: None,
            internal_tls: None,
            grpc_conn: Default::default(),
        }
    }

    /// Cross-field checks, before anything is loaded.
    pub fn validate(&self) -> Result<(), ServeError> {
        if self.queue_capacity == 0 {
            return Err(ServeError::Config(
                "--queue-capacity must be at least 1 image".into(),
            ));
        }
        if self.max_chunk_bytes == 0 || self.max_chunk_bytes > encoder::chunk::MAX_CHUNK_BYTES {
            return Err(ServeError::Config(format!(
                "--max-chunk-bytes is {}; it must be in 1..={}",
                self.max_chunk_bytes,
                encoder::chunk::MAX_CHUNK_BYTES
            )));
        }
        if self.visual.device.is_empty()
            || self.visual.device.len() != self.visual.num_devices as usize
        {
            return Err(ServeError::Config(format!(
                "visual.num_devices is {} but visual.device lists {} ids ({:?})",
                self.visual.num_devices,
                self.visual.device.len(),
                self.visual.device
            )));
        }
        if self.max_decode_pixels == 0 {
            return Err(ServeError::Config(
                "--max-decode-pixels must be positive".into(),
            ));
        }
        Ok(())
    }
}

/// The service's whole life: a dry run when `visual.create_runtimes` is false; otherwise bind,
/// print `listening grpc=ADDR metrics=ADDR` on stdout, load, serve until `shutdown`, drain.
pub async fn run(
    opts: Options,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    opts.validate()?;
    if !opts.visual.create_runtimes {
        return dry_run(&opts).await;
    }
    let bound = bind(opts).await?;
    bound.listeners.announce();
    bound.serve(shutdown).await
}

/// Sockets bound, nothing loaded yet.
pub struct Bound {
    pub grpc_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    listeners: Listeners,
    cores: Vec<Option<usize>>,
    opts: Options,
}

/// Checks the device pool and binds both ports (port 0 picks a free one).
pub async fn bind(opts: Options) -> Result<Bound, ServeError> {
    opts.validate()?;
    let cores = device_cores(&opts)?;
    let listeners = server::bind(opts.listen, opts.metrics_listen)
        .await
        .map_err(|e| ServeError::Bind {
            what: e.what,
            addr: e.addr,
            source: e.source,
        })?;
    Ok(Bound {
        grpc_addr: listeners.grpc_addr,
        metrics_addr: listeners.metrics_addr,
        listeners,
        cores,
        opts,
    })
}

/// The core each device's compute thread is pinned to when the ViT's backend runs on host
/// cores, or None (accelerator ordinals).
fn device_cores(opts: &Options) -> Result<Vec<Option<usize>>, ServeError> {
    let backend = vlm_backends::Backend::resolve(
        &opts.visual.kernels,
        opts.visual.dtype,
        vlm_backends::Part::Vision,
    )
    .map_err(|e| ServeError::Config(e.to_string()))?;
    if !backend.devices_are_cores() {
        return Ok(opts.visual.device.iter().map(|_| None).collect());
    }
    let cores = vlm_service_kit::affinity::resolve(&opts.visual.device, "visual.device")?;
    Ok(cores.into_iter().map(Some).collect())
}

impl Bound {
    /// Serves health (NOT_SERVING) and reflection at once, loads the weights and prepares every
    /// bucket, reports SERVING, and on `shutdown` drains: NOT_SERVING first, the drain delay,
    /// then in-flight calls finish, then the compute threads stop.
    pub async fn serve(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        let Bound {
            listeners,
            cores,
            opts,
            ..
        } = self;
        let slot: EncoderSlot = Arc::new(std::sync::OnceLock::new());
        let vision = tonic::service::interceptor::InterceptedService::new(
            vlm_proto::v1::vision_server::VisionServer::new(
                VisionService::new(Arc::clone(&slot)).with_grpc_conn(opts.grpc_conn.info()),
            )
            .max_decoding_message_size(opts.max_request_bytes)
            .max_encoding_message_size(2 * encoder::chunk::MAX_CHUNK_BYTES + (64 << 10)),
            vlm_service_kit::internal_auth::interceptor(opts.internal_token.clone()),
        );
        let load = async {
            let devices = prepare(&opts, &cores).await?;
            let cfg = EncoderConfig {
                visual: opts.visual.clone(),
                max_decode_pixels: opts.max_decode_pixels,
                media_decoding: opts.media_decoding.clone(),
                queue_capacity: opts.queue_capacity,
                max_waiting_images: opts.max_waiting_images,
                max_queue_wait: opts.max_queue_wait,
                max_chunk_bytes: opts.max_chunk_bytes,
                spread_lone_images: opts.spread_lone_images,
                embed_cache_bytes: opts.embed_cache_bytes,
            };
            let vcfg = vlm_compute::Qwen3VlConfig::from_dir(&opts.model_dir)
                .map_err(|source| ServeError::Load {
                    dir: opts.model_dir.clone(),
                    source,
                })?
                .vision;
            let encoder = Encoder::start(devices, cfg, &vcfg, model_id(&opts))?;
            let _ = slot.set(encoder.clone());
            tracing::info!(
                queue_capacity = opts.queue_capacity,
                max_waiting_images = opts.max_waiting_images,
                max_queue_wait_ms = opts.max_queue_wait.as_millis() as u64,
                embed_cache_bytes = opts.embed_cache_bytes,
                media_decoding = %opts.media_decoding.describe(),
                devices = ?opts.visual.device,
                "ViT ready: every bucket prepared, compute threads started"
            );
            Ok::<_, ServeError>(encoder)
        };
        let stopped = GrpcServer::new(listeners, SERVICE_NAME)
            .add_service(vision)
            .tls(opts.internal_tls.clone())
            .conn(opts.grpc_conn)
            .drain_delay(opts.drain_delay)
            .tcp_nodelay(true)
            .serve(load, shutdown)
            .await
            .map_err(|e| match e {
                server::ServeError::Reflection(e) => ServeError::Reflection(e.to_string()),
                server::ServeError::Load(e) => e,
            })?;
        let encoder = stopped.loaded;
        tokio::task::spawn_blocking(move || encoder.shutdown())
            .await
            .map_err(|e| ServeError::Thread(e.to_string()))?;
        tracing::info!("drained; bye");
        stopped.served.map_err(|e| match e {
            server::ServerError::Transport(e) => ServeError::Transport(e),
            server::ServerError::Task(e) => ServeError::Thread(format!("gRPC server task: {e}")),
        })
    }
}

/// The checkpoint's model id (`_name_or_path` or the directory name).
fn model_id(opts: &Options) -> String {
    vlm_compute::Qwen3VlConfig::from_dir(&opts.model_dir)
        .map(|c| c.model_id)
        .unwrap_or_else(|_| opts.model_dir.display().to_string())
}

/// Loads the weights once per distinct compute device and prepares every bucket; logs one line
/// per bucket with the memory it holds.
async fn prepare(opts: &Options, cores: &[Option<usize>]) -> Result<Vec<DeviceSlot>, ServeError> {
    let opts = opts.clone();
    let cores = cores.to_vec();
    tokio::task::spawn_blocking(move || prepare_blocking(&opts, &cores))
        .await
        .map_err(|e| ServeError::Thread(format!("loading task: {e}")))?
}

fn prepare_blocking(
    opts: &Options,
    cores: &[Option<usize>],
) -> Result<Vec<DeviceSlot>, ServeError> {
    let buckets: Vec<usize> = opts
        .visual
        .max_seq_len
        .iter()
        .map(|&b| b as usize)
        .collect();
    let started = std::time::Instant::now();
    let load_error = |source| ServeError::Load {
        dir: opts.model_dir.clone(),
        source,
    };
    let backends = vlm_backends::load_vision(&vlm_backends::VisionLoad {
        model_dir: &opts.model_dir,
        dtype: opts.visual.dtype,
        kernels: &opts.visual.kernels,
        buckets: &buckets,
        devices: &opts.visual.device,
    })
    .map_err(load_error)?;
    let mut slots = Vec::with_capacity(backends.len());
    for ((&id, &core), backend) in opts.visual.device.iter().zip(cores).zip(backends) {
        for b in backend.memory().buckets {
            tracing::info!(
                device = id,
                bucket = b.bucket,
                memory_bytes = b.bytes,
                held_bytes = b.held_bytes,
                "bucket {} prepared on device {id}: holds {:.1} MiB",
                b.bucket,
                b.bytes as f64 / (1 << 20) as f64
            );
        }
        slots.push(DeviceSlot { id, core, backend });
    }
    if let Some(first) = slots.first() {
        let info = first.backend.info();
        tracing::info!(
            seconds = started.elapsed().as_secs_f64(),
            model = %opts.model_dir.display(),
            backend = info.backend,
            dtype = info.dtype.as_str(),
            kernels = %info.kernels_line(),
            "ViT loaded"
        );
    }
    Ok(slots)
}

/// `visual.create_runtimes: false`: load and prepare, print what would be held, serve nothing.
async fn dry_run(opts: &Options) -> Result<(), ServeError> {
    let cores = device_cores(opts)?;
    let devices = prepare(opts, &cores).await?;
    println!(
        "dry run (visual.create_runtimes = false): model {} prepared, nothing served",
        opts.model_dir.display()
    );
    // Buffers held from load (the CPU engine's) add up over the buckets; per-run ones (candle's)
    // are one run at a time.
    let memory = devices[0].backend.memory();
    let mut per_device = 0u64;
    for b in &memory.buckets {
        per_device = if b.held_bytes > 0 {
            per_device + b.bytes
        } else {
            per_device.max(b.bytes)
        };
        println!(
            "bucket {}: would hold {} bytes ({:.1} MiB)",
            b.bucket,
            b.bytes,
            b.bytes as f64 / (1 << 20) as f64
        );
    }
    let info = devices[0].backend.info();
    println!(
        "devices {:?} ({} backend, {}): {} compute thread(s), {per_device} bytes of ViT buffers per device, \
         {} bytes in all; queue capacity {} images",
        opts.visual.device,
        info.backend,
        info.kernels_line(),
        devices.len(),
        per_device * devices.len() as u64,
        opts.queue_capacity
    );
    Ok(())
}
