//! Mutual TLS on the internal APIs (`vlm.v1.Vision`, `vlm.v1.Lm`): each service presents its
//! certificate and trusts one CA, as a server (the caller must present a certificate that CA
//! signed) and as a client (the replica it dials must too). rustls on the ring provider, ALPN
//! `h2`, TLS 1.2 and 1.3.
//!
//! The certificate, key and CA are files (on Kubernetes, the Secret cert-manager writes:
//! `tls.crt`, `tls.key`, `ca.crt`), looked at again at most every second when a connection is
//! accepted or dialled; a change applies to the next handshake, so certificates rotate without
//! restarts. A change that does not parse (a key that does not match its certificate, say)
//! keeps the last good set and is logged. Connections already open keep the session they made.
//!
//! [`accept`] turns a listener into the stream of TLS connections the gRPC server serves;
//! [`connect`] is the connector of a tonic channel.
pub mod accept;
pub mod args;
pub mod connect;
pub mod dev_certs;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The files are looked at again at most this often.
const RECHECK: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("internal TLS: {what} file {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("internal TLS: {what} file {path}: {reason}")]
    Pem {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("internal TLS: {0}")]
    Config(String),
    #[error(
        "internal TLS needs all three of --internal-tls-cert, --internal-tls-key and \
         --internal-tls-ca (missing: {0})"
    )]
    Incomplete(String),
}

/// Where the certificate, its key and the trusted CA are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM: the certificate, then any intermediates.
    pub cert: PathBuf,
    /// PEM: the certificate's private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// PEM: the CA certificates peers' certificates must chain to.
    pub ca: PathBuf,
}

impl TlsFiles {
    /// All three paths, or none (no TLS); one or two is refused, naming what is missing.
    pub fn from_flags(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        ca: Option<PathBuf>,
    ) -> Result<Option<TlsFiles>, TlsError> {
        match (cert, key, ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => Ok(Some(TlsFiles { cert, key, ca })),
            (cert, key, ca) => {
                let missing: Vec<&str> = [
                    (cert.is_none(), "--internal-tls-cert"),
                    (key.is_none(), "--internal-tls-key"),
                    (ca.is_none(), "--internal-tls-ca"),
                ]
                .into_iter()
                .filter_map(|(m, name)| m.then_some(name))
                .collect();
                Err(TlsError::Incomplete(missing.join(", ")))
            }
        }
    }
}

/// The configs made from one reading of the files.
#[derive(Debug)]
struct Loaded {
    bytes: [Vec<u8>; 3],
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
}

#[derive(Debug)]
struct State {
    loaded: Loaded,
    checked: Instant,
}

/// The internal APIs' TLS: a server config (client certificates required) and a client config
/// (client certificate presented), both from [`TlsFiles`] and reloaded when they change.
#[derive(Debug)]
pub struct InternalTls {
    files: TlsFiles,
    state: Mutex<State>,
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Io {
        what,
        path: path.to_path_buf(),
        source,
    })
}

