//! The domain: a bounded queue of images in front of the ViT bucket graphs, and one compute
//! thread per device of the pool.
//!
//! [`Encoder::encode`] checks every image of a request (cheap, header only), puts its images in
//! the wait line for queue slots (or refuses it when the line is full) and returns a stream of
//! chunks. A feeding task per request queues one job per image as its images get slots (all at
//! once when they fit the capacity); a forwarding task per request forwards each image's chunks
//! as soon as that image is done, and cancels the request's remaining work when the caller goes
//! away or its deadline passes.
pub mod cache;
pub mod chunk;
pub mod plan;
pub mod queue;
pub mod request;
pub mod spread;
pub mod worker;

use crate::error::{ServeError, VisionError};
use plan::Limits;
use plan::PlannedImage;
use queue::{Admission, JobQueue, Waiting};
use request::{Chunk, EncodeRequest, WireDtype};
use spread::Spread;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use vlm_compute::{BackendInfo, VisionBackend, VisionConfig};
use vlm_config::VisualConfig;
use worker::{Job, Outcome, Shared};

/// Chunks buffered per request between the forwarding task and the response stream.
const STREAM_BUFFER: usize = 2;
/// How long a failed request's error waits for a caller that does not read.
const ERROR_DELIVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// One device of the pool: its backend instance and where its compute thread runs.
pub struct DeviceSlot {
    /// The device id from the config (`visual.device`).
    pub id: u32,
    /// Physical core to pin to (None: the devices are not host cores).
    pub core: Option<usize>,
    pub backend: Box<dyn VisionBackend>,
}

/// Settings of the encoder.
#[derive(Debug, Clone)]
pub struct EncoderConfig {
    pub visual: VisualConfig,
    pub max_decode_pixels: u64,
    /// Where FFmpeg parses AVIF images.
    pub media_decoding: vlm_preprocess::worker::MediaDecoding,
    /// Images admitted and unfinished at most.
    pub queue_capacity: usize,
    /// Images waiting for a queue slot at most (past that a request is refused at once).
    pub max_waiting_images: usize,
    /// How long a request's images may wait for their first queue slots.
    pub max_queue_wait: std::time::Duration,
    /// Most raw bytes per chunk (<= 1 MiB).
    pub max_chunk_bytes: usize,
    /// Run an image that is alone in the pool on all of the pool's cores.
    pub spread_lone_images: bool,
    /// Bytes of embeddings the cache keeps (0: no cache).
    pub embed_cache_bytes: u64,
}

/// Facts about this replica that do not change while it runs.
#[derive(Debug, Clone)]
pub struct StaticInfo {
    pub model_id: String,
    pub buckets: Vec<u32>,
    pub patch_size: u32,
    pub spatial_merge_size: u32,
    pub temporal_patch_size: u32,
    pub out_hidden_size: u32,
    pub deepstack_levels: u32,
    pub dtype: WireDtype,
    pub device: Vec<u32>,
    pub min_pixels: u64,
    pub max_pixels: u64,
    pub oversize: &'static str,
    pub queue_capacity: u32,
    pub max_waiting_images: u32,
    /// The compute backend (of the first device; every device runs the same), with the devices
    /// of the whole pool.
    pub backend: BackendInfo,
    /// An image alone in the pool runs on all of its cores.
    pub spread_lone_images: bool,
}

/// [`StaticInfo`] plus the queue right now.
#[derive(Debug, Clone)]
pub struct Info {
    pub fixed: StaticInfo,
    pub queue_depth: u32,
    /// Images waiting for a queue slot.
    pub images_waiting: u32,
    pub images_in_flight: u32,
    pub embed_cache: cache::CacheStats,
}

/// A cheap, cloneable handle on the queue and the compute threads.
#[derive(Clone)]
pub struct Encoder {
    inner: Arc<Inner>,
}

