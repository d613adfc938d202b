//! The LM service: owns the decoder graphs and the paged KV cache, pulls image embeddings from
//! vision replicas (cached by content hash), and decodes with continuous batching.
//!
//! Layers: [`service`] (tonic adapter) → [`generate`] (validation, embeddings) → [`engine`]
//! (the step loop on its own thread) → [`scheduler`] (pure plan: admission, chunked prefill,
//! decode bucket, preemption) over [`kv`] (block ids), running the plan's steps on the compute
//! backend (`vlm_compute::LmBackend`, loaded by `vlm_backends`).
//!
//! Sampling (greedy, temperature, top-k, top-p, seed), stop token ids, EOS and `max_tokens`
//! are handled here. Stop *strings* are not: the gateway owns detokenization and ends the
//! stream (by cancelling it) when one appears.
pub mod coalesce;
pub mod convert;
pub mod embed_cache;
pub mod engine;
pub mod error;
pub mod generate;
pub mod kv;
pub mod sampler;
pub mod scheduler;
pub mod service;
pub mod structured;
pub mod vision_client;

pub use error::{LmError, ServeError};

use engine::{EngineHandle, EngineOptions};
use generate::Context;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::sync::watch;
use vlm_config::DeployConfig;
pub use vlm_service_kit::replicas::ReplicaSource;
use vlm_service_kit::server::{self, GrpcServer};
use vlm_service_kit::{affinity, metrics_http};

/// gRPC service name for health.
pub const SERVICE_NAME: &str = "vlm.v1.Lm";
/// Default size of the embedding cache.
pub const DEFAULT_EMBEDDING_CACHE_BYTES: usize = 256 << 20;

/// The default prompt-token budget of a step while sequences decode. Against the 512-token
/// chunk, `vllm bench serve` on two Zen 5 cores (2026-12-07, docs/performance.md): ITL p99
/// halved in text and image runs at concurrency 8 and 32, output tok/s equal or better at 8
/// and with images, 8% lower in one text run at 32.
pub const DEFAULT_PREFILL_TOKENS_WHILE_DECODING: u32 = 256;

/// Everything `run` needs.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub model_dir: PathBuf,
    pub deploy: DeployConfig,
    pub listen: SocketAddr,
    pub metrics_listen: SocketAddr,
    pub embedding_cache_bytes: usize,
    /// A step's prefill token budget while sequences decode (`--prefill-tokens-while-decoding`;
    /// 0: `prefill_chunk_size`, the budget of every step).
    pub prefill_while_decoding: u32,
    /// The vision replicas this LM may pull embeddings from (`None`: text and cached images
    /// only).
    pub vision: Option<ReplicaSource>,
    /// The shared token of the internal APIs (`--internal-token-file`): required of callers
    /// of `vlm.v1.Lm`, sent to the vision replicas. `None`: neither.
    pub internal_token: Option<Arc<vlm_service_kit::internal_auth::InternalToken>>,
    /// Mutual TLS (`--internal-tls-*`) on the gRPC port and to the vision replicas; `None`:
    /// plain HTTP/2.
    pub internal_tls: Option<Arc<vlm_service_kit::internal_tls::InternalTls>>,
    /// Keepalive, connection cap and handshake deadline of the gRPC port; the keepalive also
    /// of the channels to the vision replicas.
    pub grpc_conn: vlm_service_kit::conn::GrpcConnOptions,
}

