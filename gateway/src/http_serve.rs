//! The HTTP port's connections: each served by hyper's HTTP/1.1 server under four bounds, so
//! that idle or slow clients cannot hold the gateway's sockets (and file descriptors) forever.
//!
//! - **Header read**: a request's headers must be complete within `header_read_timeout`,
//!   counted from the connection's accept (its first request) or from the first byte of the
//!   request (later ones). A connection that sends nothing, or half its headers, is closed.
//! - **Body read**: a request's body must arrive whole within `body_read_timeout` of its
//!   headers; a handler reading it then gets [`BodyTimeout`] (a 408 naming the flag).
//! - **Keep-alive idle**: a connection with no request in flight that has received nothing
//!   since its last response is closed after `idle_timeout`.
//! - **Connections**: at most `max_connections` are open at once; one accepted over the cap is
//!   closed at once, so the serving ones keep their descriptors.
//!
//! A running request (a long stream included) is never cut by these timeouts. On shutdown the
//! accept loop stops, idle connections close, and [`serve`] returns once every connection has
//! finished its responses.
use crate::metrics as m;
use axum::body::Body;
use bytes::Bytes;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper::service::Service as _;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The bounds on the HTTP port's connections (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// From the accept (or a later request's first byte) to the end of the request's headers.
    pub header_read_timeout: Duration,
    /// From the end of a request's headers to the end of its body.
    pub body_read_timeout: Duration,
    /// A keep-alive connection with nothing in flight and nothing received is closed after it.
    pub idle_timeout: Duration,
    /// Connections open at once; more are closed as they are accepted.
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(75),
            max_connections: 4096,
        }
    }
}

/// A request body that did not arrive within `--http-body-read-timeout-ms`.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "the request body did not arrive within {} ms (--http-body-read-timeout-ms)",
    .0.as_millis()
)]
pub struct BodyTimeout(pub Duration);

impl BodyTimeout {
    /// The [`BodyTimeout`] anywhere in `e`'s chain of sources (a body error wraps it).
    pub fn find<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a BodyTimeout> {
        let mut cur = Some(e);
        while let Some(err) = cur {
            if let Some(t) = err.downcast_ref::<BodyTimeout>() {
                return Some(t);
            }
            cur = err.source();
        }
        None
    }
}

/// Serves `app` on `listener` under `limits` until `stop` is cancelled, then waits for every
/// connection to finish (idle ones close at once, running responses end).
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: HttpLimits,
    stop: CancellationToken,
) {
    let cap = limits.max_connections.clamp(1, u32::MAX as usize);
    let slots = Arc::new(Semaphore::new(cap));
    loop {
        let (stream, peer) = tokio::select! {
            _ = stop.cancelled() => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of descriptors (EMFILE) and the like: the cap should prevent it; back
                    // off instead of spinning.
                    tracing::warn!(error = %e, "HTTP accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            metrics::counter!(m::HTTP_CONNECTIONS_CLOSED_TOTAL, "reason" => "over_cap")
                .increment(1);
            tracing::debug!(%peer, max = cap, "HTTP connection over --http-max-connections closed");
            drop(stream);
            continue;
        };
        tokio::spawn(connection(
            stream,
            app.clone(),
            limits,
            stop.clone(),
            permit,
        ));
    }
    drop(listener);
    // Every permit back: every connection has ended.
    let _ = slots.acquire_many(cap as u32).await;
}

/// Why a waiting connection would be closed.
#[derive(Debug, Clone, Copy)]
enum Expiry {
    Header,
    Idle,
}

impl Expiry {
    fn label(self) -> &'static str {
        match self {
            Expiry::Header => "header_timeout",
            Expiry::Idle => "idle_timeout",
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    /// Waiting for a request's headers: since when (accept or the last response's end), when
    /// its first byte came, and whether it is the connection's first request.
    Waiting {
        since: Instant,
        first_byte: Option<Instant>,
        first: bool,
    },
    /// Requests whose responses have not ended.
    Busy(usize),
}

/// What a connection is doing, for its deadline: written by its socket (bytes read), its
/// service (request started) and its responses' bodies (ended).
struct Activity {
    phase: Mutex<Phase>,
    changed: Notify,
}

impl Activity {
    fn new() -> Arc<Activity> {
        Arc::new(Activity {
            phase: Mutex::new(Phase::Waiting {
                since: Instant::now(),
                first_byte: None,
                first: true,
            }),
            changed: Notify::new(),
        })
    }

    fn update(&self, f: impl FnOnce(&mut Phase)) {
        let mut p = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut p);
        drop(p);
        self.changed.notify_one();
    }

    fn on_bytes(&self) {
        let mut p = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        if let Phase::Waiting {
            first_byte: f @ None,
            ..
        } = &mut *p
        {
            *f = Some(Instant::now());
            drop(p);
            self.changed.notify_one();
        }
    }

    /// A request's headers are in; the guard ends it when dropped (with its response body).
    fn request_started(self: &Arc<Self>) -> InFlight {
        self.update(|p| {
            *p = match *p {
                Phase::Busy(n) => Phase::Busy(n + 1),
                Phase::Waiting { .. } => Phase::Busy(1),
            }
        });
        InFlight(self.clone())
    }

    fn deadline(&self, l: &HttpLimits) -> Option<(Instant, Expiry)> {
        match *self.phase.lock().unwrap_or_else(|e| e.into_inner()) {
            Phase::Busy(_) => None,
            Phase::Waiting {
                since, first: true, ..
            } => Some((since + l.header_read_timeout, Expiry::Header)),
            Phase::Waiting {
                first_byte: Some(t),
                ..
            } => Some((t + l.header_read_timeout, Expiry::Header)),
            Phase::Waiting {
                since,
                first_byte: None,
                ..
            } => Some((since + l.idle_timeout, Expiry::Idle)),
        }
    }
}

/// One request in flight on a connection, until its response body is dropped.
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.update(|p| {
            *p = match *p {
                Phase::Busy(n) if n > 1 => Phase::Busy(n - 1),
                _ => Phase::Waiting {
                    since: Instant::now(),
                    first_byte: None,
                    first: false,
                },
            }
        });
    }
}

