//! The HTTP port's connection bounds (issue 42), on the gateway's own connection handling and
//! routes in process: connections that send nothing or half their headers are closed after the
//! header timeout while requests are still answered, a kept-alive connection is closed when
//! idle, a body that does not arrive is refused, and connections over the cap are closed at
//! once.
mod support;

use std::net::SocketAddr;
use std::time::Duration;
use support::{http_state, request, serve_state};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use vlm_gateway::fetch::{FetchOptions, ImageFetcher};
use vlm_gateway::http_serve::HttpLimits;

/// Generous: every bound below is a few seconds at most.
const PATIENCE: Duration = Duration::from_secs(30);

async fn gateway(limits: HttpLimits) -> (SocketAddr, tempfile::TempDir) {
    let (state, dir) = http_state(ImageFetcher::new(FetchOptions::deny_all()), 4);
    (serve_state(state, limits).await, dir)
}

fn limits(header_ms: u64, body_ms: u64, idle_ms: u64, max_connections: usize) -> HttpLimits {
    HttpLimits {
        header_read_timeout: Duration::from_millis(header_ms),
        body_read_timeout: Duration::from_millis(body_ms),
        idle_timeout: Duration::from_millis(idle_ms),
        max_connections,
    }
}

/// Waits until the server closes `s` (EOF or reset); false if it is still open after `wait`.
async fn closed_within(s: &mut TcpStream, wait: Duration) -> bool {
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout(wait, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            // Bytes of a response: keep reading to the close.
            Ok(Ok(_)) => continue,
        }
    }
}

/// A sample of `GET /metrics` from `addr`.
async fn metric(addr: SocketAddr, series: &str) -> f64 {
    let (status, text) = request(addr, "GET", "/metrics", "").await;
    assert_eq!(status, 200, "{text}");
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

const HEADER_CLOSED: &str = "vlm_gateway_http_connections_closed_total{reason=\"header_timeout\"}";
const IDLE_CLOSED: &str = "vlm_gateway_http_connections_closed_total{reason=\"idle_timeout\"}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_half_open_connections_are_closed_and_requests_still_answered() {
    let files = vlm_test_support::raise_file_limit();
    // Two descriptors per connection (both ends here), and room for the rest.
    let (idle_n, half_n) = if files >= 6000 {
        (2000, 500)
    } else {
        let n = (files.saturating_sub(200) / 2) as usize;
        eprintln!(
            "open-file limit {files}: {} idle, {} half-open",
            n * 4 / 5,
            n / 5
        );
        (n * 4 / 5, n / 5)
    };
    let (addr, _dir) = gateway(limits(3_000, 3_000, 3_000, 10_000)).await;
    let header_before = metric(addr, HEADER_CLOSED).await;
    let mut idle = Vec::with_capacity(idle_n);
    for _ in 0..idle_n {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    let mut half = Vec::with_capacity(half_n);
    for _ in 0..half_n {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            .await
            .unwrap();
        half.push(s);
    }
    // Requests are answered meanwhile: health (no replica: 503) and a refused body (400).
    let (status, text) = tokio::time::timeout(PATIENCE, request(addr, "GET", "/health", ""))
        .await
        .expect("GET /health answered");
    assert_eq!(status, 503, "{text}");
    let (status, text) = tokio::time::timeout(
        PATIENCE,
        request(addr, "POST", "/v1/chat/completions", "{\"messages\": 3}"),
    )
    .await
    .expect("a bad request answered");
    assert_eq!(status, 400, "{text}");
    // Then every one of them is closed by the header timeout.
    let waits: Vec<_> = idle
        .into_iter()
        .chain(half)
        .map(|mut s| tokio::spawn(async move { closed_within(&mut s, PATIENCE).await }))
        .collect();
    let mut open = 0;
    for w in waits {
        open += usize::from(!w.await.unwrap());
    }
    assert_eq!(open, 0, "{open} connections still open after {PATIENCE:?}");
    let closed = metric(addr, HEADER_CLOSED).await - header_before;
    assert!(
        closed >= (idle_n + half_n) as f64,
        "{closed} closed for the header timeout"
    );
    // Still serving.
    let (status, _) = request(addr, "GET", "/health", "").await;
    assert_eq!(status, 503);
}

/// A kept-alive connection is closed once idle (the header timeout is far longer, so the idle
/// timeout closed it), after its request was answered.
#[tokio::test]
async fn a_kept_alive_connection_is_closed_when_idle() {
    let (addr, _dir) = gateway(limits(600_000, 600_000, 500, 100)).await;
    let before = metric(addr, IDLE_CLOSED).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&got).contains("replica\n") {
        let n = tokio::time::timeout(PATIENCE, s.read(&mut buf))
            .await
            .expect("an answer")
            .unwrap();
        assert!(
            n > 0,
            "closed before the answer: {:?}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    assert!(
        got.starts_with(b"HTTP/1.1 503"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    assert!(
        closed_within(&mut s, PATIENCE).await,
        "still open when idle"
    );
    assert!(metric(addr, IDLE_CLOSED).await > before);
}

/// A body that stops arriving is a 408 naming the flag, not a connection held forever.
#[tokio::test]
async fn a_body_that_does_not_arrive_is_refused() {
    let (addr, _dir) = gateway(limits(600_000, 500, 600_000, 100)).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 1000\r\n\r\n{\"messages\": [",
    )
    .await
    .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(PATIENCE, s.read_to_end(&mut out))
        .await
        .expect("an answer to the stalled body")
        .ok();
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("--http-body-read-timeout-ms"), "{text}");
}

/// With the cap reached, a new connection is closed at once (the held ones are not touched);
/// once they close, connections are served again.
#[tokio::test]
async fn connections_over_the_cap_are_closed_at_once() {
    let (addr, _dir) = gateway(limits(600_000, 600_000, 600_000, 4)).await;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(TcpStream::connect(addr).await.unwrap());
    }
    let mut over = TcpStream::connect(addr).await.unwrap();
    assert!(
        closed_within(&mut over, PATIENCE).await,
        "a fifth connection was kept"
    );
    // The held ones still work.
    let s = &mut held[0];
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(PATIENCE, s.read_to_end(&mut out))
        .await
        .expect("the held connection answered")
        .unwrap();
    assert!(
        out.starts_with(b"HTTP/1.1 503"),
        "{}",
        String::from_utf8_lossy(&out)
    );
    drop(held);
    // The server sees the closes a moment later; until then a connection may still be over.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let _ = s
            .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await;
        let mut out = Vec::new();
        let _ = tokio::time::timeout(PATIENCE, s.read_to_end(&mut out)).await;
        if out.starts_with(b"HTTP/1.1 503") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never served again after the held connections closed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
