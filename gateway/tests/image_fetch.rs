//! Fetching http image URLs against a local raw-TCP HTTP server: the image comes back; an
//! oversized body (chunked or with a large Content-Length), a redirect, a 404 and a slow
//! server are each refused with a message naming the limit or the cause. The same server
//! behind TLS (rustls, a certificate from a test CA made with rcgen) for https: trusted
//! through `--image-fetch-ca-file`, untrusted without it, a name mismatch, the same limits.
//! Then the OpenAI route, in process, with allow-listed http and https URLs.
use bytes::Bytes;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use vlm_gateway::fetch::{read_ca_file, FetchOptions, ImageFetcher};
use vlm_gateway::GatewayError;

mod support;

const LIMIT: usize = 64 << 10;

fn png(w: u32, h: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([(x * 4 % 256) as u8, (y * 4 % 256) as u8, 7])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

/// Reads the request head; returns the path.
async fn read_path<S: AsyncRead + Unpin>(s: &mut S) -> Option<String> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&head).lines().next()?.to_string();
    line.split_whitespace().nth(1).map(str::to_string)
}

async fn serve_one<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, png: Bytes) {
    let Some(path) = read_path(&mut s).await else {
        return;
    };
    let simple = |status: &str, extra: &str, body: &[u8]| {
        let mut r = format!(
            "HTTP/1.1 {status}\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        )
        .into_bytes();
        r.extend_from_slice(body);
        r
    };
    match path.as_str() {
        "/img.png" => {
            let r = simple("200 OK", "Content-Type: image/png\r\n", &png);
            let _ = s.write_all(&r).await;
        }
        "/text" => {
            let r = simple("200 OK", "Content-Type: text/plain\r\n", b"not an image");
            let _ = s.write_all(&r).await;
        }
        "/chunked" => {
            // Endless chunks: only a client that stops at the limit gets an answer before
            // its deadline.
            let head =
                "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nTransfer-Encoding: chunked\r\n\r\n";
            if s.write_all(head.as_bytes()).await.is_err() {
                return;
            }
            let chunk = vec![b'x'; 16 << 10];
            loop {
                let mut c = format!("{:x}\r\n", chunk.len()).into_bytes();
                c.extend_from_slice(&chunk);
                c.extend_from_slice(b"\r\n");
                if s.write_all(&c).await.is_err() {
                    return;
                }
            }
        }
        "/big-length" => {
            // Declares 1 GB, then sends a little and stalls: only a client that refuses on
            // the header answers before its deadline.
            let head =
                "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 1000000000\r\n\r\n";
            let _ = s.write_all(head.as_bytes()).await;
            let _ = s.write_all(&[0u8; 1024]).await;
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
        "/redirect" => {
            let r = simple(
                "302 Found",
                "Location: http://elsewhere.example/img.png\r\n",
                b"",
            );
            let _ = s.write_all(&r).await;
        }
        "/slow" => {
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
        _ => {
            let r = simple("404 Not Found", "", b"no such thing");
            let _ = s.write_all(&r).await;
        }
    }
}

async fn start_server() -> (SocketAddr, Bytes) {
    let png = Bytes::from(png(64, 64));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let p = png.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(serve_one(s, p.clone()));
        }
    });
    (addr, png)
}

fn fetcher(timeout_ms: u64) -> ImageFetcher {
    ImageFetcher::new(FetchOptions {
        allow_hosts: vec!["127.0.0.1".into()],
        max_bytes: LIMIT,
        timeout: Duration::from_millis(timeout_ms),
        extra_roots: Vec::new(),
    })
}

// ---- TLS: a test CA, server certificates it signs, the same server behind rustls.

fn ring() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

struct TestCa {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

impl TestCa {
    fn new() -> Self {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        // A name of its own: webpki picks the root by name, and two test CAs of one name
        // would fail as a bad signature rather than an unknown issuer.
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        p.distinguished_name
            .push(rcgen::DnType::CommonName, format!("vlm test CA {n}"));
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let cert = p.self_signed(&key).unwrap();
        TestCa { cert, key }
    }

    /// The CA certificate in a PEM file, as `--image-fetch-ca-file` reads it.
    fn ca_file(&self) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.pem");
        std::fs::write(&path, self.cert.pem()).unwrap();
        (dir, path)
    }

    /// A rustls server config whose certificate (names: DNS names or IP addresses) this CA
    /// signs.
    fn server(&self, names: &[&str]) -> Arc<rustls::ServerConfig> {
        let key = rcgen::KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let leaf = rcgen::CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &self.cert, &self.key)
            .unwrap();
        let key = rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into());
        let cfg = rustls::ServerConfig::builder_with_provider(ring())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![leaf.der().clone()], key)
            .unwrap();
        Arc::new(cfg)
    }
}

