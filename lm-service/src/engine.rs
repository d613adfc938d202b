//! The step loop: one dedicated thread (pinned to the LM's cores) owns the scheduler, the
//! compute backend and every sequence's tokens. Requests arrive as commands over a channel; each step
//! the loop takes new commands, drops sequences whose caller went away, asks the scheduler for
//! a plan, runs it, samples, and streams the tokens out.
use crate::error::LmError;
use crate::kv::{BlockKey, ImageSpan, KeyChain, SeqId};
use crate::sampler::{Sampled, Sampler, SamplingConfig};
use crate::scheduler::{PrefillPlan, Scheduler, SchedulerConfig, SchedulerLoad, StepPlan};
use crate::structured::Guide;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;
use tracing::Span;
use vlm_compute::{build_chunk, BackendInfo, DecodeRow, HostDtype, ImageEmbeds, LmBackend};
use vlm_compute::{PrefillChunk, PromptLayout, Qwen3VlConfig};
use vlm_config::DeployConfig;
use vlm_service_kit::generation::{Finish, TokenLogprob, Usage};

/// How to start the engine.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub model_dir: PathBuf,
    pub deploy: DeployConfig,
    /// Blocks in the KV pool (already resolved from `kvcache_num_blocks`).
    pub num_blocks: u32,
    /// Physical cores the engine's compute threads are pinned to, one thread per core (empty:
    /// the devices are not host cores; nothing is pinned).
    pub cores: Vec<usize>,
    /// A step's prefill token budget while sequences decode (0: `prefill_chunk_size`).
    pub prefill_while_decoding: u32,
}

/// What the engine holds, for `Lm.Info`, validation and logs.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    pub model: Qwen3VlConfig,
    pub deploy: DeployConfig,
    pub num_blocks: u32,
    pub block_len: u32,
    pub dtype: HostDtype,
    pub kv_bytes: u64,
    pub weight_bytes: u64,
    /// The compute backend, its devices and kernels.
    pub backend: BackendInfo,
    /// A step's prefill chunks and decode rows share one forward pass.
    pub mixed_steps: bool,
    /// A step's prefill token budget while sequences decode (resolved: at most
    /// `prefill_chunk_size`).
    pub prefill_while_decoding: u32,
}

impl EngineInfo {
    /// Tokens the pool can hold.
    pub fn pool_tokens(&self) -> u64 {
        self.num_blocks as u64 * self.block_len as u64
    }
    /// The longest sequence (prompt + generated) this replica runs.
    pub fn max_sequence_tokens(&self) -> usize {
        (self.deploy.max_seq_len as u64).min(self.pool_tokens()) as usize
    }
}

/// One streamed step of a generation.
#[derive(Debug, Clone, PartialEq)]
pub struct GenEvent {
    /// Which choice (0..n) this event is of.
    pub index: u32,
    pub tokens: Vec<u32>,
    /// One per token when the request asked for logprobs, else empty.
    pub logprobs: Vec<TokenLogprob>,
    pub finish: Option<Finish>,
    pub usage: Usage,
}

pub type EventSender = UnboundedSender<Result<GenEvent, LmError>>;

/// A validated request with its image embeddings, ready to schedule.
#[derive(Debug)]
pub struct SeqRequest {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub images: Vec<ImageEmbeds>,
    /// Each image's content hash, in prompt order (its prefix-cache identity).
    pub image_hashes: Vec<Vec<u8>>,
    pub layout: PromptLayout,
    pub image_tokens: u32,
    pub video_tokens: u32,
    pub sampling: SamplingConfig,
    /// The structured-output constraint (moved into the sampler at admission).
    pub guide: Option<Guide>,
    /// Choices to generate from this prompt (1 = one). The others are forked from the first
    /// once its prefill is done, so they read the prompt's KV blocks from the prefix cache.
    pub n: usize,
    /// Which choice this sequence is.
    pub index: u32,
    /// Most tokens to generate (already capped to the context).
    pub max_new_tokens: usize,
    /// Token ids that end the generation (EOS unless ignored, plus the request's).
    pub stop_ids: Vec<u32>,
    pub deadline: Option<Instant>,
    pub events: EventSender,
    /// The handler's span; the engine's spans are its children.
    pub span: Span,
    pub received: Instant,
}

