//! The end-to-end harness shared by the whole-system tests (`system-tests/tests/*`) that run the
//! real services: it finds (or builds) the `vlm`, `vision-service`, `lm-service` and `gateway`
//! binaries of the same target directory, makes the tiny random checkpoint once, spawns the
//! services on loopback port 0, waits for gRPC health SERVING, and talks to them (gRPC
//! Generate, a minimal HTTP/1.1 client, Prometheus text).
//!
//! Use it with `mod support;` from a test file; [`otlp`] is an in-process trace collector.
// Each test file uses a different part of it.
#![allow(dead_code)]

pub mod binaries;
pub mod http;
pub mod metrics;
pub mod otlp;
pub mod processes;
pub mod relay;
pub mod requests;

// Each test file takes what it needs by name or by `support::*`.
#[allow(unused_imports)]
pub use {binaries::*, http::*, metrics::*, processes::*, relay::*, requests::*};