/// [`serve_one`] behind TLS, on 127.0.0.1.
async fn start_tls_server(cfg: Arc<rustls::ServerConfig>) -> (u16, Bytes) {
    let png = Bytes::from(png(64, 64));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let p = png.clone();
    let acceptor = tokio_rustls::TlsAcceptor::from(cfg);
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let (acceptor, p) = (acceptor.clone(), p.clone());
            tokio::spawn(async move {
                if let Ok(tls) = acceptor.accept(s).await {
                    serve_one(tls, p).await;
                }
            });
        }
    });
    (port, png)
}

/// Allows `localhost` and `127.0.0.1`; trusts `ca` (as read from its file) when given.
fn tls_fetcher(timeout_ms: u64, ca: Option<&TestCa>) -> ImageFetcher {
    let extra_roots = match ca {
        Some(ca) => {
            let (_dir, path) = ca.ca_file();
            read_ca_file(&path).unwrap()
        }
        None => Vec::new(),
    };
    ImageFetcher::new(FetchOptions {
        allow_hosts: vec!["localhost".into(), "127.0.0.1".into()],
        max_bytes: LIMIT,
        timeout: Duration::from_millis(timeout_ms),
        extra_roots,
    })
}

fn validation_message(r: Result<vlm_gateway::fetch::Fetched, GatewayError>) -> String {
    match r {
        Err(GatewayError::Validation(m)) => m,
        Err(e) => panic!("expected a validation error, got {e:?}"),
        Ok(f) => panic!("expected an error, got {} bytes", f.data.len()),
    }
}

#[tokio::test]
async fn fetches_a_png() {
    let (addr, png) = start_server().await;
    let f = fetcher(5000)
        .fetch(&format!("http://{addr}/img.png"))
        .await
        .unwrap();
    assert_eq!(f.data, png);
    assert_eq!(f.mime_type, "image/png");
}

#[tokio::test]
async fn limits_and_failures_name_their_cause() {
    let (addr, _) = start_server().await;
    check_limits_and_failures(&fetcher(3000), &format!("http://{addr}")).await;
}

/// The byte limits, a redirect and a 404 at `base` (`scheme://host:port`), each refused
/// quickly with a message naming the URL and the cause.
async fn check_limits_and_failures(f: &ImageFetcher, base: &str) {
    let cases = [
        (
            "/chunked",
            format!("body exceeds the {LIMIT}-byte limit of --image-fetch-max-bytes"),
        ),
        (
            "/big-length",
            format!(
                "Content-Length 1000000000 exceeds the {LIMIT}-byte limit of --image-fetch-max-bytes"
            ),
        ),
        (
            "/redirect",
            "302 Found redirecting to \"http://elsewhere.example/img.png\"; redirects are not followed"
                .to_string(),
        ),
        ("/missing", "server answered 404 Not Found".to_string()),
    ];
    for (path, needle) in cases {
        let url = format!("{base}{path}");
        let t0 = Instant::now();
        let m = validation_message(f.fetch(&url).await);
        assert!(
            m.starts_with(&format!("image URL {url}: ")),
            "{path}: {m:?} does not name the URL"
        );
        assert!(m.contains(&needle), "{path}: {m:?} lacks {needle:?}");
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "{path} took {:?}",
            t0.elapsed()
        );
    }
}

#[tokio::test]
async fn slow_server_hits_the_deadline() {
    let (addr, _) = start_server().await;
    let t0 = Instant::now();
    let m = validation_message(fetcher(300).fetch(&format!("http://{addr}/slow")).await);
    assert!(
        m.contains("no complete response within the 300 ms limit of --image-fetch-timeout-ms"),
        "{m}"
    );
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
}

#[tokio::test]
async fn hosts_not_listed_are_refused_before_connecting() {
    let (addr, _) = start_server().await;
    let none = ImageFetcher::new(FetchOptions::deny_all());
    let m = validation_message(none.fetch(&format!("http://{addr}/img.png")).await);
    assert!(m.contains("--allow-image-host 127.0.0.1"), "{m}");
    // https:// goes through the same allow-list.
    let m = validation_message(none.fetch(&format!("https://{addr}/img.png")).await);
    assert!(m.contains("--allow-image-host 127.0.0.1"), "{m}");
    let m = validation_message(fetcher(1000).fetch("https://localhost/img.png").await);
    assert!(m.contains("--allow-image-host localhost"), "{m}");
}