/// Blocks in the KV pool: `kvcache_num_blocks`, or when 0 the memory planner's answer
/// ([`vlm_config::plan::resolve_kv_blocks`] with the sizes of the backend the LM runs on: the
/// largest count that fits this machine after the weights and graph buffers, capped at
/// `batch_size` full-length sequences), so the plan (`vlm plan`) and the running service agree.
pub fn resolve_num_blocks(
    d: &DeployConfig,
    model_dir: &std::path::Path,
) -> Result<u32, ServeError> {
    if d.kvcache_num_blocks != 0 {
        return Ok(d.kvcache_num_blocks);
    }
    let config = |e: &dyn std::fmt::Display| ServeError::Config(e.to_string());
    let dims = vlm_config::plan::ModelDims::from_dir(model_dir).map_err(|e| config(&e))?;
    let backend = vlm_backends::Backend::resolve(&d.kernels, d.dtype, vlm_backends::Part::Lm)
        .map_err(|e| config(&e))?;
    // MemAvailable (or the cgroup limit), not MemTotal: the pool is pre-faulted at start.
    let kind = vlm_backends::device_kind(backend, &d.device).map_err(|e| config(&e))?;
    tracing::info!(
        capacity_bytes = kind.capacity,
        backend = backend.name(),
        "sizing kvcache_num_blocks: 0 against the device's memory"
    );
    let sizing = vlm_backends::sizing(d, &kind, &vlm_config::plan::PlanOptions::default())
        .map_err(|e| config(&e))?;
    vlm_config::plan::resolve_kv_blocks(d, &dims, &kind, sizing.as_ref()).map_err(|e| config(&e))
}

/// What the service would hold, without loading anything (`create_runtimes: false`).
pub fn dry_run(cfg: &ServeConfig) -> Result<String, ServeError> {
    let model = vlm_compute::Qwen3VlConfig::from_dir(&cfg.model_dir)
        .map_err(|e| ServeError::Model(e.to_string()))?;
    let d = &cfg.deploy;
    let blocks = resolve_num_blocks(d, &cfg.model_dir)?;
    let dims = vlm_config::plan::ModelDims::from_dir(&cfg.model_dir)
        .map_err(|e| ServeError::Config(e.to_string()))?;
    let kind = vlm_config::plan::DeviceKind::cpu_with(0);
    let sizing = vlm_backends::sizing(d, &kind, &vlm_config::plan::PlanOptions::default())
        .map_err(|e| ServeError::Config(e.to_string()))?;
    let kv = vlm_config::plan::kv_pool_bytes(d, &dims, blocks, sizing.as_ref());
    let weights: u64 = std::fs::read_dir(&cfg.model_dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
                .filter_map(|e| e.metadata().ok().map(|m| m.len()))
                .sum()
        })
        .unwrap_or(0);
    Ok(format!(
        "dry run (create_runtimes: false): model {} ({} layers, hidden {}, vocab {}); checkpoint files {:.1} MiB; \
         KV pool {} blocks x {} tokens = {} tokens, {:.1} MiB ({}); decode graphs {:?}; prefill chunk {}; \
         batch_size {}; max_seq_len {}; device {:?}",
        model.model_id,
        model.text.num_hidden_layers,
        model.text.hidden_size,
        model.text.vocab_size,
        weights as f64 / (1 << 20) as f64,
        blocks,
        d.kvcache_partition_len,
        blocks as u64 * d.kvcache_partition_len as u64,
        kv as f64 / (1 << 20) as f64,
        if d.kvcache_num_blocks == 0 {
            "automatic: the memory planner's count for this machine"
        } else {
            "kvcache_num_blocks"
        },
        d.decoder_batch_sizes,
        d.prefill_chunk_size,
        d.batch_size,
        d.max_seq_len,
        d.device,
    ))
}