struct Inner {
    admission: Arc<Admission>,
    max_queue_wait: std::time::Duration,
    queue: Arc<JobQueue<Job>>,
    shared: Arc<Shared>,
    info: StaticInfo,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl Encoder {
    /// Starts one compute thread per device.
    pub fn start(
        devices: Vec<DeviceSlot>,
        cfg: EncoderConfig,
        vcfg: &VisionConfig,
        model_id: String,
    ) -> Result<Encoder, ServeError> {
        let first = devices
            .first()
            .ok_or_else(|| ServeError::Config("visual.device is empty".into()))?;
        let mut backend = first.backend.info().clone();
        backend.device = devices
            .iter()
            .map(|d| d.backend.info().device.clone())
            .collect::<Vec<_>>()
            .join(", ");
        let limits = Limits {
            decoding: cfg.media_decoding.clone(),
            ..Limits::new(cfg.visual.clone(), cfg.max_decode_pixels)
        };
        let mut info = StaticInfo {
            model_id,
            buckets: cfg.visual.max_seq_len.clone(),
            patch_size: limits.preprocess.patch_size as u32,
            spatial_merge_size: vcfg.spatial_merge_size as u32,
            temporal_patch_size: vcfg.temporal_patch_size as u32,
            out_hidden_size: vcfg.out_hidden_size as u32,
            deepstack_levels: vcfg.deepstack_visual_indexes.len() as u32,
            dtype: WireDtype::from_config(cfg.visual.dtype),
            device: devices.iter().map(|d| d.id).collect(),
            min_pixels: cfg.visual.min_pixels,
            max_pixels: cfg.visual.max_pixels,
            oversize: match cfg.visual.oversize {
                vlm_config::Oversize::Reject => "reject",
                vlm_config::Oversize::Downscale => "downscale",
            },
            queue_capacity: cfg.queue_capacity as u32,
            max_waiting_images: cfg.max_waiting_images as u32,
            backend,
            spread_lone_images: false, // set below, once the pool-wide pool exists
        };
        let cores: Option<Vec<usize>> = devices.iter().map(|d| d.core).collect();
        let spread = match cores {
            Some(cores) if cfg.spread_lone_images && cores.len() > 1 => {
                Some(Spread::new(cores).map_err(|e| {
                    ServeError::Thread(format!("cannot build the pool-wide thread pool: {e}"))
                })?)
            }
            _ => None,
        };
        tracing::info!(
            spread_lone_images = spread.is_some(),
            "an image alone in the pool runs on {}",
            if spread.is_some() {
                "all of the pool's cores"
            } else {
                "one device"
            }
        );
        info.spread_lone_images = spread.is_some();
        let shared = Arc::new(Shared {
            limits,
            max_chunk_bytes: cfg.max_chunk_bytes.clamp(1, chunk::MAX_CHUNK_BYTES),
            in_flight: Default::default(),
            spread,
            cache: cache::EmbedCache::new(cfg.embed_cache_bytes),
        });
        let queue = Arc::new(JobQueue::default());
        let mut threads = Vec::with_capacity(devices.len());
        for d in devices {
            let (shared, queue) = (Arc::clone(&shared), Arc::clone(&queue));
            let name = format!("vision-device-{}", d.id);
            let thread_name = name.clone();
            let handle = std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || worker::run(d.backend, shared, queue, d.core, thread_name))
                .map_err(|e| ServeError::Thread(format!("cannot spawn {name}: {e}")))?;
            threads.push(handle);
        }
        metrics::gauge!("vlm_vision_queue_depth").set(0.0);
        metrics::gauge!("vlm_vision_images_in_flight").set(0.0);
        metrics::counter!("vlm_vision_spread_images_total").increment(0);
        Ok(Encoder {
            inner: Arc::new(Inner {
                admission: Admission::new(cfg.queue_capacity, cfg.max_waiting_images),
                max_queue_wait: cfg.max_queue_wait,
                queue,
                shared,
                info,
                threads: Mutex::new(threads),
            }),
        })
    }

    pub fn info(&self) -> Info {
        Info {
            fixed: self.inner.info.clone(),
            queue_depth: self.inner.admission.depth() as u32,
            images_waiting: self.inner.admission.waiting() as u32,
            images_in_flight: self.inner.shared.in_flight.load(Ordering::Acquire) as u32,
            embed_cache: self.inner.shared.cache.stats(),
        }
    }

    /// Checks, admits and queues the images of `req`; returns the stream of their chunks.
    /// `deadline` is the caller's (from `grpc-timeout`); `span` the request's span.
    pub fn encode(
        &self,
        req: EncodeRequest,
        deadline: Option<Instant>,
        span: tracing::Span,
    ) -> Result<ReceiverStream<Result<Chunk, VisionError>>, VisionError> {
        let result = self.admit(req, deadline, span);
        if let Err(e) = &result {
            metrics::counter!("vlm_vision_requests_total", "status" => e.metric_label())
                .increment(1);
        }
        result
    }

    fn admit(
        &self,
        req: EncodeRequest,
        deadline: Option<Instant>,
        span: tracing::Span,
    ) -> Result<ReceiverStream<Result<Chunk, VisionError>>, VisionError> {
        let n = req.images.len();
        if n == 0 {
            return Err(VisionError::invalid_request("the request has no images"));
        }
        let images = req
            .images
            .into_iter()
            .enumerate()
            .map(|(i, input)| plan::plan(i, input, &self.inner.shared.limits))
            .collect::<Result<Vec<_>, _>>()?;
        let waiting = self.inner.admission.enter(n)?;
        let dtype = req.dtype.unwrap_or(self.inner.info.dtype);
        let cancel = CancellationToken::new();
        let (results_tx, results_rx) = mpsc::unbounded_channel();
        let feeding = Feeding {
            images,
            dtype,
            cancel: cancel.clone(),
            results: results_tx,
            span: span.clone(),
        };
        tokio::spawn(feed(Arc::clone(&self.inner), feeding, waiting).instrument(span.clone()));
        let (out_tx, out_rx) = mpsc::channel(STREAM_BUFFER);
        tokio::spawn(forward(results_rx, out_tx, cancel, deadline, n).instrument(span));
        Ok(ReceiverStream::new(out_rx))
    }