#[tokio::test]
async fn https_with_the_ca_file_fetches_the_png() {
    let ca = TestCa::new();
    let (port, png) = start_tls_server(ca.server(&["localhost", "127.0.0.1"])).await;
    let f = tls_fetcher(5000, Some(&ca));
    // By DNS name (SNI and the name check) and by IP address (the certificate's IP SAN).
    for host in ["localhost", "127.0.0.1"] {
        let got = f
            .fetch(&format!("https://{host}:{port}/img.png"))
            .await
            .unwrap_or_else(|e| panic!("{host}: {e}"));
        assert_eq!(got.data, png, "{host}");
        assert_eq!(got.mime_type, "image/png", "{host}");
    }
}

#[tokio::test]
async fn https_without_the_ca_file_is_an_untrusted_certificate() {
    let ca = TestCa::new();
    let (port, _) = start_tls_server(ca.server(&["localhost"])).await;
    let url = format!("https://localhost:{port}/img.png");
    let m = validation_message(tls_fetcher(3000, None).fetch(&url).await);
    assert!(m.starts_with(&format!("image URL {url}: ")), "{m}");
    assert!(
        m.contains(&format!(
            "TLS handshake with localhost:{port} failed: untrusted certificate"
        )),
        "{m}"
    );
    assert!(m.contains("--image-fetch-ca-file"), "{m}");
    // A different CA's file does not help either.
    let other = TestCa::new();
    let m = validation_message(tls_fetcher(3000, Some(&other)).fetch(&url).await);
    assert!(m.contains("untrusted certificate"), "{m}");
}

#[tokio::test]
async fn https_certificate_for_another_name_is_a_name_mismatch() {
    let ca = TestCa::new();
    let f = tls_fetcher(3000, Some(&ca));
    let (port, _) = start_tls_server(ca.server(&["other.example"])).await;
    let url = format!("https://localhost:{port}/img.png");
    let m = validation_message(f.fetch(&url).await);
    assert!(m.starts_with(&format!("image URL {url}: ")), "{m}");
    assert!(
        m.contains(&format!(
            "TLS handshake with localhost:{port} failed: certificate name mismatch"
        )),
        "{m}"
    );
    assert!(
        m.contains("localhost") && m.contains("other.example"),
        "{m}"
    );
    // An IP-address URL against a certificate that names only a DNS name.
    let (port, _) = start_tls_server(ca.server(&["localhost"])).await;
    let m = validation_message(f.fetch(&format!("https://127.0.0.1:{port}/img.png")).await);
    assert!(m.contains("certificate name mismatch"), "{m}");
    assert!(m.contains("127.0.0.1"), "{m}");
}

#[tokio::test]
async fn https_limits_and_failures_name_their_cause() {
    let ca = TestCa::new();
    let (port, _) = start_tls_server(ca.server(&["localhost"])).await;
    let f = tls_fetcher(3000, Some(&ca));
    check_limits_and_failures(&f, &format!("https://localhost:{port}")).await;
}

#[tokio::test]
async fn https_deadline_and_handshake_failures() {
    let ca = TestCa::new();
    let (port, _) = start_tls_server(ca.server(&["localhost"])).await;
    let f = tls_fetcher(300, Some(&ca));
    let needle = "no complete response within the 300 ms limit of --image-fetch-timeout-ms";
    let m = validation_message(f.fetch(&format!("https://localhost:{port}/slow")).await);
    assert!(m.contains(needle), "{m}");

    // A server that accepts the connection and never answers the ClientHello: the deadline
    // covers the handshake.
    let mute = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mute_port = mute.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = mute.accept().await {
            held.push(s);
        }
    });
    let t0 = Instant::now();
    let m = validation_message(
        f.fetch(&format!("https://127.0.0.1:{mute_port}/img.png"))
            .await,
    );
    assert!(m.contains(needle), "{m}");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());

    // https:// to a plain-http server (it answers anything with a 400): a failed handshake,
    // named as such.
    let plain = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = plain.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = plain.accept().await {
            let _ = s
                .write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                .await;
        }
    });
    let url = format!("https://{addr}/img.png");
    let m = validation_message(tls_fetcher(3000, Some(&ca)).fetch(&url).await);
    assert!(m.starts_with(&format!("image URL {url}: ")), "{m}");
    assert!(
        m.contains(&format!("TLS handshake with {addr} failed")),
        "{m}"
    );
}

