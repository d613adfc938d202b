//! What every vlm service shares, wired once: logging and tracing setup, the Prometheus
//! endpoint, `grpc.health.v1` + reflection, the gRPC server's start-up and drain ([`server`]),
//! the shutdown signal, core pinning for the CPU device pool, the generation types the LM
//! and the gateway both speak ([`generation`]) and the sampling limits both check ([`sampling`]).

pub mod affinity;
pub mod backend_info;
pub mod config;
pub mod conn;
pub mod generation;
pub mod grpc;
pub mod internal_auth;
pub mod internal_tls;
pub mod memory;
pub mod metrics_http;
pub mod replicas;
pub mod sampling;
pub mod server;
pub mod shutdown;
pub mod telemetry;