fn pem_error(what: &'static str, path: &Path, reason: impl ToString) -> TlsError {
    TlsError::Pem {
        what,
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

fn certs(
    what: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(what, path, e))?;
    if certs.is_empty() {
        return Err(pem_error(what, path, "no CERTIFICATE block"));
    }
    Ok(certs)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Both configs from the files' bytes (`[cert, key, ca]`).
fn build(files: &TlsFiles, bytes: [Vec<u8>; 3]) -> Result<Loaded, TlsError> {
    let chain = certs("certificate", &files.cert, &bytes[0])?;
    let key =
        PrivateKeyDer::from_pem_slice(&bytes[1]).map_err(|e| pem_error("key", &files.key, e))?;
    let mut roots = RootCertStore::empty();
    for ca in certs("CA", &files.ca, &bytes[2])? {
        roots.add(ca).map_err(|e| pem_error("CA", &files.ca, e))?;
    }
    let roots = Arc::new(roots);
    let config = |e: rustls::Error| TlsError::Config(e.to_string());

    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
            .build()
            .map_err(|e| TlsError::Config(e.to_string()))?;
    // `with_single_cert` checks that the key is the certificate's.
    let mut server = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(config)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(|e| {
            TlsError::Config(format!(
                "certificate {} with key {}: {e}",
                files.cert.display(),
                files.key.display()
            ))
        })?;
    server.alpn_protocols = vec![b"h2".to_vec()];

    let mut client = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(config)?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(config)?;
    client.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Loaded {
        bytes,
        server: Arc::new(server),
        client: Arc::new(client),
    })
}

fn read_all(files: &TlsFiles) -> Result<[Vec<u8>; 3], TlsError> {
    Ok([
        read("certificate", &files.cert)?,
        read("key", &files.key)?,
        read("CA", &files.ca)?,
    ])
}

impl InternalTls {
    /// Reads and checks the files; any problem is refused here, before the service starts.
    pub fn load(files: TlsFiles) -> Result<Arc<InternalTls>, TlsError> {
        let loaded = build(&files, read_all(&files)?)?;
        Ok(Arc::new(InternalTls {
            files,
            state: Mutex::new(State {
                loaded,
                checked: Instant::now(),
            }),
        }))
    }

    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// The state, the files read again when [`RECHECK`] has passed.
    fn fresh(&self) -> std::sync::MutexGuard<'_, State> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.checked.elapsed() >= RECHECK {
            s.checked = Instant::now();
            match read_all(&self.files) {
                Ok(bytes) if bytes != s.loaded.bytes => match build(&self.files, bytes) {
                    Ok(loaded) => {
                        s.loaded = loaded;
                        tracing::info!(cert = %self.files.cert.display(), "internal TLS files changed: reloaded");
                    }
                    Err(e) => tracing::warn!(error = %e, "keeping the last internal TLS files"),
                },
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "keeping the last internal TLS files"),
            }
        }
        s
    }

    /// The server side: the caller must present a certificate the CA signed.
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.fresh().loaded.server.clone()
    }

    /// The client side: the certificate presented, the server's checked against the CA.
    pub fn client_config(&self) -> Arc<ClientConfig> {
        self.fresh().loaded.client.clone()
    }

    /// Makes [`fresh`](Self::fresh) read the files on its next call (tests).
    #[doc(hidden)]
    pub fn expire_check(&self) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.checked = Instant::now() - RECHECK;
    }
}

/// The name a replica's certificate must carry: the DNS name of a `dns:///name:port` source
/// (every replica behind a headless Service shares it), else the host of `host:port`.
pub fn server_name(source: &crate::replicas::ReplicaSource, addr: &str) -> String {
    match source {
        crate::replicas::ReplicaSource::Dns { host, .. } => host.clone(),
        crate::replicas::ReplicaSource::Static(_) => host_of(addr).to_string(),
    }
}

/// `host` of `host:port` / `[v6]:port` (brackets dropped).
pub fn host_of(addr: &str) -> &str {
    let addr = addr.trim_start_matches("http://");
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partial_set_of_flags_is_refused_naming_what_is_missing() {
        assert_eq!(TlsFiles::from_flags(None, None, None).unwrap(), None);
        let e = TlsFiles::from_flags(Some("c".into()), None, Some("a".into())).unwrap_err();
        assert!(e.to_string().contains("missing: --internal-tls-key"), "{e}");
    }

    #[test]
    fn hosts_and_names() {
        use crate::replicas::ReplicaSource;
        assert_eq!(host_of("vision-0.vision:50061"), "vision-0.vision");
        assert_eq!(host_of("[::1]:50061"), "::1");
        assert_eq!(host_of("http://127.0.0.1:1"), "127.0.0.1");
        let dns = ReplicaSource::parse("dns:///vision.vlm.svc:50061").unwrap();
        assert_eq!(server_name(&dns, "10.0.0.7:50061"), "vision.vlm.svc");
        let fixed = ReplicaSource::parse("localhost:1").unwrap();
        assert_eq!(server_name(&fixed, "localhost:1"), "localhost");
    }
}
