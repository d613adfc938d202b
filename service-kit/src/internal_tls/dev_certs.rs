//! A CA and a certificate for trying mutual TLS without a PKI (`vlm certs`, the tests): one
//! ECDSA P-256 CA, and certificates it signs for both ends (server and client use). On a
//! cluster, cert-manager issues them instead (deploy/k8s/components/internal-mtls).
use super::{TlsError, TlsFiles};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use std::path::Path;

fn rcgen_error(e: rcgen::Error) -> TlsError {
    TlsError::Config(format!("generating a certificate: {e}"))
}

/// A CA made here, its key kept in memory.
pub struct DevCa {
    cert: rcgen::Certificate,
    key: KeyPair,
}

/// A certificate and its key, PEM.
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

impl DevCa {
    pub fn new(common_name: &str) -> Result<DevCa, TlsError> {
        let key = KeyPair::generate().map_err(rcgen_error)?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(rcgen_error)?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).map_err(rcgen_error)?;
        Ok(DevCa { cert, key })
    }

    pub fn cert_pem(&self) -> String {
        self.cert.pem()
    }

    /// A certificate for `names` (DNS names or IP addresses), for server and client use.
    pub fn issue(&self, names: &[String]) -> Result<Issued, TlsError> {
        let key = KeyPair::generate().map_err(rcgen_error)?;
        let mut params = CertificateParams::new(names.to_vec()).map_err(rcgen_error)?;
        if let Some(first) = names.first() {
            params.distinguished_name.push(DnType::CommonName, first);
        }
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .map_err(rcgen_error)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// The names a local stack's certificate needs: loopback by name and address.
pub fn loopback_names() -> Vec<String> {
    ["localhost", "127.0.0.1", "::1"].map(String::from).to_vec()
}

fn write(path: &Path, text: &str, private: bool) -> Result<(), TlsError> {
    let io = |source| TlsError::Io {
        what: "output",
        path: path.to_path_buf(),
        source,
    };
    std::fs::write(path, text).map_err(io)?;
    if private {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    }
    Ok(())
}

/// Writes `ca.crt`, `tls.crt` and `tls.key` (mode 0600) into `dir` (the names of a
/// cert-manager Secret's keys): a new CA and one certificate for `names`, which every service
/// of a local stack can present.
pub fn write_dev_certs(dir: &Path, names: &[String]) -> Result<TlsFiles, TlsError> {
    std::fs::create_dir_all(dir).map_err(|source| TlsError::Io {
        what: "output directory",
        path: dir.to_path_buf(),
        source,
    })?;
    let ca = DevCa::new("vlm internal CA (dev)")?;
    let issued = ca.issue(names)?;
    let files = TlsFiles {
        cert: dir.join("tls.crt"),
        key: dir.join("tls.key"),
        ca: dir.join("ca.crt"),
    };
    write(&files.ca, &ca.cert_pem(), false)?;
    write(&files.cert, &issued.cert_pem, false)?;
    write(&files.key, &issued.key_pem, true)?;
    Ok(files)
}
