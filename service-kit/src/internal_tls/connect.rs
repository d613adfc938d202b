//! The client side: a connector for tonic channels that dials TCP, then TLS with the client
//! config current at that moment, checking the replica's certificate against the name it must
//! carry ([`super::server_name`]).
use super::{InternalTls, TlsError};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::net::TcpStream;
use tonic::codegen::http::Uri;
use tonic::transport::{Channel, Endpoint};

type Connection = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;

/// Dials one replica over TLS (tonic's connect timeout still applies around it).
#[derive(Clone)]
pub struct TlsConnector {
    tls: Arc<InternalTls>,
    name: ServerName<'static>,
}

impl TlsConnector {
    /// A connector whose peer must present a certificate for `server_name` (a DNS name or an
    /// IP address).
    pub fn new(tls: Arc<InternalTls>, server_name: &str) -> Result<TlsConnector, TlsError> {
        let name = ServerName::try_from(server_name.to_string()).map_err(|e| {
            TlsError::Config(format!("{server_name:?} is not a TLS server name: {e}"))
        })?;
        Ok(TlsConnector { tls, name })
    }
}

impl tonic::codegen::Service<Uri> for TlsConnector {
    type Response = Connection;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Connection, std::io::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), std::io::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connector = tokio_rustls::TlsConnector::from(self.tls.client_config());
        let name = self.name.clone();
        Box::pin(async move {
            let invalid = |what: &str| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("{uri}: no {what}"),
                )
            };
            let host = uri.host().ok_or_else(|| invalid("host"))?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let port = uri.port_u16().ok_or_else(|| invalid("port"))?;
            let tcp = TcpStream::connect((host, port)).await?;
            tcp.set_nodelay(true)?;
            let stream = connector.connect(name, tcp).await?;
            Ok(TokioIo::new(stream))
        })
    }
}

/// A channel to `endpoint`: over TLS with `tls`, else plain HTTP/2.
pub async fn dial(
    endpoint: Endpoint,
    tls: Option<TlsConnector>,
) -> Result<Channel, tonic::transport::Error> {
    match tls {
        Some(c) => endpoint.connect_with_connector(c).await,
        None => endpoint.connect().await,
    }
}

/// [`dial`], connecting on first use.
pub fn dial_lazy(endpoint: Endpoint, tls: Option<TlsConnector>) -> Channel {
    match tls {
        Some(c) => endpoint.connect_with_connector_lazy(c),
        None => endpoint.connect_lazy(),
    }
}
