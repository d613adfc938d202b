//! Compute threads: one per device of the pool, pinned to its core, each running one image at a
//! time through its bucket graph. Candle's and the preprocessor's data parallelism goes through
//! a one-thread rayon pool created on (and so pinned like) the compute thread, so a pool of n
//! cores really runs on those n cores and no others. An image alone in the pool runs on all of
//! its cores instead ([`super::spread`]).
use super::cache::EmbedCache;
use super::chunk::{to_chunks, ChunkHeader};
use super::plan::{Limits, PlannedImage};
use super::queue::{JobQueue, Permit};
use super::request::{Chunk, WireDtype};
use super::spread::{Mode, Spread};
use crate::error::VisionError;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;
use tokio_util::sync::CancellationToken;
use vlm_compute::VisionBackend;

/// One image of one request, waiting for a compute thread.
pub struct Job {
    pub image: PlannedImage,
    pub dtype: WireDtype,
    pub cancel: CancellationToken,
    pub results: UnboundedSender<Outcome>,
    pub permit: Permit,
    /// The request's span; the image's span is its child.
    pub span: tracing::Span,
}

/// What a compute thread reports for one image.
pub enum Outcome {
    /// The image's chunks, in row order; the permit goes back once they are handed on.
    Done {
        index: usize,
        chunks: Vec<Chunk>,
        permit: Permit,
    },
    Failed {
        error: VisionError,
    },
}

/// What every compute thread shares.
pub struct Shared {
    pub limits: Limits,
    pub max_chunk_bytes: usize,
    pub in_flight: AtomicUsize,
    /// The pool-wide run for a lone image (None: one device, or not host cores, or off).
    pub spread: Option<Spread>,
    pub cache: EmbedCache,
}

/// Runs jobs from `queue` until it is closed and empty. `core` is the physical core to pin to
/// (None: no pinning, e.g. GPU ordinals).
pub fn run(
    backend: Box<dyn VisionBackend>,
    shared: Arc<Shared>,
    queue: Arc<JobQueue<Job>>,
    core: Option<usize>,
    name: String,
) {
    if let Some(c) = core {
        if !vlm_service_kit::affinity::pin_current_thread(&[c]) {
            tracing::warn!(thread = %name, core = c, "could not pin the compute thread to its core");
        }
    }
    // Created after pinning: its worker thread inherits this thread's affinity.
    let pool = match rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .thread_name(move |_| "vision-intra".into())
        .build()
    {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::warn!(error = %e, "no per-device rayon pool; using the global one");
            None
        }
    };
    while let Some(job) = queue.pop() {
        if job.cancel.is_cancelled() {
            continue; // dropping the job frees its slot
        }
        shared.in_flight.fetch_add(1, Ordering::AcqRel);
        metrics::gauge!("vlm_vision_images_in_flight").increment(1.0);
        let work = || {
            std::panic::catch_unwind(AssertUnwindSafe(|| {
                encode_one(backend.as_ref(), &shared, &job)
            }))
        };
        let mode = match &shared.spread {
            Some(s) => s.gate.enter(|| queue.is_empty()),
            None => Mode::Own,
        };
        let result = match (mode, &shared.spread, &pool) {
            (Mode::Spread, Some(s), _) => s.pool.install(work),
            (_, _, Some(p)) => p.install(work),
            _ => work(),
        };
        if let Some(s) = &shared.spread {
            s.gate.leave(mode);
        }
        if mode == Mode::Spread {
            metrics::counter!("vlm_vision_spread_images_total").increment(1);
        }
        shared.in_flight.fetch_sub(1, Ordering::AcqRel);
        metrics::gauge!("vlm_vision_images_in_flight").decrement(1.0);
        let Job {
            image,
            results,
            permit,
            ..
        } = job;
        let outcome = match result {
            Ok(Ok(Some(chunks))) => Outcome::Done {
                index: image.index,
                chunks,
                permit,
            },
            Ok(Ok(None)) => continue, // cancelled mid-way
            Ok(Err(error)) => Outcome::Failed { error },
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                tracing::error!(image = image.index, panic = %what, "compute thread caught a panic");
                Outcome::Failed {
                    error: VisionError::Model {
                        image: image.index,
                        message: format!("panic: {what}"),
                    },
                }
            }
        };
        // The request may be gone; then the outcome (and its permit) is simply dropped.
        let _ = results.send(outcome);
    }
}

/// From the embedding cache, or preprocess and run the bucket on the backend (and keep the
/// result); cut into chunks. `Ok(None)` when the caller went away.
fn encode_one(
    backend: &dyn VisionBackend,
    shared: &Shared,
    job: &Job,
) -> Result<Option<Vec<Chunk>>, VisionError> {
    let image = &job.image;
    let span = tracing::info_span!(parent: &job.span, "vision.encode_image", image = image.index, bucket = image.bucket, patches = image.patches());
    let _enter = span.enter();
    let key = shared.cache.enabled().then(|| image.cache_key());
    let cached = match &key {
        Some(k) => shared.cache.get(k),
        None => None,
    };
    let (embeds, bucket) = match cached {
        // The bucket it ran in is the one its geometry plans (the key covers the geometry).
        Some(embeds) => {
            tracing::debug!("image served from the embedding cache");
            (embeds, image.bucket as usize)
        }
        None => {
            let Some(run) = run_backend(backend, shared, job)? else {
                return Ok(None);
            };
            if let Some(k) = key {
                shared.cache.put(k, run.embeds.clone());
            }
            (run.embeds, run.bucket)
        }
    };
    let header = ChunkHeader {
        image_index: image.index as u32,
        content_hash: Arc::clone(&image.content_hash),
        grid: image.grid,
        bucket: bucket as u32,
    };
    let chunks = to_chunks(&header, &embeds, job.dtype, shared.max_chunk_bytes).map_err(|e| {
        VisionError::Model {
            image: image.index,
            message: e.to_string(),
        }
    })?;
    Ok(Some(chunks))
}

/// Preprocess and run the bucket on the backend. `Ok(None)` when the caller went away.
fn run_backend(
    backend: &dyn VisionBackend,
    shared: &Shared,
    job: &Job,
) -> Result<Option<vlm_compute::VisionRun>, VisionError> {
    let image = &job.image;
    let pv = image.pixel_values(&shared.limits)?;
    if job.cancel.is_cancelled() {
        return Ok(None);
    }
    let started = Instant::now();
    let run = backend.encode(&pv).map_err(|e| VisionError::Model {
        image: image.index,
        message: e.to_string(),
    })?;
    let seconds = started.elapsed().as_secs_f64();
    let bucket = run.bucket.to_string();
    let kind = image.kind();
    metrics::histogram!("vlm_vision_encode_seconds", "bucket" => bucket.clone(), "kind" => kind)
        .record(seconds);
    metrics::counter!("vlm_vision_images_total", "bucket" => bucket, "kind" => kind).increment(1);
    metrics::histogram!("vlm_vision_padding_fraction").record(run.padding_fraction as f64);
    if run.bucket as u32 != image.bucket {
        tracing::warn!(
            planned = image.bucket,
            ran = run.bucket,
            "image ran in another bucket than planned"
        );
    }
    tracing::debug!(seconds, padding = run.padding_fraction, "image encoded");
    Ok(Some(run))
}
