//! The Prometheus endpoint: a recorder for the `metrics` facade and an HTTP server answering
//! `GET /metrics`.
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::net::SocketAddr;
use std::sync::OnceLock;

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide Prometheus recorder (once) and returns its handle.
pub fn recorder() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            PrometheusBuilder::new()
                .set_buckets(&[
                    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0,
                ])
                .expect("static buckets are valid")
                .install_recorder()
                .expect("no other metrics recorder is installed")
        })
        .clone()
}

/// An axum router serving `GET /metrics` from `handle`; services may merge it into their own.
pub fn router(handle: PrometheusHandle) -> axum::Router {
    axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let h = handle.clone();
            async move { h.render() }
        }),
    )
}

/// Binds `addr` and serves `/metrics` until `shutdown` completes. Returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    handle: PrometheusHandle,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, router(handle))
            .with_graceful_shutdown(shutdown)
            .await;
    });
    Ok(bound)
}
