//! The server side: TCP connections accepted, TLS handshakes run beside the accept loop (a slow
//! or silent peer holds up no one else), and only the connections that completed one handed to
//! the gRPC server. A failed handshake (no client certificate, one another CA signed) is logged
//! with the peer's address and dropped. Connections count under the port's cap from their
//! accept ([`crate::conn::accept::ConnCap`]).
use super::InternalTls;
use crate::conn::accept::{next_admitted, Closed, ConnCap, Slot};
use crate::conn::GrpcConnOptions;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// Handshakes in progress at once; the accept loop waits beyond that.
const MAX_HANDSHAKES: usize = 256;

/// A connection that completed the TLS handshake.
pub struct TlsConn(
    tokio_rustls::server::TlsStream<TcpStream>,
    /// Its place under the port's connection cap, until it closes.
    #[allow(dead_code)]
    Slot,
);

impl Connected for TlsConn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.0.get_ref().0.connect_info()
    }
}

impl AsyncRead for TlsConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
}

/// The TLS connections of `listener` under `opts`' cap, each handshake with the server config
/// current when its connection came, done within `opts.handshake_timeout`. Dropping the stream
/// stops the accept loop and closes the listener.
pub fn incoming(
    listener: TcpListener,
    tls: Arc<InternalTls>,
    opts: GrpcConnOptions,
    nodelay: bool,
) -> impl Stream<Item = Result<TlsConn, std::io::Error>> + Send + 'static {
    let (tx, rx) = tokio::sync::mpsc::channel::<TlsConn>(64);
    let cap = ConnCap::new(opts.max_connections);
    let timeout = opts.handshake_timeout;
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    tokio::spawn(async move {
        loop {
            let permit = tokio::select! {
                p = permits.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break,
                },
                () = tx.closed() => break,
            };
            let Some((tcp, peer, slot)) = next_admitted(&listener, &cap, nodelay, &tx).await else {
                break;
            };
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.server_config());
            let tx = tx.clone();
            tokio::spawn(async move {
                let _permit = permit;
                match tokio::time::timeout(timeout, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(TlsConn(stream, slot)).await;
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(%peer, error = %e, "internal TLS handshake refused")
                    }
                    Err(_) => {
                        Closed::HandshakeTimeout.count(peer);
                        tracing::warn!(%peer, "internal TLS handshake not done in {timeout:?}: dropped")
                    }
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok::<_, std::io::Error>)
}
