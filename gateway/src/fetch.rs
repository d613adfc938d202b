//! Fetching `image_url` images over http:// and https:// from allow-listed hosts
//! (`--allow-image-host`), with reqwest.
//!
//! No redirects, no proxies (none read from the environment), a total deadline
//! (`--image-fetch-timeout-ms`, TLS handshake included) and a byte limit
//! (`--image-fetch-max-bytes`) enforced while the body streams in: a `Content-Length` over the
//! limit is refused before reading, and a body without one stops being read (its connection
//! dropped) as soon as it crosses the limit. The URL's user info is never sent.
//!
//! TLS is rustls on the ring provider (TLS 1.2 and 1.3, ALPN `http/1.1`), handed to reqwest
//! ready-made. The server's certificate must chain to one of Mozilla's roots, compiled in
//! (webpki-roots: nothing is read from the system at run time), or to a certificate of
//! `--image-fetch-ca-file` (PEM, read once at start-up by [`read_ca_file`]) for private CAs, and
//! be valid for the URL's host: a DNS name (also sent as SNI) or an IP address (checked against
//! the certificate's IP SANs). An untrusted certificate, a name mismatch or a failed handshake
//! is refused like any other fetch failure: a validation error naming the URL and the cause.
use crate::error::GatewayError;
use axum::http::{header, StatusCode, Uri};
use bytes::{Bytes, BytesMut};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The default of `--image-fetch-timeout-ms`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(10_000);

/// Fetch policy: which hosts, how many bytes, how long.
#[derive(Debug, Clone)]
pub struct FetchOptions {
    /// Host names (or `host:port`) image URLs may name.
    pub allow_hosts: Vec<String>,
    /// Bytes of one fetched body.
    pub max_bytes: usize,
    /// Connect, TLS handshake, request, headers and body together.
    pub timeout: Duration,
    /// CA certificates trusted for https:// besides the bundled Mozilla roots
    /// (`--image-fetch-ca-file`, read by [`read_ca_file`]).
    pub extra_roots: Vec<CertificateDer<'static>>,
}

impl FetchOptions {
    /// No host allowed: every http(s) URL is refused.
    pub fn deny_all() -> Self {
        FetchOptions {
            allow_hosts: Vec::new(),
            max_bytes: 20 << 20,
            timeout: DEFAULT_TIMEOUT,
            extra_roots: Vec::new(),
        }
    }
}

/// Reads `--image-fetch-ca-file`: one or more PEM certificates (other PEM sections are
/// skipped), each usable as a trust root. The error names the path and what is wrong with it:
/// unreadable, not PEM, no certificate, or a certificate that cannot be a trust root.
pub fn read_ca_file(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let shown = path.display();
    let pem = std::fs::read(path)
        .map_err(|e| format!("--image-fetch-ca-file {shown}: cannot read it: {e}"))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("--image-fetch-ca-file {shown}: not valid PEM: {e}"))?;
    if certs.is_empty() {
        return Err(format!(
            "--image-fetch-ca-file {shown}: holds no certificate (expected one or more \
             -----BEGIN CERTIFICATE----- blocks)"
        ));
    }
    let mut store = rustls::RootCertStore::empty();
    for (i, c) in certs.iter().enumerate() {
        store.add(c.clone()).map_err(|e| {
            format!(
                "--image-fetch-ca-file {shown}: certificate {} of {} cannot be a trust root: {e}",
                i + 1,
                certs.len()
            )
        })?;
    }
    Ok(certs)
}

/// A fetched image: its bytes and the declared `Content-Type` when it is an `image/*` type
/// (empty otherwise: the validator detects the format from the bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    pub data: Bytes,
    pub mime_type: String,
}

/// An http(s) URL that passed the scheme and allow-list checks.
#[derive(Debug, Clone)]
pub struct Target {
    /// What is requested: the URL without its user info.
    url: String,
    /// https://: TLS over the connection.
    tls: bool,
    /// `host[:port]` as written (no user info): the `Host` header.
    authority: String,
    /// The host name alone, without IPv6 brackets: what is resolved, and the name (or IP
    /// address) the certificate must be valid for.
    name: String,
    /// `http(s)://host[:port]/path`, for messages (no user info, no query).
    shown: String,
}

impl Target {
    pub fn shown(&self) -> &str {
        &self.shown
    }
}

/// Fetches images under one [`FetchOptions`]; cheap to clone (one connection pool).
#[derive(Debug, Clone)]
pub struct ImageFetcher {
    opts: Arc<FetchOptions>,
    client: reqwest::Client,
}

impl ImageFetcher {
    pub fn new(opts: FetchOptions) -> Self {
        let client = reqwest::Client::builder()
            .tls_backend_preconfigured(client_config(&opts.extra_roots))
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .user_agent("vlm-gateway")
            .tcp_nodelay(true)
            .build()
            // Only a TLS backend of another type than the one compiled in fails here.
            .expect("reqwest takes the rustls config it is built with");
        ImageFetcher {
            opts: Arc::new(opts),
            client,
        }
    }

