//! End-to-end edges (issue 42) on the three real binaries and the tiny checkpoint: idle and
//! half-open HTTP connections are closed while requests are served, a queued stream gets its
//! status line at once, an over-limit gRPC message is RESOURCE_EXHAUSTED, and CORS is on when
//! configured.
// Each test has its own runtime on its own thread; the std mutex only serialises them.
#![allow(clippy::await_holding_lock)]
mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};
use support::*;

/// Generous: every bound below is a few seconds at most.
const PATIENCE: Duration = Duration::from_secs(30);

async fn wait_for_gauge(http: &str, name: &str, value: f64) {
    let t = Instant::now();
    loop {
        let got = scrape(http).sum(name);
        if got == Some(value) {
            return;
        }
        assert!(t.elapsed() < PATIENCE, "{name} is {got:?}, not {value}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn chat(stream: bool, max_tokens: u32) -> String {
    serde_json::json!({
        "messages": [{"role": "user", "content": "count to ten"}],
        "max_tokens": max_tokens, "temperature": 0, "stream": stream
    })
    .to_string()
}

/// Sends a POST and returns the connection with a read timeout of `wait`.
fn send(http: &str, path: &str, body: &str, wait: Duration) -> TcpStream {
    let mut s = TcpStream::connect(http).unwrap();
    s.set_read_timeout(Some(wait)).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {http}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

/// Reads the response head (up to the blank line); Err when it does not come in time.
fn read_head(s: &mut TcpStream) -> Result<String, String> {
    let mut got = Vec::new();
    let mut b = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        match s.read(&mut b) {
            Ok(1) => got.push(b[0]),
            Ok(_) => return Err(format!("closed: {:?}", String::from_utf8_lossy(&got))),
            Err(e) => return Err(format!("no head: {e}")),
        }
    }
    Ok(String::from_utf8_lossy(&got).to_string())
}

/// With the one slot (--max-in-flight 1) held by a request waiting for its first token (the LM
/// frozen), a streaming request gets its 200 and SSE headers at once; once the slot frees, it
/// streams its answer to [DONE].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_stream_gets_its_status_line_at_once() {
    let _g = serial();
    let c = Cluster::start(1, &["--max-in-flight", "1"]).await;
    let http = c.http();
    // Frozen briefly (far under the gateway's 2 s poll timeout, so the LM stays in rotation).
    let frozen = Frozen::new(c.lms[0].pid());
    let holder = {
        let http = http.clone();
        std::thread::spawn(move || {
            post_json(&http, &serde_json::from_str(&chat(false, 8)).unwrap())
        })
    };
    wait_for_gauge(&http, "vlm_gateway_in_flight", 1.0).await;
    let t = Instant::now();
    let mut s = send(
        &http,
        "/v1/chat/completions",
        &chat(true, 8),
        Duration::from_secs(5),
    );
    let head = read_head(&mut s);
    let waited = t.elapsed();
    let queued = scrape(&http).sum("vlm_gateway_queue_depth");
    drop(frozen);
    let head = head.expect("the queued stream's status line while the slot is held");
    eprintln!("status line of the queued stream after {waited:?}");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/event-stream"),
        "{head}"
    );
    assert_eq!(queued, Some(1.0), "the stream was answered while queued");
    // The slot frees: both finish.
    let (status, text) = holder.join().unwrap();
    assert_eq!(status, 200, "{text}");
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains("\"delta\""), "{rest}");
    assert!(!rest.contains("\"error\""), "{rest}");
    assert!(rest.contains("data: [DONE]"), "{rest}");
}

/// 2000 connections that send nothing and 500 that send half their headers: a generation is
/// still answered while they are open, and the gateway closes every one of them after its
/// header timeout (2 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_half_open_connections_are_closed_and_generation_goes_on() {
    let _g = serial();
    let files = vlm_test_support::raise_file_limit();
    let (idle_n, half_n) = if files >= 3000 {
        (2000, 500)
    } else {
        let n = files.saturating_sub(200) as usize;
        eprintln!(
            "open-file limit {files}: {} idle, {} half-open",
            n * 4 / 5,
            n / 5
        );
        (n * 4 / 5, n / 5)
    };
    let c = Cluster::start(
        1,
        &[
            "--http-header-read-timeout-ms",
            "2000",
            "--http-idle-timeout-ms",
            "2000",
            "--http-max-connections",
            "5000",
        ],
    )
    .await;
    let http = c.http();
    let mut held: Vec<TcpStream> = Vec::with_capacity(idle_n + half_n);
    for _ in 0..idle_n {
        held.push(TcpStream::connect(&http).unwrap());
    }
    for _ in 0..half_n {
        let mut s = TcpStream::connect(&http).unwrap();
        s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            .unwrap();
        held.push(s);
    }
    let t = Instant::now();
    let (status, text) = post_json(&http, &serde_json::from_str(&chat(false, 4)).unwrap());
    eprintln!(
        "a generation answered in {:?} with {} connections held",
        t.elapsed(),
        held.len()
    );
    assert_eq!(status, 200, "{text}");
    let t = Instant::now();
    let mut open = 0;
    for s in &mut held {
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        let mut buf = [0u8; 64];
        // EOF or a reset: closed by the gateway. A timeout: still open.
        if let Err(e) = s.read(&mut buf) {
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) {
                open += 1;
            }
        }
    }
    eprintln!("all {} closed {:?} later", held.len(), t.elapsed());
    assert_eq!(open, 0, "{open} connections still open");
    let m = scrape(&http);
    let closed = m
        .get(
            "vlm_gateway_http_connections_closed_total",
            "{reason=\"header_timeout\"}",
        )
        .unwrap_or(0.0);
    assert!(closed >= (idle_n + half_n) as f64, "{closed}");
}

/// A request message over the gateway's decoding limit (128 MiB with the default 32 MiB body
/// limit) is RESOURCE_EXHAUSTED; CORS answers a preflight when an origin is configured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_message_is_resource_exhausted_and_cors_is_on_when_asked() {
    let _g = serial();
    let c = Cluster::start(1, &["--cors-allow-origin", "https://app.example"]).await;
    let mut client = vlm_proto::v1::gateway_client::GatewayClient::new(channel(&c.grpc()).await)
        .max_encoding_message_size(usize::MAX);
    let big = grpc_request(&[vec![7u8; 129 << 20]], "what is it?", 4);
    let e = client.generate(big).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("too large"), "{e:?}");

    let (status, head, _) = http_full(
        &c.http(),
        "OPTIONS",
        "/v1/chat/completions",
        b"",
        "Origin: https://app.example\r\nAccess-Control-Request-Method: POST\r\n",
    );
    assert_eq!(status, 204, "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("access-control-allow-origin: https://app.example"),
        "{head}"
    );
    // Still generating.
    let (status, text) = post_json(&c.http(), &serde_json::from_str(&chat(false, 2)).unwrap());
    assert_eq!(status, 200, "{text}");
}
