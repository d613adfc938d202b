//! A minimal HTTP/1.1 client and SSE reading, blocking or failing within a bound.
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// The JSON chunks of a streamed answer, checking that it ends with `data: [DONE]`.
pub fn sse_chunks(body: &str) -> Vec<serde_json::Value> {
    let events: Vec<&str> = body.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.last().copied(), Some("data: [DONE]"), "{body}");
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
        .collect()
}

/// The text the chunks' deltas add up to.
pub fn sse_text(chunks: &[serde_json::Value]) -> String {
    chunks
        .iter()
        .filter_map(|v| v["choices"][0]["delta"]["content"].as_str())
        .collect()
}

/// POST /v1/chat/completions with a JSON body: (status, body).
pub fn post_json(addr: &str, v: &serde_json::Value) -> (u16, String) {
    http(
        addr,
        "POST",
        "/v1/chat/completions",
        v.to_string().as_bytes(),
    )
}

/// A minimal HTTP/1.1 client: (status, body), chunked bodies decoded.
pub fn http(addr: &str, method: &str, path: &str, body: &[u8]) -> (u16, String) {
    http_with(addr, method, path, body, "")
}

pub fn http_with(
    addr: &str,
    method: &str,
    path: &str,
    body: &[u8],
    extra_headers: &str,
) -> (u16, String) {
    let (status, _, body) = http_full(addr, method, path, body, extra_headers);
    (status, body)
}

/// [`http_with`] with the response head (status line and headers) too: (status, head, body).
pub fn http_full(
    addr: &str,
    method: &str,
    path: &str,
    body: &[u8],
    extra_headers: &str,
) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra_headers}Connection: close\r\n\r\n",
        body.len()
    )
    .unwrap();
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("HTTP header end");
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut body = raw[split + 4..].to_vec();
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    if is_chunked(&head) {
        body = dechunk(&body);
    }
    (status, head, String::from_utf8(body).unwrap())
}

fn is_chunked(head: &str) -> bool {
    head.to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
}

/// A chunked HTTP/1.1 body's payload (up to the last whole chunk).
fn dechunk(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = body;
    while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
        let size =
            usize::from_str_radix(String::from_utf8_lossy(&rest[..eol]).trim(), 16).unwrap_or(0);
        if size == 0 || rest.len() < eol + 2 + size {
            break;
        }
        out.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
        rest = &rest[(eol + 4 + size).min(rest.len())..];
    }
    out
}

/// One HTTP/1.1 request that reports failure instead of panicking (connection refused or
/// reset, a read past `timeout`): Ok((status, body)) when a response head arrived.
pub fn try_http(
    addr: &str,
    method: &str,
    path: &str,
    body: &[u8],
    timeout: Duration,
) -> Result<(u16, String), String> {
    let sock: std::net::SocketAddr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let mut s = TcpStream::connect_timeout(&sock, Duration::from_secs(5))
        .map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .map_err(|e| format!("write: {e}"))?;
    s.write_all(body).map_err(|e| format!("write: {e}"))?;
    let mut raw = Vec::new();
    if let Err(e) = s.read_to_end(&mut raw) {
        if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut {
            return Err(format!("no answer within {timeout:?}"));
        }
        if raw.is_empty() {
            return Err(format!("read: {e}"));
        }
    }
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| {
            format!(
                "the connection closed after {} bytes, before the head",
                raw.len()
            )
        })?;
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line: {head}"))?;
    let mut body = raw[split + 4..].to_vec();
    if is_chunked(&head) {
        body = dechunk(&body);
    }
    Ok((status, String::from_utf8_lossy(&body).to_string()))
}

/// POSTs `body` to /v1/chat/completions on a fresh connection whose reads time out after
/// `bound`; read the answer with [`read_until`] and [`read_end`].
pub fn post_open(http: &str, body: &str, bound: Duration) -> TcpStream {
    let mut s = TcpStream::connect(http).unwrap_or_else(|e| panic!("connect {http}: {e}"));
    s.set_read_timeout(Some(bound)).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {http}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

/// Reads until `got` holds `needle`; Err when a read times out or the connection closes first.
pub fn read_until(s: &mut TcpStream, got: &mut String, needle: &str) -> Result<(), String> {
    let bound = s.read_timeout().ok().flatten();
    let mut buf = [0u8; 4096];
    while !got.contains(needle) {
        match s.read(&mut buf) {
            Ok(0) => return Err(format!("closed before {needle:?}: {got}")),
            Ok(n) => got.push_str(&String::from_utf8_lossy(&buf[..n])),
            Err(e) => return Err(format!("no {needle:?} within {bound:?} ({e}): {got}")),
        }
    }
    Ok(())
}

/// Reads to the end of the response (the server closes: `Connection: close`): (the rest, time
/// since `since`); Err when a read times out first, i.e. the request was never ended.
pub fn read_end(mut s: TcpStream, since: Instant) -> Result<(String, Duration), String> {
    let mut got = Vec::new();
    match s.read_to_end(&mut got) {
        Ok(_) => Ok((String::from_utf8_lossy(&got).into_owned(), since.elapsed())),
        Err(e) => Err(format!(
            "not ended {:?} after the event it was timed from ({e}); got so far: {}",
            since.elapsed(),
            String::from_utf8_lossy(&got)
        )),
    }
}