    pub fn options(&self) -> &FetchOptions {
        &self.opts
    }

    /// The synchronous part: scheme, URL syntax and allow-list. Cheap; call it before any
    /// network work so a refused URL costs nothing.
    pub fn check(&self, url: &str) -> Result<Target, GatewayError> {
        let https = url.starts_with("https://");
        if !https && !url.starts_with("http://") {
            return Err(GatewayError::validation(
                "image_url must be a data: URL (data:image/png;base64,...) or an http(s) URL",
            ));
        }
        let uri: Uri = url.parse().map_err(|e| {
            GatewayError::validation(format!(
                "image URL {:?} is not a valid URL: {e}",
                truncate(url, 200)
            ))
        })?;
        let auth = uri.authority().ok_or_else(|| {
            GatewayError::validation(format!("image URL {:?} has no host", truncate(url, 200)))
        })?;
        let host = auth.host();
        let authority = match auth.port_u16() {
            Some(p) => format!("{host}:{p}"),
            None => host.to_string(),
        };
        let name = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let allowed = self
            .opts
            .allow_hosts
            .iter()
            .any(|h| *h == name || *h == host || *h == authority);
        if !allowed {
            return Err(GatewayError::validation(format!(
                "image URL host {name:?} is not allowed: send the image as a data: URL, or start the gateway with \
                 --allow-image-host {name}"
            )));
        }
        let scheme = if https { "https" } else { "http" };
        let shown = format!("{scheme}://{authority}{}", truncate(uri.path(), 200));
        let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
        Ok(Target {
            tls: https,
            url: format!("{scheme}://{authority}{path}"),
            authority,
            name,
            shown,
        })
    }

    /// [`check`](Self::check) then [`fetch_target`](Self::fetch_target).
    pub async fn fetch(&self, url: &str) -> Result<Fetched, GatewayError> {
        let t = self.check(url)?;
        self.fetch_target(&t).await
    }

    /// GETs the URL under the deadline and the byte limit. Every failure is a validation error
    /// naming the URL and the cause or limit.
    pub async fn fetch_target(&self, t: &Target) -> Result<Fetched, GatewayError> {
        let ms = self.opts.timeout.as_millis();
        match tokio::time::timeout(self.opts.timeout, self.get(t)).await {
            Ok(r) => r.map_err(|cause| {
                GatewayError::validation(format!("image URL {}: {cause}", t.shown))
            }),
            Err(_) => Err(GatewayError::validation(format!(
                "image URL {}: no complete response within the {ms} ms limit of --image-fetch-timeout-ms",
                t.shown
            ))),
        }
    }

    /// The request and the response, limits applied; the error is the cause, without the URL.
    async fn get(&self, t: &Target) -> Result<Fetched, String> {
        let max = self.opts.max_bytes;
        let mut resp = self
            .client
            .get(&t.url)
            .header(header::ACCEPT, "image/*")
            .send()
            .await
            .map_err(|e| send_failure(t, &e))?;
        let status = resp.status();
        if status.is_redirection() {
            let to = resp
                .headers()
                .get(header::LOCATION)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .unwrap_or_else(|| "(no Location header)".into());
            return Err(format!(
                "server answered {status} redirecting to {:?}; redirects are not followed, use the final URL",
                truncate(&to, 200)
            ));
        }
        if !status.is_success() {
            return Err(format!("server answered {}", status_text(status)));
        }
        if let Some(len) = resp.content_length() {
            if len > max as u64 {
                return Err(format!(
                    "Content-Length {len} exceeds the {max}-byte limit of --image-fetch-max-bytes"
                ));
            }
        }
        let mime_type = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| {
                v.split(';')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_ascii_lowercase()
            })
            .filter(|m| m.starts_with("image/"))
            .unwrap_or_default();
        let mut data = BytesMut::new();
        // Dropping `resp` past the limit closes its connection instead of draining the rest.
        while let Some(chunk) = resp
            .chunk()
            .await
            .map_err(|e| format!("reading the body failed: {}", innermost(&e)))?
        {
            if data.len() + chunk.len() > max {
                return Err(format!(
                    "body exceeds the {max}-byte limit of --image-fetch-max-bytes"
                ));
            }
            data.extend_from_slice(&chunk);
        }
        if data.is_empty() {
            return Err("server answered with an empty body".into());
        }
        Ok(Fetched {
            data: data.freeze(),
            mime_type,
        })
    }
}

/// A request that got no response, as a cause: a failed TLS handshake in words (rustls's error
/// in the chain), a failed connection, or what reqwest says.
fn send_failure(t: &Target, e: &reqwest::Error) -> String {
    if let Some(tls) = find_rustls(e) {
        return tls_failure(&t.authority, &t.name, tls);
    }
    if t.tls && e.is_connect() && !connect_refused(e) {
        // A handshake that ended without a rustls error (the peer closed or reset it).
        return format!(
            "TLS handshake with {} failed: {}",
            t.authority,
            innermost(e)
        );
    }
    if e.is_connect() {
        return format!("cannot connect to {}: {}", t.authority, innermost(e));
    }
    format!("request failed: {}", innermost(e))
}

