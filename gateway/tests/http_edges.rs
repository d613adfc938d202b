//! HTTP edges of issue 42 through the real router and connection handling in process (no
//! replicas): CORS off and on.
mod support;

use std::net::SocketAddr;
use std::time::Duration;
use support::{http_state, serve_app, start_gateway};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use vlm_gateway::cors::CorsOrigins;
use vlm_gateway::fetch::{FetchOptions, ImageFetcher};
use vlm_gateway::http_serve::HttpLimits;
use vlm_gateway::openai::router;

/// Generous: nothing below takes more than a moment.
const PATIENCE: Duration = Duration::from_secs(20);

fn deny() -> ImageFetcher {
    ImageFetcher::new(FetchOptions::deny_all())
}

/// Sends a request with `headers` (each ending in \r\n) and returns the connection (kept
/// alive: the server notices when it is dropped).
async fn send(addr: SocketAddr, method: &str, path: &str, headers: &str, body: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n{headers}\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    s
}

/// The response head (status line and headers, lower-cased names), read up to its end.
async fn head(s: &mut TcpStream) -> (u16, String) {
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        let n = s.read(&mut byte).await.unwrap();
        assert!(
            n > 0,
            "closed before the head: {:?}",
            String::from_utf8_lossy(&got)
        );
        got.push(byte[0]);
    }
    let text = String::from_utf8_lossy(&got).to_string();
    let status = text.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, text.to_ascii_lowercase())
}

/// A whole response: (status, head, body).
async fn whole(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> (u16, String, String) {
    let headers = format!("{headers}Connection: close\r\n");
    let mut s = send(addr, method, path, &headers, body).await;
    let (status, h) = tokio::time::timeout(PATIENCE, head(&mut s))
        .await
        .expect("a response head");
    let mut rest = Vec::new();
    tokio::time::timeout(PATIENCE, s.read_to_end(&mut rest))
        .await
        .expect("the response's end")
        .unwrap();
    (status, h, String::from_utf8_lossy(&rest).to_string())
}

const PREFLIGHT: &str = "Origin: https://app.example\r\nAccess-Control-Request-Method: POST\r\n\
                         Access-Control-Request-Headers: authorization, content-type\r\n";

#[tokio::test]
async fn cors_is_off_by_default() {
    let (addr, _dir) = start_gateway(deny()).await;
    let (status, h, _) = whole(addr, "OPTIONS", "/v1/chat/completions", PREFLIGHT, "").await;
    assert_eq!(status, 405, "{h}");
    assert!(!h.contains("access-control-allow-origin"), "{h}");
    let (status, h, _) = whole(
        addr,
        "GET",
        "/health",
        "Origin: https://app.example\r\n",
        "",
    )
    .await;
    assert_eq!(status, 503);
    assert!(!h.contains("access-control-allow-origin"), "{h}");
}

#[tokio::test]
async fn cors_answers_preflights_and_marks_responses_for_allowed_origins() {
    let (state, _dir) = http_state(deny(), 4);
    let cors = CorsOrigins::parse(&["https://app.example"]).unwrap();
    let addr = serve_app(cors.apply(router(state)), HttpLimits::default()).await;

    let (status, h, _) = whole(addr, "OPTIONS", "/v1/chat/completions", PREFLIGHT, "").await;
    assert_eq!(status, 204, "{h}");
    assert!(
        h.contains("access-control-allow-origin: https://app.example\r\n"),
        "{h}"
    );
    assert!(
        h.contains("access-control-allow-methods: get, post, options"),
        "{h}"
    );
    assert!(
        h.contains("access-control-allow-headers: authorization, content-type"),
        "{h}"
    );
    // The answers themselves, errors included, are readable by the app.
    let (status, h, body) = whole(
        addr,
        "POST",
        "/v1/chat/completions",
        "Origin: https://app.example\r\n",
        r#"{"messages": 3}"#,
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        h.contains("access-control-allow-origin: https://app.example\r\n"),
        "{h}"
    );
    assert!(
        h.contains("access-control-expose-headers: retry-after"),
        "{h}"
    );
    // Another origin: as without CORS.
    let other = PREFLIGHT.replace("app.example", "evil.example");
    let (status, h, _) = whole(addr, "OPTIONS", "/v1/chat/completions", &other, "").await;
    assert_eq!(status, 405, "{h}");
    assert!(!h.contains("access-control-allow-origin"), "{h}");
    let (status, h, _) = whole(
        addr,
        "GET",
        "/health",
        "Origin: https://evil.example\r\n",
        "",
    )
    .await;
    assert_eq!(status, 503);
    assert!(!h.contains("access-control-allow-origin"), "{h}");
}
