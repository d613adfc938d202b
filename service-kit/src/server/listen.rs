//! Binding a service's ports and announcing them: the `listening grpc=ADDR metrics=ADDR` line
//! that `vlm up` and the multi-process tests wait for.
use crate::metrics_http;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// A port that could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("cannot bind {what} on {addr}: {source}")]
pub struct BindError {
    /// Which listener: `"gRPC"` or `"metrics"`.
    pub what: &'static str,
    /// The address asked for.
    pub addr: SocketAddr,
    #[source]
    pub source: std::io::Error,
}

/// A bound gRPC port, not accepting yet.
pub struct GrpcListener {
    pub addr: SocketAddr,
    pub(super) listener: TcpListener,
}

/// The gRPC listener, bound, not accepting yet, and the `/metrics` server, already serving.
pub struct Listeners {
    pub grpc_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub(super) grpc: GrpcListener,
    /// Sending (or dropping) stops the metrics server.
    pub(super) metrics_stop: oneshot::Sender<()>,
    /// What the metrics server's `/readyz` answers (set with the gRPC health).
    pub(super) ready: Arc<AtomicBool>,
}

/// Binds `grpc` and serves the Prometheus endpoint on `metrics` (port 0 picks a free port; the
/// bound addresses are in the result). The process-wide recorder is installed on the way.
pub async fn bind(grpc: SocketAddr, metrics: SocketAddr) -> Result<Listeners, BindError> {
    let grpc = bind_grpc(grpc).await?;
    let (metrics_stop, stopped) = oneshot::channel::<()>();
    let ready = Arc::new(AtomicBool::new(false));
    let metrics_addr = metrics_http::serve(
        metrics,
        metrics_http::recorder(),
        ready.clone(),
        async move {
            let _ = stopped.await;
        },
    )
    .await
    .map_err(|source| BindError {
        what: "metrics",
        addr: metrics,
        source,
    })?;
    Ok(Listeners {
        grpc_addr: grpc.addr,
        metrics_addr,
        grpc,
        metrics_stop,
        ready,
    })
}

/// Binds the gRPC port alone, for a service that serves `/metrics` on a port of its own making
/// (the gateway's HTTP API).
pub async fn bind_grpc(addr: SocketAddr) -> Result<GrpcListener, BindError> {
    let error = |source| BindError {
        what: "gRPC",
        addr,
        source,
    };
    let listener = TcpListener::bind(addr).await.map_err(error)?;
    let bound = listener.local_addr().map_err(error)?;
    Ok(GrpcListener {
        addr: bound,
        listener,
    })
}

impl Listeners {
    /// Prints `listening grpc=ADDR metrics=ADDR` on stdout.
    pub fn announce(&self) {
        announce(&[("grpc", self.grpc_addr), ("metrics", self.metrics_addr)]);
    }
}

/// `listening k=ADDR k=ADDR ...`: the line parsers split on spaces and `=`.
pub fn listening_line(fields: &[(&str, SocketAddr)]) -> String {
    let mut line = String::from("listening");
    for (name, addr) in fields {
        line.push_str(&format!(" {name}={addr}"));
    }
    line
}

/// Prints [`listening_line`] on stdout and flushes it, so that a parent reading the pipe sees it
/// before anything is loaded.
pub fn announce(fields: &[(&str, SocketAddr)]) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", listening_line(fields));
    let _ = out.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listening_line_keeps_its_format() {
        let grpc: SocketAddr = "127.0.0.1:50061".parse().unwrap();
        let metrics: SocketAddr = "0.0.0.0:9461".parse().unwrap();
        assert_eq!(
            listening_line(&[("grpc", grpc), ("metrics", metrics)]),
            "listening grpc=127.0.0.1:50061 metrics=0.0.0.0:9461"
        );
        assert_eq!(
            listening_line(&[("grpc", grpc), ("http", metrics)]),
            "listening grpc=127.0.0.1:50061 http=0.0.0.0:9461"
        );
    }
}
