//! One generation, edge-independent: validate, admit, route, open the LM stream (retrying once
//! on another LM replica when it fails before the first token), then pump token events into
//! text deltas until the end, a stop string, or the caller going away (which drops the LM
//! stream, so the LM frees the sequence's KV blocks).
use crate::admission::{Admission, Permit};
use crate::client::{lm_request, ClientError, Part};
use crate::error::GatewayError;
use crate::logprobs::{show, ShownLogprob};
use crate::metrics as m;
use crate::routing::{Lease, PrefixKey, Router};
use crate::stream::TextStream;
use crate::validation::{ChatRequest, ValidRequest, Validator};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use vlm_proto::v1::{lm_client::LmClient, TokenEvent};
use vlm_service_kit::generation::{Finish, Usage};

/// One message of the output stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Delta {
    /// Which choice (0..n) this delta is of.
    pub index: u32,
    pub text: String,
    pub token_ids: Vec<u32>,
    /// One per token id when the request asked for logprobs, else empty.
    pub logprobs: Vec<ShownLogprob>,
    /// Set on the choice's last delta.
    pub finish: Option<Finish>,
    /// Accounting of the whole request so far (final on the stream's last delta).
    pub usage: Usage,
    /// The stream's last delta: every choice has finished.
    pub end: bool,
}

/// Counts one request in `vlm_gateway_requests_total` (and its duration) exactly once, from
/// its arrival at an edge: refused with the error's label, handed to the stream pump (which
/// counts how the stream ends), or, when dropped before either (the caller went away while
/// it waited for admission, an image fetch or its first token), as `cancelled`.
pub struct Tally {
    arrived: Instant,
    done: bool,
}

impl Tally {
    pub fn start() -> Self {
        Tally {
            arrived: Instant::now(),
            done: false,
        }
    }

    /// Counts the request as refused with `e`, and gives `e` back.
    pub fn refuse(mut self, e: GatewayError) -> GatewayError {
        self.finish(e.status_label());
        e
    }

    fn finish(&mut self, label: &'static str) {
        if !self.done {
            self.done = true;
            m::request_finished(label);
            metrics::histogram!(m::REQUEST_DURATION_SECONDS)
                .record(self.arrived.elapsed().as_secs_f64());
        }
    }

    /// The stream's pump counts it from here.
    fn hand_over(mut self) -> Instant {
        self.done = true;
        self.arrived
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        self.finish("cancelled");
    }
}

/// A started generation: the first LM event has arrived.
pub struct Generation {
    pub request_id: String,
    pub rx: mpsc::Receiver<Result<Delta, GatewayError>>,
}

/// Everything a request needs; cheap to clone.
#[derive(Clone)]
pub struct Core {
    inner: Arc<CoreInner>,
}

struct CoreInner {
    validator: Validator,
    admission: Admission,
    router: Router,
    next_id: AtomicU64,
    id_prefix: String,
}

impl Core {
    pub fn new(validator: Validator, admission: Admission, router: Router) -> Self {
        let id_prefix = format!("{:08x}", rand::random::<u32>());
        Core {
            inner: Arc::new(CoreInner {
                validator,
                admission,
                router,
                next_id: AtomicU64::new(0),
                id_prefix,
            }),
        }
    }

    pub fn validator(&self) -> &Validator {
        &self.inner.validator
    }
    pub fn admission(&self) -> &Admission {
        &self.inner.admission
    }
    pub fn router(&self) -> &Router {
        &self.inner.router
    }

    /// Validates, admits, routes and waits for the first LM event. Errors before that are
    /// returned here (so an edge can answer them with a status); later ones come on the stream.
    /// `parent` carries the caller's trace context (extracted by the edge).
    /// `tally` counts the request: here when it fails (or is dropped, cancelled, before its
    /// first token), after that by the stream's pump.
    pub async fn start(
        &self,
        req: ChatRequest,
        parent: tracing::Span,
        tally: Tally,
    ) -> Result<Generation, GatewayError> {
        self.start_with(req, parent, tally, false).await
    }

    /// [`start`](Self::start) for an edge that can answer before admission (an HTTP stream
    /// sends its status line then): a request that has to queue returns at once, and its wait
    /// in the queue, its first token and any error after that come on the stream. Validation
    /// errors and admission's immediate refusals are still returned here, and so is
    /// everything of a request admitted at once. A caller that drops the stream gives up its
    /// place in the queue.
    pub async fn start_streaming(
        &self,
        req: ChatRequest,
        parent: tracing::Span,
        tally: Tally,
    ) -> Result<Generation, GatewayError> {
        self.start_with(req, parent, tally, true).await
    }