enum Command {
    Generate(Box<SeqRequest>),
    Shutdown,
}

/// A cheap handle to the engine thread.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    load: Arc<Mutex<SchedulerLoad>>,
    info: Arc<EngineInfo>,
    alive: Arc<AtomicBool>,
}

/// Clears the flag when the engine thread ends, by return or by panic.
struct AliveGuard(Arc<AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Generate(r) => write!(f, "Generate({})", r.request_id),
            Command::Shutdown => f.write_str("Shutdown"),
        }
    }
}

/// Where each image's placeholder tokens are, with its content hash and grid.
fn image_spans(req: &SeqRequest) -> Vec<ImageSpan> {
    req.layout
        .image_spans
        .iter()
        .zip(&req.image_hashes)
        .zip(&req.images)
        .map(|((tokens, hash), img)| ImageSpan {
            tokens: tokens.clone(),
            content_hash: hash.clone(),
            grid: img.grid_thw,
        })
        .collect()
}

/// The rayon pool the backend computes on: one thread per core of the LM pool, each pinned to
/// its core (so an LM pool of N cores runs N threads on exactly those cores); rayon's default
/// pool when the devices are not host cores.
fn compute_pool(cores: &[usize]) -> Result<rayon::ThreadPool, LmError> {
    let cores = cores.to_vec();
    let threads = cores.len().max(1);
    rayon::ThreadPoolBuilder::new()
        .num_threads(if cores.is_empty() { 0 } else { threads })
        .thread_name(|i| format!("lm-compute-{i}"))
        .start_handler(move |i| {
            if let Some(&c) = cores.get(i) {
                if !vlm_service_kit::affinity::pin_current_thread(&[c]) {
                    tracing::warn!(core = c, "could not pin an LM compute thread");
                }
            }
        })
        .build()
        .map_err(|e| LmError::internal(format!("cannot build the LM compute pool: {e}")))
}

