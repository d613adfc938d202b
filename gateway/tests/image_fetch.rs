//! Fetching http image URLs against a local raw-TCP HTTP server: the image comes back; an
//! oversized body (chunked or with a large Content-Length), a redirect, a 404 and a slow
//! server are each refused with a message naming the limit or the cause. Then the OpenAI
//! route, in process, with an allow-listed URL.
use bytes::Bytes;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use vlm_gateway::fetch::{FetchOptions, ImageFetcher};
use vlm_gateway::GatewayError;

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
async fn read_path(s: &mut TcpStream) -> Option<String> {
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

async fn serve_one(mut s: TcpStream, png: Bytes) {
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
    let f = fetcher(3000);
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
        let url = format!("http://{addr}{path}");
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
async fn hosts_not_listed_and_https_are_refused_before_connecting() {
    let (addr, _) = start_server().await;
    let none = ImageFetcher::new(FetchOptions::deny_all());
    let m = validation_message(none.fetch(&format!("http://{addr}/img.png")).await);
    assert!(m.contains("--allow-image-host 127.0.0.1"), "{m}");
    let m = validation_message(fetcher(1000).fetch("https://127.0.0.1/img.png").await);
    assert!(m.contains("http:// image URLs only"), "{m}");
}

// ---- The OpenAI route in process: the gateway without replicas. A fetched image gets past
// validation (and then finds no replica: 503); a fetch failure is a 400 naming the cause.

mod http_route {
    use super::*;
    use vlm_gateway::admission::{Admission, AdmissionLimits};
    use vlm_gateway::auth::ApiKeys;
    use vlm_gateway::generate::Core;
    use vlm_gateway::openai::{router, HttpState};
    use vlm_gateway::routing::{ReplicaSource, Router, RoutingOptions};
    use vlm_gateway::validation::{Limits, Validator};

    async fn start_gateway(fetch: ImageFetcher) -> (SocketAddr, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let mut opts = vlm_model::make::MakeOptions::new(vlm_model::make::Preset::Tiny);
        opts.weights = false;
        vlm_model::make::make_model(dir.path(), &opts).unwrap();
        let tok = vlm_model::tokenizer::ChatTokenizer::from_dir(dir.path()).unwrap();
        let mut cfg = vlm_config::DeployConfig::default_config();
        cfg.visual.max_seq_len = vec![1024, 4096];
        let limits = Limits::from_config(&cfg, 2, 1 << 20);
        let validator = Validator::new(tok, cfg.visual, limits, "tiny".into());
        let admission = Admission::new(AdmissionLimits {
            max_in_flight: 4,
            max_queue: 4,
            max_kv_tokens: 0,
        });
        let routes = Router::new(
            ReplicaSource::Static(vec![]),
            ReplicaSource::Static(vec![]),
            RoutingOptions::default(),
        );
        let ready = routes.ready();
        let state = HttpState {
            core: Core::new(validator, admission, routes),
            keys: ApiKeys::load(None, None).unwrap(),
            ready,
            metrics: vlm_service_kit::metrics_http::recorder(),
            images: fetch,
        };
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, router(state)).await });
        (addr, dir)
    }

    async fn post(addr: SocketAddr, body: &serde_json::Value) -> (u16, String) {
        let body = body.to_string();
        let mut s = TcpStream::connect(addr).await.unwrap();
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        let text = String::from_utf8_lossy(&out).into_owned();
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        (status, text)
    }

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
}