#[test]
fn ca_file_errors_name_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.pem");
    let e = read_ca_file(&missing).unwrap_err();
    assert!(
        e.contains(&format!("--image-fetch-ca-file {}", missing.display()))
            && e.contains("cannot read"),
        "{e}"
    );

    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "no PEM here\n").unwrap();
    let e = read_ca_file(&empty).unwrap_err();
    assert!(
        e.contains(&empty.display().to_string()) && e.contains("holds no certificate"),
        "{e}"
    );

    // A private key alone is no certificate either.
    let key_only = dir.path().join("key.pem");
    std::fs::write(
        &key_only,
        rcgen::KeyPair::generate().unwrap().serialize_pem(),
    )
    .unwrap();
    let e = read_ca_file(&key_only).unwrap_err();
    assert!(e.contains("holds no certificate"), "{e}");

    let broken = dir.path().join("broken.pem");
    std::fs::write(
        &broken,
        "-----BEGIN CERTIFICATE-----\nnot base64 !!\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let e = read_ca_file(&broken).unwrap_err();
    assert!(e.contains(&broken.display().to_string()), "{e}");

    // Two CAs in one file: both are read, and a server of either is trusted.
    let (a, b) = (TestCa::new(), TestCa::new());
    let both = dir.path().join("both.pem");
    std::fs::write(&both, format!("{}{}", a.cert.pem(), b.cert.pem())).unwrap();
    assert_eq!(read_ca_file(&both).unwrap().len(), 2);
}

// ---- The OpenAI route in process: the gateway without replicas. A fetched image gets past
// validation (and then finds no replica: 503); a fetch failure is a 400 naming the cause.

mod http_route {
    use super::support::{post, start_gateway};
    use super::*;

    fn chat(url: &str) -> serde_json::Value {
        serde_json::json!({"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "what is this?"}
        ]}]})
    }

    #[tokio::test]
    async fn allow_listed_image_url_gets_past_validation() {
        let (img, _) = start_server().await;
        let (gw, _dir) = start_gateway(fetcher(3000)).await;

        // The fetched PNG is valid: the request is refused only for want of replicas.
        let (status, text) = post(gw, &chat(&format!("http://{img}/img.png"))).await;
        assert_eq!(status, 503, "{text}");
        assert!(text.contains("unavailable"), "{text}");

        // Fetched bytes go through the same image validation as data: URLs.
        let (status, text) = post(gw, &chat(&format!("http://{img}/text"))).await;
        assert_eq!(status, 400, "{text}");
        assert!(text.contains("image 0"), "{text}");

        // Fetch failures are 400s naming the URL and the cause.
        let (status, text) = post(gw, &chat(&format!("http://{img}/missing"))).await;
        assert_eq!(status, 400, "{text}");
        assert!(text.contains("404 Not Found"), "{text}");

        // Too many images is refused before anything is fetched (the slow URL would time out).
        let slow = format!("http://{img}/slow");
        let body = serde_json::json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": slow}},
            {"type": "image_url", "image_url": {"url": slow}},
            {"type": "image_url", "image_url": {"url": slow}}
        ]}]});
        let t0 = Instant::now();
        let (status, text) = post(gw, &body).await;
        assert_eq!(status, 400, "{text}");
        assert!(text.contains("limit of 2 images"), "{text}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());

        // Hosts not listed are refused as before.
        let (gw2, _dir2) = start_gateway(ImageFetcher::new(FetchOptions::deny_all())).await;
        let (status, text) = post(gw2, &chat(&format!("http://{img}/img.png"))).await;
        assert_eq!(status, 400, "{text}");
        assert!(text.contains("--allow-image-host 127.0.0.1"), "{text}");
    }

    #[tokio::test]
    async fn allow_listed_https_image_url_gets_past_validation() {
        let ca = TestCa::new();
        let (port, _) = start_tls_server(ca.server(&["localhost"])).await;
        let (gw, _dir) = start_gateway(tls_fetcher(3000, Some(&ca))).await;
        let (status, text) = post(gw, &chat(&format!("https://localhost:{port}/img.png"))).await;
        assert_eq!(status, 503, "{text}");
        assert!(text.contains("unavailable"), "{text}");

        // Without the CA: a 400 naming the untrusted certificate.
        let (gw2, _dir2) = start_gateway(tls_fetcher(3000, None)).await;
        let (status, text) = post(gw2, &chat(&format!("https://localhost:{port}/img.png"))).await;
        assert_eq!(status, 400, "{text}");
        assert!(text.contains("untrusted certificate"), "{text}");
    }
}