    async fn start_with(
        &self,
        req: ChatRequest,
        parent: tracing::Span,
        tally: Tally,
        answer_queued: bool,
    ) -> Result<Generation, GatewayError> {
        let (request_id, valid, entry) = match self.enter(req) {
            Ok(x) => x,
            Err(e) => return Err(tally.refuse(e)),
        };
        let (tx, rx) = mpsc::channel(64);
        if !(answer_queued && entry.is_queued()) {
            self.run(request_id.clone(), valid, entry, parent, tally, tx)
                .await?;
            return Ok(Generation { request_id, rx });
        }
        let core = self.clone();
        let id = request_id.clone();
        tokio::spawn(async move {
            let run = core.run(id, valid, entry, parent, tally, tx.clone());
            tokio::select! {
                biased;
                // Gone while queued or before the first token: dropping `run` leaves the queue
                // (or the LM call) and counts the request as cancelled.
                _ = tx.closed() => {}
                r = run => {
                    if let Err(e) = r {
                        let _ = tx.send(Err(e)).await;
                    }
                }
            }
        });
        Ok(Generation { request_id, rx })
    }

    /// Validates and takes the request's place in admission (admitted, queued, or refused).
    fn enter(
        &self,
        req: ChatRequest,
    ) -> Result<(String, ValidRequest, crate::admission::Entry), GatewayError> {
        let i = &self.inner;
        let valid = i.validator.validate(req)?;
        let entry = i.admission.enter(valid.kv_tokens())?;
        let request_id = format!(
            "{}-{}",
            i.id_prefix,
            i.next_id.fetch_add(1, Ordering::Relaxed)
        );
        Ok((request_id, valid, entry))
    }

    /// Waits for admission, routes, waits for the first LM event, then pumps the stream into
    /// `tx`. Errors before the first event are returned (and counted by `tally`).
    async fn run(
        &self,
        request_id: String,
        valid: ValidRequest,
        entry: crate::admission::Entry,
        parent: tracing::Span,
        tally: Tally,
        tx: mpsc::Sender<Result<Delta, GatewayError>>,
    ) -> Result<(), GatewayError> {
        let i = &self.inner;
        let permit = match entry.wait().await {
            Ok(p) => p,
            Err(e) => return Err(tally.refuse(e)),
        };
        metrics::counter!(m::PROMPT_TOKENS_TOTAL).increment(valid.prompt_tokens() as u64);
        metrics::counter!(m::VISION_TOKENS_TOTAL, "kind" => "image")
            .increment(valid.image_tokens as u64);
        metrics::counter!(m::VISION_TOKENS_TOTAL, "kind" => "video")
            .increment(valid.video_tokens as u64);
        // Videos are decoded once admitted (their cost was bounded from the header).
        let videos = match decode_videos(&valid, &i.validator.limits().video).await {
            Ok(v) => v,
            Err(e) => return Err(tally.refuse(e)),
        };
        let span = tracing::info_span!(parent: &parent, "generate", request_id = %request_id);
        // Prefix routing keys on images only; a prompt with a video goes by load.
        let key = i
            .router
            .prefix_block_len()
            .filter(|_| valid.videos.is_empty())
            .and_then(|block_len| {
                PrefixKey::first_block(
                    &valid.input_ids,
                    i.validator.tokenizer().image_pad_id(),
                    valid.images.iter().map(|im| (&im.content_hash, im.tokens)),
                    block_len,
                )
            });
        let (lm, stream, first) = match self
            .open(&request_id, &valid, &videos, key.as_ref())
            .instrument_span(span.clone())
            .await
        {
            Ok(o) => o,
            Err(e) => return Err(tally.refuse(e)),
        };
        let arrived = tally.hand_over();
        tracing::debug!(lm = %lm.addr, "first event");
        let n = valid.sampling.n.max(1) as usize;
        let pump = Pump {
            choices: (0..n)
                .map(|_| Choice {
                    text: TextStream::new(
                        i.validator.tokenizer(),
                        valid.sampling.stop.clone(),
                        valid.sampling.min_tokens,
                    ),
                    tokens: 0,
                    done: false,
                })
                .collect(),
            tokenizer: i.validator.tokenizer().clone(),
            usage: Usage {
                prompt_tokens: valid.prompt_tokens(),
                image_tokens: valid.image_tokens,
                completion_tokens: 0,
                cached_tokens: 0,
                video_tokens: valid.video_tokens,
            },
            max_tokens: valid.sampling.max_tokens,
            arrived,
            first_token_at: None,
        };
        tokio::spawn(
            pump.run(first, stream, tx, lm, permit)
                .instrument_span(span.clone()),
        );
        Ok(())
    }

