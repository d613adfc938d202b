//! A vlm service's gRPC life, written once: health (NOT_SERVING until the service's loading is
//! done, then SERVING), reflection over the services it serves, and the drain on shutdown.
//!
//! ```text
//! bind ─ announce ─ serve: NOT_SERVING ── load ──> SERVING (or follow a readiness signal)
//!                                     shutdown ──> NOT_SERVING ─ drain delay ─ on_drain
//!                                                  ─ stop accepting, finish in-flight calls
//!                                                  ─ stop /metrics ─ hand back what was loaded
//! ```
//!
//! What a service loads, and how it shuts that down, stays in the service: [`GrpcServer::serve`]
//! takes the loading future and hands its output back in [`Stopped`].
mod listen;
pub mod oversize;

pub use listen::{announce, bind, bind_grpc, listening_line, BindError, GrpcListener, Listeners};

use crate::conn::{self, GrpcConnOptions};
use crate::grpc;
use crate::internal_tls::{self, InternalTls};
use oversize::OversizeIsResourceExhausted;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{oneshot, watch};
use tonic::server::NamedService;
use tonic::service::Routes;
use tonic_health::server::HealthReporter;

type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// How often the gRPC server pings an HTTP/2 connection to learn the peer is still there (see
/// [`GrpcServer::conn`]).
pub const HTTP2_KEEPALIVE_INTERVAL: Duration = conn::DEFAULT_KEEPALIVE_INTERVAL;
/// How long a ping may go unanswered before the connection is closed.
pub const HTTP2_KEEPALIVE_TIMEOUT: Duration = conn::DEFAULT_KEEPALIVE_TIMEOUT;
/// Streams (calls) open at once on one connection; more wait on the client. Far above what
/// one peer needs (a gateway's calls to one LM are bounded by its `--max-in-flight`).
pub const MAX_CONCURRENT_STREAMS: u32 = 1024;