/// rustls's error in `e`'s chain. It comes wrapped in io::Errors (tokio-rustls's, then the
/// connector's), whose `source()` skips the error they wrap: those are opened with `get_ref`.
fn find_rustls<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    if let Some(tls) = e.downcast_ref::<rustls::Error>() {
        return Some(tls);
    }
    if let Some(inner) = e
        .downcast_ref::<std::io::Error>()
        .and_then(|io| io.get_ref())
    {
        return find_rustls(inner);
    }
    e.source().and_then(find_rustls)
}

/// The TCP connection itself was not made (refused, unreachable, no such host).
fn connect_refused(e: &reqwest::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::*;
            return matches!(
                io.kind(),
                ConnectionRefused | HostUnreachable | NetworkUnreachable | AddrNotAvailable
            );
        }
        source = s.source();
    }
    false
}

/// The last error of `e`'s source chain: the cause in its own words.
fn innermost(e: &(dyn std::error::Error + 'static)) -> String {
    let mut last = e;
    while let Some(s) = last.source() {
        last = s;
    }
    last.to_string()
}

/// The client side of TLS: Mozilla's roots plus `extra` (already checked by
/// [`read_ca_file`]; one that still does not parse is skipped), ring, TLS 1.2 and 1.3.
fn client_config(extra: &[CertificateDer<'static>]) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    roots.add_parsable_certificates(extra.iter().cloned());
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("the ring provider supports the default TLS versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    cfg
}

/// A failed TLS handshake as a cause: the certificate problems in words, anything else as
/// rustls says it.
fn tls_failure(authority: &str, name: &str, e: &rustls::Error) -> String {
    use rustls::CertificateError as C;
    let cause = match e {
        rustls::Error::InvalidCertificate(c) => match c {
            C::UnknownIssuer => "untrusted certificate: it does not chain to a bundled Mozilla \
                                 root nor to a certificate of --image-fetch-ca-file"
                .to_string(),
            C::NotValidForNameContext { presented, .. } if !presented.is_empty() => format!(
                "certificate name mismatch: the certificate is not valid for {name:?}, only for {}",
                presented.join(", ")
            ),
            C::NotValidForName | C::NotValidForNameContext { .. } => {
                format!("certificate name mismatch: the certificate is not valid for {name:?}")
            }
            other => format!("invalid certificate: {other}"),
        },
        other => other.to_string(),
    };
    format!("TLS handshake with {authority} failed: {cause}")
}

fn status_text(s: StatusCode) -> String {
    match s.canonical_reason() {
        Some(r) => format!("{} {r}", s.as_u16()),
        None => s.as_u16().to_string(),
    }
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fetcher(hosts: &[&str]) -> ImageFetcher {
        ImageFetcher::new(FetchOptions {
            allow_hosts: hosts.iter().map(|h| h.to_string()).collect(),
            ..FetchOptions::deny_all()
        })
    }

    #[test]
    fn allow_list_and_schemes() {
        let e = fetcher(&[]).check("http://evil.example/a.png").unwrap_err();
        assert!(
            e.to_string().contains("--allow-image-host evil.example"),
            "{e}"
        );
        let f = fetcher(&["ok.example", "127.0.0.1:8000"]);
        let t = f
            .check("http://user:pw@ok.example:81/a.png?k=secret")
            .unwrap();
        assert_eq!(t.authority, "ok.example:81");
        // The user info is never sent; the query is.
        assert_eq!(t.url, "http://ok.example:81/a.png?k=secret");
        assert_eq!(t.shown(), "http://ok.example:81/a.png");
        assert!(f.check("http://127.0.0.1:8000/x").is_ok());
        let e = f.check("http://127.0.0.1:9000/x").unwrap_err();
        assert!(e.to_string().contains("not allowed"), "{e}");
        let t = f.check("https://ok.example/a.png").unwrap();
        assert_eq!(
            (t.tls, t.url.as_str(), t.shown()),
            (true, "https://ok.example/a.png", "https://ok.example/a.png")
        );
        let t = f.check("https://ok.example:8443/a.png").unwrap();
        assert_eq!(
            (t.tls, t.url.as_str()),
            (true, "https://ok.example:8443/a.png")
        );
        assert!(!f.check("http://ok.example/a.png").unwrap().tls);
        let e = f.check("https://evil.example/a.png").unwrap_err();
        assert!(
            e.to_string().contains("--allow-image-host evil.example"),
            "{e}"
        );
        assert!(f.check("ftp://ok.example/a").is_err());
        let ip6 = fetcher(&["::1"]).check("http://[::1]:8080/a").unwrap();
        assert_eq!(
            (ip6.name.as_str(), ip6.url.as_str()),
            ("::1", "http://[::1]:8080/a")
        );
    }
}