    /// Opens the LM stream and reads its first event. Before that event a call that failed on
    /// its connection is tried once more on the same replica over a new one (after a stall the
    /// pooled HTTP/2 connection can be dead while the replica is fine, and with one replica
    /// there is no other); a replica that fails is left for a second replica, once.
    async fn open(
        &self,
        request_id: &str,
        valid: &ValidRequest,
        videos: &[Vec<crate::video::Group>],
        key: Option<&PrefixKey>,
    ) -> Result<(Lease, tonic::Streaming<TokenEvent>, TokenEvent), GatewayError> {
        let router = &self.inner.router;
        let mut tried: Vec<String> = Vec::new();
        let mut last: Option<ClientError> = None;
        let mut redialled = false;
        let mut again: Option<Lease> = None;
        let mut attempt = 0;
        while attempt < 2 {
            let lm = match again.take() {
                Some(lease) => lease,
                None => {
                    let pick = match router.pick_lm(&tried, key) {
                        Ok(p) => p,
                        Err(e) => return Err(last.map(GatewayError::from).unwrap_or(e)),
                    };
                    tracing::debug!(
                        request_id,
                        attempt,
                        lm = %pick.lease.addr,
                        route = pick.route.label(),
                        passed_over = pick.passed_over.as_deref().unwrap_or(""),
                        "LM replica chosen"
                    );
                    metrics::counter!(m::LM_ROUTES_TOTAL, "route" => pick.route.label())
                        .increment(1);
                    pick.lease
                }
            };
            // Only requests with images need a vision replica: text is served while vision
            // is down.
            let vision = if valid.order.is_empty() {
                None
            } else {
                Some(router.pick_vision()?)
            };
            let replica = vision.as_ref().map(|v| v.addr.clone()).unwrap_or_default();
            let req = lm_request(request_id, valid, videos, replica);
            // The vision lease counts until the first token: the images are encoded by then.
            let first = first_event(&lm, req, router.internal_token()).await;
            let vision_addr = vision.map(|v| v.addr.clone());
            let e = match first {
                Ok((stream, first)) => return Ok((lm, stream, first)),
                Err(e) => e,
            };
            tracing::warn!(request_id, lm = %lm.addr, vision = vision_addr.as_deref().unwrap_or(""),
                part = ?e.part(), error = %e, "failed before the first token");
            if !e.retryable() {
                return Err(e.into());
            }
            if e.connection_failed() && !redialled {
                redialled = true;
                again = router.redial_lm(&lm.addr);
                if again.is_some() {
                    metrics::counter!(m::LM_REDIALS_TOTAL).increment(1);
                    last = Some(e);
                    continue;
                }
            }
            // Blame the part that failed; the other stays in rotation.
            match (e.part(), &vision_addr) {
                (Part::Vision, Some(v)) => router.mark_vision_failed(v),
                _ => {
                    tried.push(lm.addr.clone());
                    if e.replica_down() {
                        router.mark_lm_failed(&lm.addr);
                    }
                }
            }
            last = Some(e);
            attempt += 1;
        }
        Err(last
            .map(GatewayError::from)
            .unwrap_or_else(|| GatewayError::Unavailable("no LM replica".into())))
    }
}

/// Every video of the request decoded into its temporal groups, on the blocking pool.
async fn decode_videos(
    valid: &ValidRequest,
    limits: &crate::video::VideoLimits,
) -> Result<Vec<Vec<crate::video::Group>>, GatewayError> {
    if valid.videos.is_empty() {
        return Ok(Vec::new());
    }
    let (videos, limits) = (valid.videos.clone(), limits.clone());
    tokio::task::spawn_blocking(move || {
        videos
            .iter()
            .enumerate()
            .map(|(k, v)| crate::video::decode_groups(k, v, &limits))
            .collect()
    })
    .await
    .map_err(|e| GatewayError::Internal(format!("video decoding stopped: {e}")))?
}

async fn first_event(
    lm: &Lease,
    req: vlm_proto::v1::LmGenerateRequest,
    token: Option<&vlm_service_kit::internal_auth::InternalToken>,
) -> Result<(tonic::Streaming<TokenEvent>, TokenEvent), ClientError> {
    let mut client = LmClient::new(lm.channel.clone())
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(256 << 20);
    let mut req = tonic::Request::new(req);
    vlm_service_kit::telemetry::inject(req.metadata_mut());
    vlm_service_kit::internal_auth::attach(token, &mut req);
    let mut stream = client
        .generate(req)
        .await
        .map_err(|s| ClientError::from_status(&lm.addr, s))?
        .into_inner();
    match stream.message().await {
        Ok(Some(ev)) => Ok((stream, ev)),
        Ok(None) => Err(ClientError::Unreachable {
            addr: lm.addr.clone(),
            message: "the stream ended before the first event".into(),
            code: tonic::Code::Unknown,
            part: Part::Lm,
            transport: false,
        }),
        Err(s) => Err(ClientError::from_status(&lm.addr, s)),
    }
}

