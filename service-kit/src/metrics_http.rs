//! The Prometheus endpoint: a recorder for the `metrics` facade and an HTTP server answering
//! `GET /metrics`, with the probes of a service whose gRPC port a kubelet cannot reach (mutual
//! TLS): `GET /livez` (200 while the process answers) and `GET /readyz` (200 while the gRPC
//! health says SERVING, else 503).
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

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

/// `GET /livez` and `GET /readyz` (`ready`: what the gRPC health reports as SERVING).
pub fn probes(ready: Arc<AtomicBool>) -> axum::Router {
    use axum::http::StatusCode;
    axum::Router::new()
        .route("/livez", axum::routing::get(|| async { "ok\n" }))
        .route(
            "/readyz",
            axum::routing::get(move || {
                let serving = ready.load(Ordering::Relaxed);
                async move {
                    if serving {
                        (StatusCode::OK, "SERVING\n")
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "NOT_SERVING\n")
                    }
                }
            }),
        )
}

/// Binds `addr` and serves `/metrics` and the [`probes`] until `shutdown` completes. Returns
/// the bound address.
pub async fn serve(
    addr: SocketAddr,
    handle: PrometheusHandle,
    ready: Arc<AtomicBool>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, router(handle).merge(probes(ready)))
            .with_graceful_shutdown(shutdown)
            .await;
    });
    Ok(bound)
}