impl EngineHandle {
    /// Starts the engine thread: pins it and its compute pool, loads the backend (weights and
    /// KV pool), runs every graph once, then returns. Blocks until the engine is ready (or
    /// failed).
    pub fn start(opts: EngineOptions) -> Result<(EngineHandle, JoinHandle<()>), LmError> {
        let model_cfg = Qwen3VlConfig::from_dir(&opts.model_dir)?;
        let (ready_tx, ready_rx) = mpsc::sync_channel::<Result<EngineInfo, LmError>>(1);
        let (tx, rx) = mpsc::channel::<Command>();
        let load = Arc::new(Mutex::new(SchedulerLoad::default()));
        let load2 = load.clone();
        let alive = Arc::new(AtomicBool::new(true));
        let guard = AliveGuard(alive.clone());
        let sched_cfg = SchedulerConfig::new(&opts.deploy, opts.num_blocks)
            .with_prefill_while_decoding(opts.prefill_while_decoding);
        let thread = std::thread::Builder::new()
            .name("lm-engine".into())
            .spawn(move || {
                let _alive = guard;
                if !opts.cores.is_empty()
                    && !vlm_service_kit::affinity::pin_current_thread(&opts.cores)
                {
                    tracing::warn!(cores = ?opts.cores, "could not pin the engine thread");
                }
                let started = (|| {
                    let pool = compute_pool(&opts.cores)?;
                    let d = &opts.deploy;
                    let image_token_id = model_cfg.image_token_id;
                    let backend = pool.install(|| {
                        let mut backend = vlm_backends::load_lm(&vlm_backends::LmLoad {
                            model_dir: &opts.model_dir,
                            dtype: d.dtype,
                            kv_cache_dtype: d.kv_cache_dtype,
                            kernels: &d.kernels,
                            num_blocks: opts.num_blocks as usize,
                            block_len: d.kvcache_partition_len as usize,
                            devices: &d.device,
                        })?;
                        backend.warm_up(
                            &d.decoder_batch_sizes,
                            d.prefill_chunk_size as usize,
                            image_token_id,
                        )?;
                        Ok::<_, LmError>(backend)
                    })?;
                    let memory = backend.memory();
                    let info = EngineInfo {
                        model: model_cfg,
                        deploy: opts.deploy.clone(),
                        num_blocks: opts.num_blocks,
                        block_len: d.kvcache_partition_len,
                        dtype: backend.info().dtype,
                        kv_bytes: memory.kv_bytes(),
                        weight_bytes: memory.weight_bytes,
                        backend: backend.info().clone(),
                        mixed_steps: backend.mixes_steps(),
                        prefill_while_decoding: sched_cfg.prefill_while_decoding,
                    };
                    Ok::<_, LmError>((backend, pool, info))
                })();
                let (backend, pool, model_id, dtype) = match started {
                    Ok((backend, pool, info)) => {
                        let ids = (info.model.model_id.clone(), info.dtype);
                        let _ = ready_tx.send(Ok(info));
                        (backend, pool, ids.0, ids.1)
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let sched = Scheduler::new(sched_cfg);
                let salt = crate::kv::prefix::salt(
                    &model_id,
                    dtype.as_str(),
                    opts.deploy.kvcache_partition_len as usize,
                );
                let mut engine = Engine {
                    backend,
                    sched,
                    salt,
                    seqs: HashMap::new(),
                    rx,
                    load: load2,
                };
                engine.publish();
                pool.install(|| engine.run());
            })
            .map_err(|e| LmError::internal(format!("cannot spawn the engine thread: {e}")))?;
        let info = ready_rx
            .recv()
            .map_err(|_| LmError::internal("the engine thread died while starting"))??;
        Ok((
            EngineHandle {
                tx,
                load,
                info: Arc::new(info),
                alive,
            },
            thread,
        ))
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// False once the engine thread has ended (shut down, or a bug made it panic).
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Queues a request; its events arrive on `req.events`.
    pub fn submit(&self, req: SeqRequest) -> Result<(), LmError> {
        self.tx
            .send(Command::Generate(Box::new(req)))
            .map_err(|_| LmError::Unavailable("the LM engine has stopped".into()))
    }

    /// Counts as of the last step.
    pub fn load(&self) -> SchedulerLoad {
        self.load.lock().map(|l| *l).unwrap_or_default()
    }

    /// Stops the loop after the current step; queued sequences get UNAVAILABLE.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }
}

static SEQ_IDS: AtomicU64 = AtomicU64::new(1);

struct SeqState {
    req: SeqRequest,
    generated: Vec<u32>,
    sampler: Sampler,
    last_token_at: Option<Instant>,
    /// Open from submission to admission.
    queue_span: Option<Span>,
    /// Prompt tokens read from the prefix cache (set with the first token).
    cached_tokens: u32,
    /// Content keys of its full blocks (prefix caching).
    keys: KeyChain,
    /// The first choice of an n > 1 request, until it forks the others at its first token.
    fork: Option<Fork>,
}

/// What the other choices of a request start from: their number and the grammar before any
/// token.
struct Fork {
    n: usize,
    guide: Option<Guide>,
}

impl SeqState {
    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.req.prompt.len() as u32,
            image_tokens: self.req.image_tokens,
            completion_tokens: self.generated.len() as u32,
            cached_tokens: self.cached_tokens,
            video_tokens: self.req.video_tokens,
        }
    }
}

struct Engine {
    backend: Box<dyn LmBackend>,
    sched: Scheduler,
    /// What every prefix-cache key of this replica shares (model, dtype, block size).
    salt: BlockKey,
    seqs: HashMap<SeqId, SeqState>,
    rx: mpsc::Receiver<Command>,
    load: Arc<Mutex<SchedulerLoad>>,
}

impl Engine {
    fn run(&mut self) {
        loop {
            if self.sched.is_empty() {
                match self.rx.recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            return self.stop();
                        }
                    }
                    Err(_) => return self.stop(),
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            return self.stop();
                        }
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        if self.sched.is_empty() {
                            return self.stop();
                        }
                        break;
                    }
                }
            }
            self.reap_cancelled();
            let plan = self.sched.schedule(Instant::now());
            self.step(&plan);
            self.publish();
            if plan.is_idle() && !self.sched.is_empty() {
                std::thread::yield_now();
            }
        }
    }

    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Shutdown => false,
            Command::Generate(req) => {
                let fork = (req.n > 1).then(|| Fork {
                    n: req.n,
                    guide: req.guide.clone(),
                });
                self.admit(*req, fork);
                true
            }
        }
    }

    /// Queues one sequence.
    fn admit(&mut self, mut req: SeqRequest, fork: Option<Fork>) -> SeqId {
        let id = SEQ_IDS.fetch_add(1, Ordering::Relaxed);
        let queue_span = tracing::info_span!(parent: &req.span, "queue", seq = id);
        self.sched.add(id, req.prompt.len(), req.deadline);
        let mut keys = KeyChain::new(
            self.salt,
            self.sched.config().block_len as usize,
            image_spans(&req),
        );
        keys.extend(&req.prompt, &[]);
        self.sched.extend_keys(id, keys.keys());
        let sampler = Sampler::new(req.sampling.clone(), &req.prompt).with_guide(req.guide.take());
        self.seqs.insert(
            id,
            SeqState {
                req,
                generated: Vec::new(),
                sampler,
                last_token_at: None,
                queue_span: Some(queue_span),
                cached_tokens: 0,
                keys,
                fork,
            },
        );
        id
    }

    /// The first choice's prefill is done: the other choices start now, reading its prompt
    /// blocks from the prefix cache. Each has its own generator (seed + index, as vLLM).
    fn fork(&mut self, id: SeqId) {
        let Some(s) = self.seqs.get_mut(&id) else {
            return;
        };
        let Some(f) = s.fork.take() else {
            return;
        };
        let r = &s.req;
        let children: Vec<SeqRequest> = (1..f.n)
            .map(|i| SeqRequest {
                request_id: r.request_id.clone(),
                prompt: r.prompt.clone(),
                images: r.images.clone(),
                image_hashes: r.image_hashes.clone(),
                layout: r.layout.clone(),
                image_tokens: r.image_tokens,
                video_tokens: r.video_tokens,
                sampling: SamplingConfig {
                    seed: r.sampling.seed.wrapping_add(i as u64),
                    ..r.sampling.clone()
                },
                guide: f.guide.clone(),
                n: 1,
                index: i as u32,
                max_new_tokens: r.max_new_tokens,
                stop_ids: r.stop_ids.clone(),
                deadline: r.deadline,
                events: r.events.clone(),
                span: r.span.clone(),
                received: r.received,
            })
            .collect();
        for c in children {
            self.admit(c, None);
        }
    }

    fn stop(&mut self) {
        for (id, s) in self.seqs.drain() {
            self.sched.finish(id);
            let _ = s.req.events.send(Err(LmError::Unavailable(
                "the LM service is shutting down".into(),
            )));
        }
        self.publish();
    }

    /// Sequences whose caller went away leave now; their blocks go back to the pool.
    fn reap_cancelled(&mut self) {
        let gone: Vec<SeqId> = self
            .seqs
            .iter()
            .filter(|(_, s)| s.req.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            if let Some(s) = self.seqs.remove(&id) {
                tracing::info!(parent: &s.req.span, request_id = %s.req.request_id, "caller went away; sequence dropped");
            }
            self.sched.finish(id);
        }
    }

    fn step(&mut self, plan: &StepPlan) {
        for &id in &plan.expired {
            if let Some(s) = self.seqs.remove(&id) {
                tracing::info!(parent: &s.req.span, request_id = %s.req.request_id, "deadline passed; sequence dropped");
                let _ = s.req.events.send(Ok(GenEvent {
                    index: s.req.index,
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                    finish: Some(Finish::Cancelled),
                    usage: s.usage(),
                }));
            }
        }
        if !plan.preempted.is_empty() {
            metrics::counter!("vlm_lm_preemptions_total").increment(plan.preempted.len() as u64);
            for id in &plan.preempted {
                if let Some(s) = self.seqs.get(id) {
                    tracing::info!(parent: &s.req.span, request_id = %s.req.request_id, "preempted: KV blocks freed, will recompute");
                }
            }
        }
        for id in &plan.admitted {
            if let Some(s) = self.seqs.get_mut(id) {
                s.queue_span.take(); // first admission ends the queue span
            }
        }

        // The decode rows and the prefill chunks of this step, built before anything runs.
        let decode_rows: Option<Result<Vec<DecodeRow>, LmError>> = plan.decode.as_ref().map(|d| {
            let rows: Vec<DecodeRow> = d
                .rows
                .iter()
                .filter_map(|r| {
                    let s = self.seqs.get(&r.seq)?;
                    Some(DecodeRow {
                        token: *s.generated.last()?,
                        position: s.req.layout.decode_position(r.context_len),
                        context_len: r.context_len,
                        block_table: r.block_table.clone(),
                    })
                })
                .collect();
            if rows.len() == d.rows.len() {
                Ok(rows)
            } else {
                Err(LmError::internal("a decode row's sequence is missing"))
            }
        });
        // Each planned chunk of a sequence still here: built, or the error that fails it.
        let mut chunk_failures: Vec<(SeqId, LmError)> = Vec::new();
        let mut chunks: Vec<(&PrefillPlan, tracing::Span)> = Vec::new();
        let mut inputs: Vec<PrefillChunk> = Vec::new();
        for p in &plan.prefills {
            let Some(s) = self.seqs.get(&p.seq) else {
                continue;
            };
            let span = tracing::info_span!(parent: &s.req.span, "prefill_chunk", start = p.start, len = p.len, packed = plan.prefills.len());
            // A range the chunk builder refuses is a scheduler bug, not the caller's.
            match build_chunk(
                &s.req.layout,
                &s.req.prompt,
                &s.generated,
                &s.req.images,
                p.start,
                p.len,
                p.block_table.clone(),
            ) {
                Ok(c) => {
                    chunks.push((p, span));
                    inputs.push(c);
                }
                Err(e) => chunk_failures.push((p.seq, LmError::internal(e.to_string()))),
            }
            metrics::counter!("vlm_lm_prefill_tokens_total").increment(p.len as u64);
        }
        if chunks.len() > 1 {
            metrics::counter!("vlm_lm_packed_prefill_steps_total").increment(1);
        }

        // One packed step: the chunks and the decode batch, which the backend may run through
        // the weights together (`LmBackend::packed_step`).
        let (graph, rows) = match (&plan.decode, decode_rows) {
            (Some(d), Some(Ok(rows))) => (d.graph as usize, rows),
            (Some(d), Some(Err(e))) => {
                for r in &d.rows {
                    self.fail(r.seq, e.clone());
                }
                (0, Vec::new())
            }
            _ => (0, Vec::new()),
        };
        let decoding = !rows.is_empty();
        // `graph` only on a step that decodes (a decode graph ran).
        let span = tracing::info_span!(
            "step",
            graph = tracing::field::Empty,
            rows = rows.len(),
            prefill_chunks = chunks.len(),
            prefill_tokens = chunks.iter().map(|(p, _)| p.len).sum::<usize>()
        );
        let out = if decoding || !chunks.is_empty() {
            let _g = span.enter();
            // Each request's span records the graph its sequence ran in, so the request's
            // trace shows it; its chunk's span covers the step that carried it.
            let mut entered: Vec<_> = chunks.iter().map(|(_, s)| s.enter()).collect();
            if let Some(d) = plan.decode.as_ref().filter(|_| decoding) {
                span.record("graph", d.graph);
                for r in &d.rows {
                    if let Some(s) = self.seqs.get(&r.seq) {
                        s.req.span.record("graph", d.graph);
                    }
                }
                metrics::counter!("vlm_lm_decode_steps_total", "graph" => d.graph.to_string())
                    .increment(1);
            }
            // The rows' grammar masks are computed on a thread beside the forward pass (they
            // depend only on the tokens so far); sampling then only applies them.
            let mut guides: Vec<&mut Guide> = match &plan.decode {
                Some(d) if decoding => self
                    .seqs
                    .iter_mut()
                    .filter(|(id, _)| d.rows.iter().any(|r| r.seq == **id))
                    .filter_map(|(_, s)| s.sampler.guide_mut())
                    .collect(),
                _ => Vec::new(),
            };
            let backend = &mut self.backend;
            let inputs = &inputs;
            let out = std::thread::scope(|scope| {
                let masks = (!guides.is_empty())
                    .then(|| scope.spawn(move || guides.iter_mut().for_each(|g| g.prepare())));
                let out = backend.packed_step(inputs, graph, &rows);
                if let Some(h) = masks {
                    let _ = h.join();
                }
                out
            });
            while entered.pop().is_some() {} // exited innermost first
            Some(out)
        } else {
            None
        };

        self.sched.update(plan);

        for (id, e) in chunk_failures {
            tracing::warn!(error = %e, "prefill chunk failed");
            self.fail(id, e);
        }
        let Some(out) = out else {
            return;
        };
        if let Some(d) = plan.decode.as_ref().filter(|_| decoding) {
            match out.decode {
                Ok(logits) => {
                    for (r, row) in d.rows.iter().zip(logits) {
                        self.sample_and_emit(r.seq, &row);
                    }
                }
                Err(e) => {
                    let e = LmError::from(e);
                    tracing::error!(error = %e, "decode step failed");
                    for r in &d.rows {
                        self.fail(r.seq, e.clone());
                    }
                }
            }
        }
        for ((p, _), logits) in chunks.iter().zip(out.chunks) {
            match logits {
                Ok(logits) if p.sample => self.sample_and_emit(p.seq, &logits),
                Ok(_) => {}
                Err(e) => {
                    let e = LmError::from(e);
                    tracing::warn!(error = %e, "prefill chunk failed");
                    self.fail(p.seq, e);
                }
            }
        }
    }

    fn sample_and_emit(&mut self, id: SeqId, logits: &[f32]) {
        self.fork(id);
        let Some(s) = self.seqs.get_mut(&id) else {
            return;
        };
        let Sampled {
            token,
            logprob,
            grammar_done,
        } = match s.sampler.sample(logits, &s.req.stop_ids) {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(parent: &s.req.span, error = %e, "sampling failed");
                self.fail(id, LmError::internal(e));
                return;
            }
        };
        let now = Instant::now();
        match s.last_token_at {
            None => {
                metrics::histogram!("vlm_lm_time_to_first_token_seconds")
                    .record(now.duration_since(s.req.received).as_secs_f64());
                // The prompt is in the cache: how much of it was read rather than computed.
                let hit = self.sched.prefix_hit(id).unwrap_or(0);
                s.cached_tokens = hit as u32;
                metrics::counter!("vlm_lm_prefix_cache_prompt_tokens_total")
                    .increment(s.req.prompt.len() as u64);
                metrics::counter!("vlm_lm_prefix_cache_hit_tokens_total").increment(hit as u64);
            }
            Some(t) => metrics::histogram!("vlm_lm_time_per_output_token_seconds")
                .record(now.duration_since(t).as_secs_f64()),
        }
        metrics::counter!("vlm_lm_generated_tokens_total").increment(1);
        s.last_token_at = Some(now);
        s.generated.push(token);
        // A block of known tokens became full: its key, for the prefix cache.
        let added = s.keys.extend(&s.req.prompt, &s.generated);
        if added > 0 {
            let keys = s.keys.keys();
            self.sched.extend_keys(id, &keys[keys.len() - added..]);
        }
        let finish = if s.req.stop_ids.contains(&token) || grammar_done {
            Some(Finish::Stop)
        } else if s.generated.len() >= s.req.max_new_tokens {
            Some(Finish::Length)
        } else {
            None
        };
        let sent = s.req.events.send(Ok(GenEvent {
            index: s.req.index,
            tokens: vec![token],
            logprobs: logprob.into_iter().collect(),
            finish,
            usage: s.usage(),
        }));
        if finish.is_some() || sent.is_err() {
            self.seqs.remove(&id);
            self.sched.finish(id);
        }
    }

    fn fail(&mut self, id: SeqId, e: LmError) {
        if let Some(s) = self.seqs.remove(&id) {
            let _ = s.req.events.send(Err(e));
        }
        self.sched.finish(id);
    }

    fn publish(&self) {
        let l = self.sched.load();
        metrics::gauge!("vlm_lm_running").set(l.running as f64);
        metrics::gauge!("vlm_lm_waiting").set(l.waiting as f64);
        metrics::gauge!("vlm_lm_kv_blocks_used").set((l.total_blocks - l.free_blocks) as f64);
        metrics::gauge!("vlm_lm_kv_blocks_free").set(l.free_blocks as f64);
        metrics::gauge!("vlm_lm_kv_blocks_cached").set(l.cached_blocks as f64);
        if let Ok(mut g) = self.load.lock() {
            *g = l;
        }
    }
}