fn register_metrics(graphs: &[u32]) {
    for name in [
        "vlm_lm_preemptions_total",
        "vlm_lm_embedding_cache_hits_total",
        "vlm_lm_embedding_cache_misses_total",
        "vlm_lm_generated_tokens_total",
        "vlm_lm_prefix_cache_prompt_tokens_total",
        "vlm_lm_prefix_cache_hit_tokens_total",
        "vlm_lm_prefill_tokens_total",
    ] {
        metrics::counter!(name).increment(0);
    }
    for g in graphs {
        metrics::counter!("vlm_lm_decode_steps_total", "graph" => g.to_string()).increment(0);
    }
    metrics::describe_histogram!(
        "vlm_lm_time_to_first_token_seconds",
        metrics::Unit::Seconds,
        "request received to first token"
    );
    metrics::describe_histogram!(
        "vlm_lm_time_per_output_token_seconds",
        metrics::Unit::Seconds,
        "time between consecutive tokens of a stream"
    );
    metrics::describe_counter!(
        "vlm_lm_decode_steps_total",
        "decode steps by decode graph (bucket) run"
    );
    metrics::describe_gauge!("vlm_lm_kv_blocks_used", "KV blocks held by sequences");
    metrics::describe_gauge!(
        "vlm_lm_kv_blocks_cached",
        "free KV blocks holding a cached prefix (reused on a hit, evicted when needed)"
    );
    metrics::describe_counter!(
        "vlm_lm_prefix_cache_hit_tokens_total",
        "prompt tokens read from the prefix cache instead of computed (hit rate: divide by \
         vlm_lm_prefix_cache_prompt_tokens_total)"
    );
}

/// Binds `cfg.listen` and `cfg.metrics_listen` (printing `listening grpc=ADDR metrics=ADDR`),
/// serves health (NOT_SERVING) and reflection while it loads the model and warms every graph,
/// then flips to SERVING and serves `vlm.v1.Lm` until `shutdown` completes; then drains
/// (NOT_SERVING, new requests refused, running ones finished) and returns.
pub async fn run(
    cfg: ServeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let d = cfg.deploy.clone();
    // The LM's compute threads are pinned one per core when its backend runs on host cores.
    let backend = vlm_backends::Backend::resolve(&d.kernels, d.dtype, vlm_backends::Part::Lm)
        .map_err(|e| ServeError::Config(e.to_string()))?;
    let cores = if backend.devices_are_cores() {
        affinity::resolve(&d.device, "device").map_err(|e| ServeError::Config(e.to_string()))?
    } else {
        Vec::new()
    };
    let num_blocks = resolve_num_blocks(&d, &cfg.model_dir)?;
    // The recorder first: the zeroed series below must reach it.
    let _ = metrics_http::recorder();
    register_metrics(&d.decoder_batch_sizes);
    let listeners = server::bind(cfg.listen, cfg.metrics_listen)
        .await
        .map_err(|e| ServeError::Bind {
            addr: e.addr.to_string(),
            source: e.source,
        })?;
    listeners.announce();

    // The server runs from now on; `Lm` answers UNAVAILABLE until the context is set.
    let cell: Arc<OnceLock<Arc<Context>>> = Arc::new(OnceLock::new());
    let lm = tonic::service::interceptor::InterceptedService::new(
        vlm_proto::lm_server::LmServer::new(
            service::LmService::new(cell.clone()).with_grpc_conn(cfg.grpc_conn.info()),
        )
        .max_decoding_message_size(256 << 20),
        vlm_service_kit::internal_auth::interceptor(cfg.internal_token.clone()),
    );
    // Health follows the engine thread: if it ever dies, stop advertising this replica.
    let (alive_tx, alive_rx) = watch::channel(true);
    let load = async {
        let opts = EngineOptions {
            model_dir: cfg.model_dir.clone(),
            deploy: d.clone(),
            num_blocks,
            cores: cores.clone(),
            prefill_while_decoding: cfg.prefill_while_decoding,
        };
        let (engine, thread) = tokio::task::spawn_blocking(move || EngineHandle::start(opts))
            .await
            .map_err(|e| ServeError::Model(format!("engine start panicked: {e}")))?
            .map_err(|e| ServeError::Model(e.to_string()))?;
        let info = engine.info().clone();
        tracing::info!(
            model = %info.model.model_id,
            quantization = %info.model.quantization,
            weights_mib = info.weight_bytes as f64 / (1 << 20) as f64,
            kv_blocks = info.num_blocks,
            block_len = info.block_len,
            kv_tokens = info.pool_tokens(),
            kv_mib = info.kv_bytes as f64 / (1 << 20) as f64,
            decode_graphs = ?d.decoder_batch_sizes,
            prefill_chunk = d.prefill_chunk_size,
            prefill_while_decoding = info.prefill_while_decoding,
            batch_size = d.batch_size,
            prefix_caching = d.prefix_caching,
            mixed_steps = info.mixed_steps,
            cores = ?cores,
            backend = info.backend.backend,
            device = %info.backend.device,
            kernels = %info.backend.kernels_line(),
            vision = %cfg.vision.as_ref().map_or("none".to_string(), |v| v.to_string()),
            internal_tls = ?cfg.internal_tls.as_ref().map(|t| t.files()),
            internal_token = cfg.internal_token.is_some(),
            "LM engine ready: prefill path and decode graphs warmed, KV pool allocated"
        );
        let grammars = load_grammars(&cfg.model_dir, &info).await;
        let _ = cell.set(Arc::new(Context {
            engine: engine.clone(),
            grammars,
            cache: Mutex::new(embed_cache::EmbedCache::new(cfg.embedding_cache_bytes)),
            vision: vision_client::VisionClients::new(cfg.vision.clone())
                .with_token(cfg.internal_token.clone())
                .with_tls(cfg.internal_tls.clone())
                .with_keepalive(cfg.grpc_conn.keepalive),
            draining: AtomicBool::new(false),
        }));
        tokio::spawn(watch_engine(engine.clone(), alive_tx));
        Ok::<_, ServeError>((engine, thread))
    };
    let stopped = GrpcServer::new(listeners, SERVICE_NAME)
        .add_service(lm)
        .tls(cfg.internal_tls.clone())
        .conn(cfg.grpc_conn)
        .health_follows(alive_rx)
        .on_drain(drain(cell.clone()))
        .serve(load, shutdown)
        .await
        .map_err(|e| match e {
            server::ServeError::Reflection(e) => ServeError::Transport(e.to_string()),
            server::ServeError::Load(e) => e,
        })?;
    let (engine, thread) = stopped.loaded;
    engine.shutdown();
    let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    stopped.served.map_err(|e| match e {
        server::ServerError::Transport(e) => ServeError::Transport(e.to_string()),
        server::ServerError::Task(e) => ServeError::Transport(format!("server task: {e}")),
    })
}

