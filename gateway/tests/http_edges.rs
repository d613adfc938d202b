//! HTTP edges of issue 42 through the real router and connection handling in process (no
//! replicas): CORS off and on, and a streaming request that has to queue for admission getting
//! its status line at once.
mod support;

use serde_json::json;
use std::net::SocketAddr;
use std::time::Duration;
use support::{http_state, serve_app, serve_state, start_gateway};
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

fn streaming_body(stream: bool) -> String {
    json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream})
        .to_string()
}

/// Waits until admission has `want` (in flight, queued).
async fn counts(state: &vlm_gateway::openai::HttpState, want: (usize, usize)) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while state.core.admission().counts() != want {
        assert!(
            tokio::time::Instant::now() < deadline,
            "admission {:?}, want {want:?}",
            state.core.admission().counts()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// With the one slot held (--max-in-flight 1), a streaming request gets its 200 and SSE
/// headers at once and waits in the stream; once admitted, its failure (no replica here)
/// arrives as an error event and [DONE]. A queued stream whose caller leaves gives up its place;
/// a full queue is still a 429 at once, and a non-streaming request still waits for its status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_stream_gets_its_status_line_at_once() {
    let (state, _dir) = http_state(deny(), 1);
    let held = state.core.admission().acquire(0).await.unwrap();
    let addr = serve_state(state.clone(), HttpLimits::default()).await;
    let path = "/v1/chat/completions";

    let mut waiting = send(addr, "POST", path, "", &streaming_body(true)).await;
    let (status, h) = tokio::time::timeout(PATIENCE, head(&mut waiting))
        .await
        .expect("the queued stream's status line while the slot is held");
    assert_eq!(status, 200, "{h}");
    assert!(h.contains("content-type: text/event-stream"), "{h}");
    counts(&state, (1, 1)).await;

    // A non-streaming request queues without an answer.
    let mut plain = send(addr, "POST", path, "", &streaming_body(false)).await;
    counts(&state, (1, 2)).await;
    // A queued stream whose caller goes away leaves the queue.
    let mut leaving = send(addr, "POST", path, "", &streaming_body(true)).await;
    let (status, _) = head(&mut leaving).await;
    assert_eq!(status, 200);
    counts(&state, (1, 3)).await;
    drop(leaving);
    counts(&state, (1, 2)).await;
    // Fill the queue (4): the next is refused at once, with its status.
    let mut fill = Vec::new();
    for _ in 0..2 {
        let mut s = send(addr, "POST", path, "", &streaming_body(true)).await;
        assert_eq!(head(&mut s).await.0, 200);
        fill.push(s);
    }
    counts(&state, (1, 4)).await;
    let (status, h, body) = whole(addr, "POST", path, "", &streaming_body(true)).await;
    assert_eq!(status, 429, "{h}{body}");
    assert!(h.contains("retry-after"), "{h}");
    drop(fill);
    counts(&state, (1, 2)).await;

    // The slot frees: the stream is admitted, finds no LM replica, and says so in the stream.
    drop(held);
    let mut rest = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&rest).contains("data: [DONE]") {
        let n = tokio::time::timeout(PATIENCE, waiting.read(&mut buf))
            .await
            .expect("the stream's end")
            .unwrap();
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&rest));
        rest.extend_from_slice(&buf[..n]);
    }
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains("data: {\"error\""), "{rest}");
    assert!(rest.contains("service_unavailable"), "{rest}");
    assert!(rest.contains("data: [DONE]"), "{rest}");
    // The non-streaming one gets its failure as a status.
    let (status, _) = tokio::time::timeout(PATIENCE, head(&mut plain))
        .await
        .expect("the plain request's answer");
    assert_eq!(status, 503);
    counts(&state, (0, 0)).await;
}
