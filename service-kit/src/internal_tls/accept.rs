//! The server side: TCP connections accepted, TLS handshakes run beside the accept loop (a slow
//! or silent peer holds up no one else), and only the connections that completed one handed to
//! the gRPC server. A failed handshake (no client certificate, one another CA signed) is logged
//! with the peer's address and dropped.
use super::InternalTls;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// A handshake not done by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; the accept loop waits beyond that.
const MAX_HANDSHAKES: usize = 256;

/// A connection that completed the TLS handshake.
pub struct TlsConn(tokio_rustls::server::TlsStream<TcpStream>);

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

/// The TLS connections of `listener`, each handshake with the server config current when its
/// connection came. Dropping the stream stops the accept loop and closes the listener.
pub fn incoming(
    listener: TcpListener,
    tls: Arc<InternalTls>,
    nodelay: bool,
) -> impl Stream<Item = Result<TlsConn, std::io::Error>> + Send + 'static {
    let (tx, rx) = tokio::sync::mpsc::channel::<TlsConn>(64);
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
            let (tcp, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of file descriptors, say: wait instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                () = tx.closed() => break,
            };
            if nodelay {
                let _ = tcp.set_nodelay(true);
            }
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.server_config());
            let tx = tx.clone();
            tokio::spawn(async move {
                let _permit = permit;
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(TlsConn(stream)).await;
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(%peer, error = %e, "internal TLS handshake refused")
                    }
                    Err(_) => tracing::warn!(
                        %peer,
                        "internal TLS handshake not done in {HANDSHAKE_TIMEOUT:?}: dropped"
                    ),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok::<_, std::io::Error>)
}
