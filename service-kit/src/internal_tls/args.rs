//! The three flags of [`super::InternalTls`], the same on every service (flattened into each
//! binary's arguments).
use super::{InternalTls, TlsError, TlsFiles};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Debug, clap::Args)]
pub struct InternalTlsArgs {
    /// Mutual TLS on the internal APIs (vlm.v1.Vision, vlm.v1.Lm): this service's certificate
    /// (PEM, then any intermediates), presented when it serves and when it dials. Vision and
    /// the LM then take only callers whose certificate the CA signed; the gateway and the LM
    /// dial only replicas presenting one for the name dialled. Needs --internal-tls-key and
    /// --internal-tls-ca; the files are re-read when they change (a cert-manager Secret).
    #[arg(long, env = "VLM_INTERNAL_TLS_CERT")]
    pub internal_tls_cert: Option<PathBuf>,
    /// The private key of --internal-tls-cert (PEM).
    #[arg(long, env = "VLM_INTERNAL_TLS_KEY")]
    pub internal_tls_key: Option<PathBuf>,
    /// The CA (PEM) that signs the services' certificates.
    #[arg(long, env = "VLM_INTERNAL_TLS_CA")]
    pub internal_tls_ca: Option<PathBuf>,
}

impl InternalTlsArgs {
    /// The files loaded and checked ([`TlsFiles::from_flags`], [`InternalTls::load`]); `None`
    /// without the flags.
    pub fn load(self) -> Result<Option<Arc<InternalTls>>, TlsError> {
        TlsFiles::from_flags(
            self.internal_tls_cert,
            self.internal_tls_key,
            self.internal_tls_ca,
        )?
        .map(InternalTls::load)
        .transpose()
    }
}