/// One choice's text and state.
struct Choice {
    text: TextStream,
    tokens: u32,
    done: bool,
}

struct Pump {
    choices: Vec<Choice>,
    /// Texts of logprob tokens.
    tokenizer: vlm_tokenizer::ChatTokenizer,
    usage: Usage,
    max_tokens: u32,
    arrived: Instant,
    first_token_at: Option<Instant>,
}

impl Pump {
    async fn run(
        mut self,
        first: TokenEvent,
        mut stream: tonic::Streaming<TokenEvent>,
        tx: mpsc::Sender<Result<Delta, GatewayError>>,
        lm: Lease,
        permit: Permit,
    ) {
        let mut next = Some(first);
        let status: &'static str = loop {
            let ev = match next.take() {
                Some(ev) => ev,
                None => {
                    let msg = tokio::select! {
                        biased;
                        _ = tx.closed() => break "cancelled",
                        msg = stream.message() => msg,
                    };
                    match msg {
                        Ok(Some(ev)) => ev,
                        Ok(None) => {
                            // Ended without a finish reason: treat as the end of the output.
                            for d in self.finish_all(Finish::Length) {
                                let _ = tx.send(d).await;
                            }
                            break "ok";
                        }
                        Err(s) => {
                            tracing::warn!(lm = %lm.addr, code = ?s.code(), message = s.message(),
                                "LM failed after the first token");
                            let e = GatewayError::Unavailable(format!(
                                "the LM service failed after the first token ({:?})",
                                s.code()
                            ));
                            let label = e.status_label();
                            let _ = tx.send(Err(e)).await;
                            break label;
                        }
                    }
                }
            };
            match self.on_event(ev) {
                Ok(None) => {}
                Ok(Some(delta)) => {
                    let end = delta.end;
                    if tx.send(Ok(delta)).await.is_err() {
                        break "cancelled";
                    }
                    if end {
                        break "ok";
                    }
                }
                Err(e) => {
                    let label = e.status_label();
                    let _ = tx.send(Err(e)).await;
                    break label;
                }
            }
        };
        // Dropping the LM stream cancels the call: the LM frees the sequence's blocks.
        drop(stream);
        drop(lm);
        drop(permit);
        m::request_finished(status);
        metrics::counter!(m::COMPLETION_TOKENS_TOTAL)
            .increment(self.usage.completion_tokens as u64);
        metrics::counter!(m::CACHED_PROMPT_TOKENS_TOTAL).increment(self.usage.cached_tokens as u64);
        metrics::histogram!(m::REQUEST_DURATION_SECONDS)
            .record(self.arrived.elapsed().as_secs_f64());
    }

    /// Turns one LM event into its choice's delta (`None` for a choice already ended by a stop
    /// string, whose further tokens are dropped).
    fn on_event(&mut self, ev: TokenEvent) -> Result<Option<Delta>, GatewayError> {
        if !ev.token_ids.is_empty() && self.first_token_at.is_none() {
            let now = Instant::now();
            self.first_token_at = Some(now);
            metrics::histogram!(m::TIME_TO_FIRST_TOKEN_SECONDS)
                .record((now - self.arrived).as_secs_f64());
        }
        // Every LM event carries its cumulative usage: its latest cached count stands. The
        // other counts are the gateway's own (it ends streams at stop strings).
        if let Some(u) = &ev.usage {
            self.usage.cached_tokens = u.cached_tokens;
        }
        let index = ev.index;
        let n = self.choices.len();
        let c = self.choices.get_mut(index as usize).ok_or_else(|| {
            GatewayError::Internal(format!("the LM sent choice {index} of a request for {n}"))
        })?;
        if c.done {
            return Ok(None);
        }
        c.tokens += ev.token_ids.len() as u32;
        self.usage.completion_tokens += ev.token_ids.len() as u32;
        let logprobs: Vec<ShownLogprob> = ev
            .logprobs
            .into_iter()
            .map(|l| show(&self.tokenizer, l.into()))
            .collect();
        if Finish::from_wire(ev.finish_reason) == Some(Finish::Cancelled) {
            // Not an OpenAI end: the request failed (its stream ends with this error).
            return Err(GatewayError::DeadlineExceeded(format!(
                "the deadline passed after {} generated tokens",
                self.usage.completion_tokens
            )));
        }
        let d = c.text.push(&ev.token_ids)?;
        let finish = if d.stopped {
            Some(Finish::Stop)
        } else {
            Finish::from_wire(ev.finish_reason)
                .or_else(|| (c.tokens >= self.max_tokens).then_some(Finish::Length))
        };
        let mut text = d.text;
        if finish.is_some() {
            c.done = true;
            if !d.stopped {
                text.push_str(&c.text.finish()?.text);
            }
        }
        Ok(Some(Delta {
            index,
            text,
            token_ids: ev.token_ids,
            logprobs,
            finish,
            usage: self.usage,
            end: self.choices.iter().all(|c| c.done),
        }))
    }

    /// The LM stream ended early: every open choice ends with `finish`.
    fn finish_all(&mut self, finish: Finish) -> Vec<Result<Delta, GatewayError>> {
        let open: Vec<usize> = (0..self.choices.len())
            .filter(|&i| !self.choices[i].done)
            .collect();
        let last = open.last().copied();
        open.into_iter()
            .map(|i| {
                let c = &mut self.choices[i];
                c.done = true;
                let rest = c.text.finish()?;
                Ok(Delta {
                    index: i as u32,
                    text: rest.text,
                    token_ids: Vec::new(),
                    logprobs: Vec::new(),
                    finish: Some(finish),
                    usage: self.usage,
                    end: Some(i) == last,
                })
            })
            .collect()
    }
}