/// The drain's own step, while the server still accepts calls: refuse new requests (Load
/// reports `draining`), then wait until no sequence runs or waits.
async fn drain(cell: Arc<OnceLock<Arc<Context>>>) {
    let Some(ctx) = cell.get() else {
        return;
    };
    ctx.draining.store(true, Ordering::SeqCst);
    tracing::info!("draining: waiting for running and queued sequences");
    loop {
        let l = ctx.engine.load();
        if l.running == 0 && l.waiting == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tracing::info!("drained");
}

/// Sends `false` on `alive` once the engine thread has stopped; ends when nobody listens.
async fn watch_engine(engine: EngineHandle, alive: watch::Sender<bool>) {
    while engine.is_alive() {
        tokio::select! {
            () = alive.closed() => return,
            () = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
    if alive.send(false).is_ok() {
        tracing::error!("the LM engine thread has stopped; reporting NOT_SERVING");
    }
}

/// The structured-output compiler for this checkpoint, off the async threads; without it the
/// replica serves everything but structured output (and says so).
async fn load_grammars(
    model_dir: &std::path::Path,
    info: &engine::EngineInfo,
) -> Option<Arc<structured::Grammars>> {
    let dir = model_dir.to_path_buf();
    let vocab = info.model.text.vocab_size;
    let eos = *info.model.eos_token_ids.first()?;
    let t0 = std::time::Instant::now();
    match tokio::task::spawn_blocking(move || structured::Grammars::load(&dir, vocab, eos)).await {
        Ok(Ok(g)) => {
            tracing::info!(
                ms = t0.elapsed().as_millis() as u64,
                "structured output ready (llguidance token trie built)"
            );
            Some(Arc::new(g))
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "structured output unavailable");
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "structured output unavailable: loader panicked");
            None
        }
    }
}
