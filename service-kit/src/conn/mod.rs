//! How a gRPC port keeps and bounds its connections, the same on the three services, and how
//! the channels they dial keep theirs: HTTP/2 keepalive both ways (a peer that stops answering
//! pings, a frozen process or a partition, is dropped and the calls open on it fail instead of
//! waiting forever), a cap on the connections open at once, and a deadline for a new
//! connection's first bytes (the HTTP/2 preface, or the TLS handshake).
//!
//! [`GrpcConnArgs`] are the flags, flattened into each binary's arguments; [`GrpcConnOptions`]
//! what they parse to, handed to [`crate::server::GrpcServer::conn`] and, for the channels,
//! [`Keepalive::dial`].
pub mod accept;

use std::time::Duration;
use tonic::transport::Endpoint;

/// How often an HTTP/2 connection is pinged to learn the peer is still there.
pub const DEFAULT_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// How long a ping may go unanswered before the connection is closed.
pub const DEFAULT_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// Connections a gRPC port holds open at once; one over the cap is closed as it is accepted.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// A new connection's HTTP/2 preface (or TLS handshake) must be done within this.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// HTTP/2 keepalive of one end of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    /// A ping every this often.
    pub interval: Duration,
    /// The connection is closed when a ping goes unanswered this long.
    pub timeout: Duration,
}

impl Default for Keepalive {
    fn default() -> Self {
        Keepalive {
            interval: DEFAULT_KEEPALIVE_INTERVAL,
            timeout: DEFAULT_KEEPALIVE_TIMEOUT,
        }
    }
}

impl Keepalive {
    /// `endpoint` pinging its connection every `interval`, idle or not, and closing it when a
    /// ping goes unanswered for `timeout`: every call open on it then fails (UNAVAILABLE or
    /// UNKNOWN) instead of waiting for a peer that no longer answers.
    pub fn dial(self, endpoint: Endpoint) -> Endpoint {
        endpoint
            .http2_keep_alive_interval(self.interval)
            .keep_alive_timeout(self.timeout)
            .keep_alive_while_idle(true)
    }
}

/// Everything [`GrpcConnArgs`] sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrpcConnOptions {
    /// Pings on the served connections and on the dialled channels.
    pub keepalive: Keepalive,
    /// Connections the gRPC port holds open at once.
    pub max_connections: usize,
    /// Deadline for a new connection's preface (plain HTTP/2) or TLS handshake.
    pub handshake_timeout: Duration,
}

impl Default for GrpcConnOptions {
    fn default() -> Self {
        GrpcConnOptions {
            keepalive: Keepalive::default(),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
        }
    }
}

impl GrpcConnOptions {
    /// As `Lm.Info` and `Vision.Info` report them.
    pub fn info(&self) -> vlm_proto::v1::GrpcConnInfo {
        vlm_proto::v1::GrpcConnInfo {
            keepalive_interval_ms: self.keepalive.interval.as_millis() as u64,
            keepalive_timeout_ms: self.keepalive.timeout.as_millis() as u64,
            max_connections: self.max_connections as u64,
            handshake_timeout_ms: self.handshake_timeout.as_millis() as u64,
        }
    }
}

/// A flag of [`GrpcConnArgs`] out of range.
#[derive(Debug, thiserror::Error)]
pub enum ConnArgsError {
    #[error("--{flag} must be at least 1")]
    Zero { flag: &'static str },
}

/// The gRPC connection flags, the same on every service.
#[derive(Debug, Clone, clap::Args)]
pub struct GrpcConnArgs {
    /// gRPC connections, served and dialled: ping each HTTP/2 connection this often, in
    /// milliseconds (an idle one too).
    #[arg(long, env = "VLM_GRPC_KEEPALIVE_INTERVAL_MS", default_value_t = 30_000)]
    pub grpc_keepalive_interval_ms: u64,
    /// gRPC connections: close one whose ping goes unanswered this long, in milliseconds;
    /// the calls open on it fail (a frozen or partitioned peer), rather than wait forever.
    #[arg(long, env = "VLM_GRPC_KEEPALIVE_TIMEOUT_MS", default_value_t = 20_000)]
    pub grpc_keepalive_timeout_ms: u64,
    /// gRPC port: connections open at once; one over the cap is closed as it is accepted
    /// (keep it under the process's file limit, `ulimit -n`).
    #[arg(long, env = "VLM_GRPC_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub grpc_max_connections: usize,
    /// gRPC port: a new connection's HTTP/2 preface (with mutual TLS: its TLS handshake) must
    /// be done within this many milliseconds, or it is closed.
    #[arg(long, env = "VLM_GRPC_HANDSHAKE_TIMEOUT_MS", default_value_t = 10_000)]
    pub grpc_handshake_timeout_ms: u64,
}

impl GrpcConnArgs {
    /// The options, every value at least 1.
    pub fn options(&self) -> Result<GrpcConnOptions, ConnArgsError> {
        let ms = |v: u64, flag: &'static str| {
            if v == 0 {
                Err(ConnArgsError::Zero { flag })
            } else {
                Ok(Duration::from_millis(v))
            }
        };
        if self.grpc_max_connections == 0 {
            return Err(ConnArgsError::Zero {
                flag: "grpc-max-connections",
            });
        }
        Ok(GrpcConnOptions {
            keepalive: Keepalive {
                interval: ms(
                    self.grpc_keepalive_interval_ms,
                    "grpc-keepalive-interval-ms",
                )?,
                timeout: ms(self.grpc_keepalive_timeout_ms, "grpc-keepalive-timeout-ms")?,
            },
            max_connections: self.grpc_max_connections,
            handshake_timeout: ms(self.grpc_handshake_timeout_ms, "grpc-handshake-timeout-ms")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        conn: GrpcConnArgs,
    }

    #[test]
    fn flags_parse_to_options_and_zero_is_refused() {
        let o = Cli::parse_from(["x"]).conn.options().unwrap();
        assert_eq!(o, GrpcConnOptions::default());
        let o = Cli::parse_from([
            "x",
            "--grpc-keepalive-interval-ms",
            "500",
            "--grpc-keepalive-timeout-ms",
            "1000",
            "--grpc-max-connections",
            "8",
            "--grpc-handshake-timeout-ms",
            "300",
        ])
        .conn
        .options()
        .unwrap();
        assert_eq!(o.keepalive.interval, Duration::from_millis(500));
        assert_eq!(o.keepalive.timeout, Duration::from_secs(1));
        assert_eq!(o.max_connections, 8);
        assert_eq!(o.handshake_timeout, Duration::from_millis(300));
        let e = Cli::parse_from(["x", "--grpc-keepalive-timeout-ms", "0"])
            .conn
            .options()
            .unwrap_err();
        assert!(e.to_string().contains("--grpc-keepalive-timeout-ms"), "{e}");
    }
}