/// Why [`GrpcServer::serve`] failed before or while loading.
#[derive(Debug, thiserror::Error)]
pub enum ServeError<E> {
    /// The reflection service could not be built from the descriptors (nothing was served).
    #[error("reflection: {0}")]
    Reflection(#[source] tonic_reflection::server::Error),
    /// The loading future failed; the server has been stopped.
    #[error(transparent)]
    Load(E),
}

/// How the gRPC server itself ended.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("{0}")]
    Transport(#[from] tonic::transport::Error),
    /// The server task panicked or was cancelled.
    #[error("gRPC server task: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// A server that has drained and stopped.
#[must_use = "what was loaded is the caller's to shut down"]
pub struct Stopped<T> {
    /// What the loading future returned.
    pub loaded: T,
    /// How the gRPC server ended.
    pub served: Result<(), ServerError>,
}

/// The builder of a service's gRPC server. See the module docs for its life.
pub struct GrpcServer {
    grpc: GrpcListener,
    metrics_stop: Option<oneshot::Sender<()>>,
    /// `/readyz` of the metrics server, when this server's [`Listeners`] made one.
    http_ready: Option<Arc<AtomicBool>>,
    service_name: &'static str,
    routes: Routes,
    served_names: Vec<&'static str>,
    drain_delay: Duration,
    tcp_nodelay: bool,
    ready: Option<watch::Receiver<bool>>,
    on_drain: Option<BoxFuture>,
    tls: Option<Arc<InternalTls>>,
    /// Keepalive, connection cap and handshake deadline.
    conn: GrpcConnOptions,
}

impl GrpcServer {
    /// A server on `listeners`; `service_name` (e.g. "vlm.v1.Vision") is reported by
    /// `grpc.health.v1` together with the overall status "". The metrics server is stopped
    /// last, once the gRPC server has drained.
    pub fn new(listeners: Listeners, service_name: &'static str) -> GrpcServer {
        let Listeners {
            grpc,
            metrics_stop,
            ready,
            ..
        } = listeners;
        GrpcServer {
            metrics_stop: Some(metrics_stop),
            http_ready: Some(ready),
            ..GrpcServer::on_listener(grpc, service_name)
        }
    }

    /// A server on a bound gRPC listener ([`bind_grpc`]), for a service whose `/metrics` is
    /// served elsewhere.
    pub fn on_listener(grpc: GrpcListener, service_name: &'static str) -> GrpcServer {
        GrpcServer {
            grpc,
            metrics_stop: None,
            http_ready: None,
            service_name,
            routes: Routes::default(),
            served_names: Vec::new(),
            drain_delay: Duration::ZERO,
            tcp_nodelay: false,
            ready: None,
            on_drain: None,
            tls: None,
            conn: GrpcConnOptions::default(),
        }
    }

    /// Serves `svc` (answering from the start: a service refuses calls itself until it is
    /// loaded). Reflection lists it. A request message over its decoding limit is answered
    /// RESOURCE_EXHAUSTED ([`oversize`]).
    pub fn add_service<S, B>(mut self, svc: S) -> GrpcServer
    where
        S: tonic::codegen::Service<
                tonic::codegen::http::Request<tonic::body::Body>,
                Response = tonic::codegen::http::Response<B>,
                Error = Infallible,
            > + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        tonic::codegen::http::Response<B>: axum::response::IntoResponse,
        S::Future: Send + 'static,
        B: 'static,
    {
        self.served_names.push(S::NAME);
        self.routes = self.routes.add_service(OversizeIsResourceExhausted(svc));
        self
    }

    /// On shutdown, how long to keep accepting calls after reporting NOT_SERVING, so that load
    /// balancers and health checks see it first. Zero by default.
    pub fn drain_delay(mut self, delay: Duration) -> GrpcServer {
        self.drain_delay = delay;
        self
    }

    /// Sets `TCP_NODELAY` on accepted connections (off by default, the OS's choice).
    pub fn tcp_nodelay(mut self, on: bool) -> GrpcServer {
        self.tcp_nodelay = on;
        self
    }

    /// How connections are kept and bounded ([`GrpcConnOptions::default`] unless set): each
    /// HTTP/2 connection pinged every `keepalive.interval` and closed when a ping goes
    /// unanswered for `keepalive.timeout`; at most `max_connections` open (one over is closed
    /// as it is accepted); a new connection's preface (or TLS handshake) within
    /// `handshake_timeout`.
    pub fn conn(mut self, conn: GrpcConnOptions) -> GrpcServer {
        self.conn = conn;
        self
    }

    /// Only the keepalive of [`conn`](Self::conn).
    pub fn http2_keepalive(mut self, interval: Duration, timeout: Duration) -> GrpcServer {
        self.conn.keepalive = conn::Keepalive { interval, timeout };
        self
    }

    /// Serves over mutual TLS (`None`: plain HTTP/2): only callers presenting a certificate
    /// the CA signed get past the handshake, health and reflection included.
    pub fn tls(mut self, tls: Option<Arc<InternalTls>>) -> GrpcServer {
        self.tls = tls;
        self
    }

    /// Once loaded, health follows `ready` (true = SERVING) instead of staying SERVING, until
    /// the drain. A closed channel leaves the last status.
    pub fn health_follows(mut self, ready: watch::Receiver<bool>) -> GrpcServer {
        self.ready = Some(ready);
        self
    }

    /// Runs `drain` on shutdown after NOT_SERVING and the drain delay, while the server still
    /// accepts calls (e.g. refuse new work and wait for running work); the server stops
    /// accepting when it completes. It also runs when loading fails.
    pub fn on_drain(mut self, drain: impl Future<Output = ()> + Send + 'static) -> GrpcServer {
        self.on_drain = Some(Box::pin(drain));
        self
    }

    /// Serves health (NOT_SERVING), reflection and the added services at once, then awaits
    /// `load`. When it succeeds, health goes SERVING until `shutdown`; then the drain: NOT_SERVING,
    /// the drain delay, [`on_drain`](Self::on_drain), stop accepting and let in-flight calls
    /// finish, stop `/metrics`. A `shutdown` during loading drains at once, then waits for the
    /// loading to end so that the caller can shut down what it made.
    ///
    /// When `load` fails the server stops at once (health never leaves NOT_SERVING) and the
    /// error is returned.
    pub async fn serve<T, E>(
        self,
        load: impl Future<Output = Result<T, E>>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Stopped<T>, ServeError<E>> {
        let GrpcServer {
            grpc,
            metrics_stop,
            http_ready,
            service_name,
            routes,
            mut served_names,
            drain_delay,
            tcp_nodelay,
            ready,
            on_drain,
            tls,
            conn,
        } = self;
        let (reporter, health) = grpc::health();
        grpc::set_serving(&reporter, service_name, false).await;
        served_names.push(tonic_health::pb::health_server::SERVICE_NAME);
        let (reflection, reflection_alpha) =
            grpc::reflection(&served_names).map_err(ServeError::Reflection)?;
        let routes = routes
            .add_service(health)
            .add_service(reflection)
            .add_service(reflection_alpha);
        let grpc_addr = grpc.addr;
        let (stop_accepting, stop_rx) = oneshot::channel::<()>();
        let stopped = async {
            let _ = stop_rx.await;
        };
        let builder = tonic::transport::Server::builder()
            // A peer that stops answering pings (gone without a FIN, a half-open socket) is
            // dropped instead of holding its connection and streams forever.
            .http2_keepalive_interval(Some(conn.keepalive.interval))
            .http2_keepalive_timeout(Some(conn.keepalive.timeout))
            // tonic's default is no limit per connection.
            .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
            .add_routes(routes);
        let transport = if tls.is_some() {
            "mutual TLS"
        } else {
            "plain HTTP/2"
        };
        let server = match tls {
            Some(tls) => {
                let incoming =
                    internal_tls::accept::incoming(grpc.listener, tls, conn, tcp_nodelay);
                tokio::spawn(builder.serve_with_incoming_shutdown(incoming, stopped))
            }
            None => {
                let incoming = conn::accept::incoming(grpc.listener, conn, tcp_nodelay);
                tokio::spawn(builder.serve_with_incoming_shutdown(incoming, stopped))
            }
        };
        tracing::info!(
            %grpc_addr,
            http2_keepalive_interval_ms = conn.keepalive.interval.as_millis() as u64,
            http2_keepalive_timeout_ms = conn.keepalive.timeout.as_millis() as u64,
            max_connections = conn.max_connections,
            handshake_timeout_ms = conn.handshake_timeout.as_millis() as u64,
            max_concurrent_streams = MAX_CONCURRENT_STREAMS,
            "gRPC up over {transport} ({service_name} NOT_SERVING until it is loaded)"
        );
        let drain = Drain {
            grpc_addr,
            reporter,
            http_ready,
            service_name,
            delay: drain_delay,
            on_drain,
            stop_accepting,
            server,
        };
        let stop_metrics = move || {
            if let Some(tx) = metrics_stop {
                let _ = tx.send(());
            }
        };

        tokio::pin!(load);
        tokio::pin!(shutdown);
        let loaded = tokio::select! {
            r = &mut load => Some(r),
            () = &mut shutdown => None,
        };
        match loaded {
            Some(Ok(loaded)) => {
                let mut drain = drain;
                drain.follow_until(ready, shutdown.as_mut()).await;
                let served = drain.run().await;
                stop_metrics();
                Ok(Stopped { loaded, served })
            }
            Some(Err(e)) => {
                let _ = drain.stop().await;
                stop_metrics();
                Err(ServeError::Load(e))
            }
            None => {
                let served = drain.run().await;
                let loaded = load.await;
                stop_metrics();
                match loaded {
                    Ok(loaded) => Ok(Stopped { loaded, served }),
                    Err(e) => Err(ServeError::Load(e)),
                }
            }
        }
    }
}

/// What the drain needs, gathered before loading starts.
struct Drain {
    grpc_addr: SocketAddr,
    reporter: HealthReporter,
    http_ready: Option<Arc<AtomicBool>>,
    service_name: &'static str,
    delay: Duration,
    on_drain: Option<BoxFuture>,
    stop_accepting: oneshot::Sender<()>,
    server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

impl Drain {
    // `&mut self` throughout: `on_drain` is Send but not Sync, and a shared borrow held across
    // an await would make `serve`'s future lose Send.
    async fn set_serving(&mut self, serving: bool) {
        grpc::set_serving(&self.reporter, self.service_name, serving).await;
        if let Some(r) = &self.http_ready {
            r.store(serving, Ordering::Relaxed);
        }
        let status = if serving { "SERVING" } else { "NOT_SERVING" };
        tracing::info!(grpc_addr = %self.grpc_addr, "{status} {}", self.service_name);
    }

    /// SERVING (or following `ready`) until `shutdown`.
    async fn follow_until(
        &mut self,
        ready: Option<watch::Receiver<bool>>,
        mut shutdown: Pin<&mut impl Future<Output = ()>>,
    ) {
        let Some(mut ready) = ready else {
            self.set_serving(true).await;
            shutdown.await;
            return;
        };
        let mut last = None;
        loop {
            let now = *ready.borrow_and_update();
            if last != Some(now) {
                self.set_serving(now).await;
                last = Some(now);
            }
            tokio::select! {
                () = &mut shutdown => return,
                changed = ready.changed() => if changed.is_err() {
                    shutdown.await;
                    return;
                },
            }
        }
    }

    /// NOT_SERVING, the delay, `on_drain`, then stop accepting and wait for in-flight calls.
    async fn run(mut self) -> Result<(), ServerError> {
        tracing::info!("draining: NOT_SERVING, finishing in-flight calls");
        self.set_serving(false).await;
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        self.stop().await
    }

    /// `on_drain`, then stop accepting and wait for in-flight calls.
    async fn stop(self) -> Result<(), ServerError> {
        if let Some(on_drain) = self.on_drain {
            on_drain.await;
        }
        let _ = self.stop_accepting.send(());
        self.server.await??;
        Ok(())
    }
}