async fn connection(
    stream: TcpStream,
    app: axum::Router,
    limits: HttpLimits,
    stop: CancellationToken,
    _permit: OwnedSemaphorePermit,
) {
    let _open = OpenGauge::new();
    let activity = Activity::new();
    let io = TokioIo::new(Tracked {
        inner: stream,
        activity: activity.clone(),
    });
    let router = TowerToHyperService::new(app);
    let requests = activity.clone();
    let body_limit = limits.body_read_timeout;
    let svc = hyper::service::service_fn(move |req: axum::http::Request<Incoming>| {
        let in_flight = requests.request_started();
        let req = req.map(|b| Body::new(Deadline::new(b, body_limit)));
        let answer = router.call(req);
        async move {
            let resp = answer.await?;
            Ok::<_, Infallible>(resp.map(|inner| {
                Body::new(Guarded {
                    inner,
                    _in_flight: in_flight,
                })
            }))
        }
    });
    let conn = http1::Builder::new()
        // The header deadline is this module's (counted from a request's first byte).
        .header_read_timeout(None)
        .keep_alive(true)
        .serve_connection(io, svc);
    tokio::pin!(conn);
    let mut draining = false;
    loop {
        let deadline = activity.deadline(&limits);
        let expired = async {
            match deadline {
                Some((t, _)) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "HTTP connection ended");
                }
                return;
            }
            _ = activity.changed.notified() => {}
            _ = expired => {
                if let Some((t, why)) = activity.deadline(&limits) {
                    if t <= Instant::now() {
                        metrics::counter!(m::HTTP_CONNECTIONS_CLOSED_TOTAL, "reason" => why.label())
                            .increment(1);
                        tracing::debug!(reason = why.label(), "HTTP connection closed");
                        return;
                    }
                }
            }
            _ = stop.cancelled(), if !draining => {
                draining = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// `vlm_gateway_http_connections`, one per open connection.
struct OpenGauge;

impl OpenGauge {
    fn new() -> OpenGauge {
        metrics::gauge!(m::HTTP_CONNECTIONS).increment(1.0);
        OpenGauge
    }
}

impl Drop for OpenGauge {
    fn drop(&mut self) {
        metrics::gauge!(m::HTTP_CONNECTIONS).decrement(1.0);
    }
}

/// The socket, reporting each read that brought bytes.
struct Tracked {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.activity.on_bytes();
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// A request body that fails with [`BodyTimeout`] once its deadline passes.
struct Deadline {
    inner: Incoming,
    limit: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
}

impl Deadline {
    fn new(inner: Incoming, limit: Duration) -> Deadline {
        Deadline {
            inner,
            limit,
            timer: Box::pin(tokio::time::sleep(limit)),
        }
    }
}

impl hyper::body::Body for Deadline {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(f) => Poll::Ready(f.map(|r| r.map_err(Into::into))),
            Poll::Pending => match this.timer.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyTimeout(this.limit))))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A response body that ends its request's [`InFlight`] when dropped (sent, or abandoned).
struct Guarded {
    inner: Body,
    _in_flight: InFlight,
}

impl hyper::body::Body for Guarded {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
