//! The accept side of [`super::GrpcConnOptions`]: a slot per open connection under the cap
//! (one over it is closed as it is accepted), and for plain HTTP/2 the client's 24-byte
//! preface read beside the accept loop within the handshake deadline, then replayed to the
//! gRPC server. tonic's builder offers neither, hence this wrapper of the accepted streams.
//!
//! Counted in `vlm_grpc_connections` (open now) and `vlm_grpc_connections_closed_total{reason}`
//! (`over_cap`, `handshake_timeout`) on the service's `/metrics`.
use super::GrpcConnOptions;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// Gauge: connections open on the gRPC port (handshakes in progress included).
pub const CONNECTIONS: &str = "vlm_grpc_connections";
/// Counter: connections the gRPC port closed itself, by `reason`.
pub const CLOSED_TOTAL: &str = "vlm_grpc_connections_closed_total";

/// Why a connection was closed by the port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closed {
    /// Over `--grpc-max-connections`, at accept.
    OverCap,
    /// No preface (or TLS handshake) within `--grpc-handshake-timeout-ms`.
    HandshakeTimeout,
}

impl Closed {
    pub fn label(self) -> &'static str {
        match self {
            Closed::OverCap => "over_cap",
            Closed::HandshakeTimeout => "handshake_timeout",
        }
    }

    /// Counts and logs (at debug: a flood of them must not flood the log) the close.
    pub fn count(self, peer: SocketAddr) {
        metrics::counter!(CLOSED_TOTAL, "reason" => self.label()).increment(1);
        tracing::debug!(%peer, reason = self.label(), "gRPC connection closed");
    }
}

/// The cap on a port's open connections.
#[derive(Clone)]
pub struct ConnCap {
    permits: Arc<Semaphore>,
}

impl ConnCap {
    pub fn new(max_connections: usize) -> ConnCap {
        metrics::describe_gauge!(CONNECTIONS, "connections open on the gRPC port");
        metrics::describe_counter!(
            CLOSED_TOTAL,
            "gRPC connections closed by the port: over_cap, handshake_timeout"
        );
        metrics::counter!(CLOSED_TOTAL, "reason" => Closed::OverCap.label()).increment(0);
        metrics::counter!(CLOSED_TOTAL, "reason" => Closed::HandshakeTimeout.label()).increment(0);
        ConnCap {
            permits: Arc::new(Semaphore::new(max_connections)),
        }
    }

    /// A slot for the connection just accepted from `peer`; None (counted) over the cap: the
    /// caller drops the connection.
    pub fn admit(&self, peer: SocketAddr) -> Option<Slot> {
        match self.permits.clone().try_acquire_owned() {
            Ok(p) => {
                metrics::gauge!(CONNECTIONS).increment(1.0);
                Some(Slot(p))
            }
            Err(_) => {
                Closed::OverCap.count(peer);
                None
            }
        }
    }
}

/// Held by an open connection; its place under the cap is free again when it is dropped.
pub struct Slot(#[allow(dead_code)] OwnedSemaphorePermit);

impl Drop for Slot {
    fn drop(&mut self) {
        metrics::gauge!(CONNECTIONS).decrement(1.0);
    }
}

/// Accepts the next connection, waiting (not spinning) when accepting fails, e.g. out of file
/// descriptors.
pub async fn accept(listener: &TcpListener) -> (TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(c) => return c,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The next connection of `listener` that `cap` admits (over the cap: closed, and the next
/// one taken), with TCP_NODELAY when asked, its peer and its cap slot; `None` once the stream's
/// receiver behind `tx` is gone.
pub async fn next_admitted<T>(
    listener: &TcpListener,
    cap: &ConnCap,
    nodelay: bool,
    tx: &tokio::sync::mpsc::Sender<T>,
) -> Option<(TcpStream, SocketAddr, Slot)> {
    loop {
        let (tcp, peer) = tokio::select! {
            c = accept(listener) => c,
            () = tx.closed() => return None,
        };
        let Some(slot) = cap.admit(peer) else {
            continue;
        };
        if nodelay {
            let _ = tcp.set_nodelay(true);
        }
        return Some((tcp, peer, slot));
    }
}

/// The length of HTTP/2's client connection preface, `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`.
const PREFACE_LEN: usize = 24;

/// A plain connection whose preface has arrived, replayed before the rest of its bytes.
pub struct PlainConn {
    tcp: TcpStream,
    head: [u8; PREFACE_LEN],
    replayed: usize,
    _slot: Slot,
}

impl Connected for PlainConn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.tcp.connect_info()
    }
}

impl AsyncRead for PlainConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let me = &mut *self;
        if me.replayed < PREFACE_LEN {
            let n = buf.remaining().min(PREFACE_LEN - me.replayed);
            buf.put_slice(&me.head[me.replayed..me.replayed + n]);
            me.replayed += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut me.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for PlainConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
}

/// The plain HTTP/2 connections of `listener` under `opts`' cap, each handed on once its
/// preface has come within `opts.handshake_timeout` (read beside the accept loop: a silent
/// peer holds up no one else). Dropping the stream stops the accept loop and closes the
/// listener.
pub fn incoming(
    listener: TcpListener,
    opts: GrpcConnOptions,
    nodelay: bool,
) -> impl Stream<Item = Result<PlainConn, std::io::Error>> + Send + 'static {
    let (tx, rx) = tokio::sync::mpsc::channel::<PlainConn>(64);
    let cap = ConnCap::new(opts.max_connections);
    tokio::spawn(async move {
        while let Some((mut tcp, peer, slot)) = next_admitted(&listener, &cap, nodelay, &tx).await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut head = [0u8; PREFACE_LEN];
                match tokio::time::timeout(opts.handshake_timeout, tcp.read_exact(&mut head)).await
                {
                    Ok(Ok(_)) => {
                        let conn = PlainConn {
                            tcp,
                            head,
                            replayed: 0,
                            _slot: slot,
                        };
                        let _ = tx.send(conn).await;
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, error = %e, "gRPC connection gone before its preface")
                    }
                    Err(_) => Closed::HandshakeTimeout.count(peer),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok::<_, std::io::Error>)
}