    /// Stops taking work, lets the compute threads finish what is queued, and joins them.
    pub fn shutdown(&self) {
        self.inner.queue.close();
        let threads =
            std::mem::take(&mut *self.inner.threads.lock().unwrap_or_else(|p| p.into_inner()));
        for t in threads {
            let _ = t.join();
        }
    }
}

/// A request's images on their way to the compute threads.
struct Feeding {
    images: Vec<PlannedImage>,
    dtype: WireDtype,
    cancel: CancellationToken,
    results: mpsc::UnboundedSender<Outcome>,
    span: tracing::Span,
}

/// Queues the request's images as they get queue slots: the first ones all at once (as many
/// as the capacity holds), within the service's queue-wait limit; the rest of a request larger
/// than the capacity one by one as slots free. Stops when the request is cancelled (its caller
/// went away, its deadline passed or an image failed: the forwarding task cancels).
async fn feed(inner: Arc<Inner>, f: Feeding, mut waiting: Waiting) {
    let arrived = Instant::now();
    let limit = inner.max_queue_wait;
    let mut images = f.images.into_iter();
    let mut first = true;
    while waiting.remaining() > 0 {
        let k = if first {
            waiting.remaining().min(inner.admission.capacity())
        } else {
            1
        };
        let permits = tokio::select! {
            _ = f.cancel.cancelled() => return,
            p = waiting.admit(k) => p,
            _ = tokio::time::sleep_until(arrived + limit), if first => {
                let error = VisionError::QueueTimeout {
                    waited_ms: arrived.elapsed().as_millis() as u64,
                    limit_ms: limit.as_millis() as u64,
                };
                let _ = f.results.send(Outcome::Failed { error });
                return;
            }
        };
        if first {
            metrics::histogram!("vlm_vision_queue_wait_seconds")
                .record(arrived.elapsed().as_secs_f64());
            first = false;
        }
        let jobs: Vec<Job> = permits
            .into_iter()
            .zip(images.by_ref())
            .map(|(permit, image)| Job {
                image,
                dtype: f.dtype,
                cancel: f.cancel.clone(),
                results: f.results.clone(),
                permit,
                span: f.span.clone(),
            })
            .collect();
        if !inner.queue.push_all(jobs) {
            let error = VisionError::NotReady("the service is draining".into());
            let _ = f.results.send(Outcome::Failed { error });
            return;
        }
    }
}

/// How a request's forwarding ended.
enum Exit {
    Done,
    CallerGone,
    Failed(VisionError),
}

/// Forwards one request's image outcomes to its response stream; cancels the rest of the
/// request when the caller goes away, its deadline passes or one of its images fails.
async fn forward(
    mut results: mpsc::UnboundedReceiver<Outcome>,
    out: mpsc::Sender<Result<Chunk, VisionError>>,
    cancel: CancellationToken,
    deadline: Option<Instant>,
    images: usize,
) {
    let _cancel_on_exit = cancel.clone().drop_guard();
    let timeout_ms = deadline
        .map(|d| d.saturating_duration_since(Instant::now()).as_millis() as u64)
        .unwrap_or(0);
    let deadline_passed = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(deadline_passed);
    let mut done = 0usize;
    let exit = loop {
        if done == images {
            break Exit::Done;
        }
        tokio::select! {
            _ = out.closed() => break Exit::CallerGone,
            _ = &mut deadline_passed => break Exit::Failed(VisionError::DeadlineExceeded { timeout_ms }),
            outcome = results.recv() => match outcome {
                // Every job gone without a word: they were dropped (a bug or a hard stop).
                None => break Exit::Failed(VisionError::NotReady("the service stopped before the images were encoded".into())),
                Some(Outcome::Failed { error }) => break Exit::Failed(error),
                Some(Outcome::Done { index, chunks, permit }) => {
                    let mut exit = None;
                    for c in chunks {
                        tokio::select! {
                            r = out.send(Ok(c)) => if r.is_err() { exit = Some(Exit::CallerGone); break },
                            _ = &mut deadline_passed => {
                                exit = Some(Exit::Failed(VisionError::DeadlineExceeded { timeout_ms }));
                                break
                            }
                        }
                    }
                    drop(permit);
                    if let Some(e) = exit {
                        break e;
                    }
                    tracing::debug!(image = index, "image streamed");
                    done += 1;
                }
            }
        }
    };
    let status = match exit {
        Exit::Done => "ok",
        Exit::CallerGone => {
            cancel.cancel();
            "cancelled"
        }
        Exit::Failed(error) => {
            // Stop the rest of the request (and free its slots) before telling the caller, so
            // that a caller slow to read its error holds nothing.
            cancel.cancel();
            drop(results);
            let label = error.metric_label();
            tracing::info!(error = %error, "request failed; its remaining images are cancelled");
            // The error must reach the caller: a stream that simply ends reads as success.
            let _ = tokio::time::timeout(ERROR_DELIVERY, out.send(Err(error))).await;
            label
        }
    };
    metrics::counter!("vlm_vision_requests_total", "status" => status).increment(1);
}
