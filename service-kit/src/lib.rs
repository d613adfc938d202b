//! What every vlm service shares, wired once: logging and tracing setup, the Prometheus
//! endpoint, `grpc.health.v1` + reflection, the gRPC server's start-up and drain ([`server`]),
//! the shutdown signal, and core pinning for the CPU device pool.

pub mod affinity;
pub mod config;
pub mod grpc;
pub mod metrics_http;
pub mod server;
pub mod shutdown;
pub mod telemetry;