trait InstrumentSpan: Sized {
    fn instrument_span(self, span: tracing::Span) -> tracing::instrument::Instrumented<Self>;
}

impl<F: std::future::Future> InstrumentSpan for F {
    fn instrument_span(self, span: tracing::Span) -> tracing::instrument::Instrumented<Self> {
        tracing::Instrument::instrument(self, span)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vlm_proto::v1 as pb;

    fn pump(prompt_tokens: u32) -> Pump {
        let tok =
            vlm_tokenizer::ChatTokenizer::from_dir(&crate::validation::tests::tiny_dir()).unwrap();
        Pump {
            choices: vec![Choice {
                text: TextStream::new(&tok, Vec::new(), 0),
                tokens: 0,
                done: false,
            }],
            tokenizer: tok.clone(),
            usage: Usage {
                prompt_tokens,
                image_tokens: 0,
                completion_tokens: 0,
                cached_tokens: 0,
                video_tokens: 0,
            },
            max_tokens: 10,
            arrived: Instant::now(),
            first_token_at: None,
        }
    }

    fn event(token_ids: Vec<u32>, finish: Option<Finish>, cached: Option<u32>) -> TokenEvent {
        TokenEvent {
            token_ids,
            finish_reason: Finish::to_wire(finish),
            usage: cached.map(|cached_tokens| pb::Usage {
                prompt_tokens: 96,
                image_tokens: 0,
                completion_tokens: 1,
                cached_tokens,
                video_tokens: 0,
            }),
            logprobs: Vec::new(),
            index: 0,
        }
    }

    #[test]
    fn an_lm_deadline_is_an_error_not_a_finish_reason() {
        let mut p = pump(96);
        p.on_event(event(vec![5], None, None)).unwrap();
        let e = p
            .on_event(event(vec![], Some(Finish::Cancelled), None))
            .unwrap_err();
        assert_eq!(e.http_status(), axum::http::StatusCode::GATEWAY_TIMEOUT);
        assert!(e.to_string().contains("after 1 generated tokens"), "{e}");
    }

    #[test]
    fn the_lms_cached_tokens_reach_every_delta() {
        let mut p = pump(96);
        let d = p.on_event(event(vec![5], None, Some(64))).unwrap().unwrap();
        assert!(!d.end);
        assert_eq!(d.usage.cached_tokens, 64);
        assert_eq!((d.usage.prompt_tokens, d.usage.completion_tokens), (96, 1));
        // An event without usage keeps the last count; the last delta carries it.
        let d = p
            .on_event(event(vec![6], Some(Finish::Stop), None))
            .unwrap()
            .unwrap();
        assert_eq!(d.finish, Some(Finish::Stop));
        assert!(d.end);
        assert_eq!(d.usage.cached_tokens, 64);
        assert_eq!(d.usage.completion_tokens, 2);
        // A later count (the LM recomputed part of the prompt) replaces it.
        let mut p = pump(96);
        p.on_event(event(vec![5], None, Some(64))).unwrap();
        let d = p.on_event(event(vec![6], None, Some(32))).unwrap().unwrap();
        assert_eq!(d.usage.cached_tokens, 32);
    }
}
