//! Issue 42 item 10 on the three real binaries: an LM that stops answering without closing
//! its sockets (SIGSTOP: a hung process, a frozen VM or a partition as it looks from outside)
//! must not hold the requests in flight to it forever. The gateway's HTTP/2 keepalive pings go
//! unanswered, the connection is closed, and each request ends with a clear error; after
//! SIGCONT the system serves again.
//!
//! And the other side of it: a connection that died while the LM did not (a stall, a middlebox
//! that dropped the flow) must not fail the next request when there is no other replica.
// The test has its own runtime on its own thread; the std mutex only serialises the tests.
#![allow(clippy::await_holding_lock)]
mod support;

use std::time::{Duration, Instant};
use support::*;

/// Pings every 500 ms, given up after 1 s unanswered: a frozen LM is noticed within ~1.5 s.
/// Set as environment variables (on all three services), which a binary without the flags
/// ignores, so the test runs (and fails by hanging) against one that has no client keepalive.
const KEEPALIVE: [(&str, &str); 2] = [
    ("VLM_GRPC_KEEPALIVE_INTERVAL_MS", "500"),
    ("VLM_GRPC_KEEPALIVE_TIMEOUT_MS", "1000"),
];

fn keepalive_env() -> Vec<(String, String)> {
    KEEPALIVE
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Each in-flight request must end within this of the freeze: generous against the ~1.5 s the
/// keepalive takes, and far short of the "forever" of issue 42.
const BOUND: Duration = Duration::from_secs(30);

fn chat(stream: bool) -> String {
    serde_json::json!({
        "messages": [{"role": "user", "content": "keep going"}],
        "max_tokens": 3500, "temperature": 0, "ignore_eos": true, "stream": stream
    })
    .to_string()
}

/// A stream past its first token and a plain request sent just after the freeze both end with
/// an error (an SSE error event then [DONE]; a 503), not by waiting forever; after SIGCONT the
/// LM serves again and holds no sequence of the two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_in_flight_to_a_frozen_lm_end_and_it_serves_again() {
    let _g = serial();
    let env = keepalive_env();
    let c = Cluster::start_env(1, &[], &env).await;
    let http = c.http();

    // Mid-generation: the stream's first token is out.
    let mut stream = post_open(&http, &chat(true), BOUND);
    let mut head = String::new();
    read_until(&mut stream, &mut head, "\"content\"").expect("the stream's first token");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let frozen = Frozen::new(c.lms[0].pid());
    let froze = Instant::now();
    // Sent just after: the gateway's health poll (2 s timeout) has not noticed yet, so it goes
    // to the frozen LM and waits for its first token there.
    let plain = post_open(&http, &chat(false), BOUND);
    let stream = std::thread::spawn(move || read_end(stream, froze));
    let plain = std::thread::spawn(move || read_end(plain, froze));
    let stream = stream.join().unwrap();
    let plain = plain.join().unwrap();

    let (rest, after) = stream.expect("the stream in flight was ended");
    eprintln!("the stream ended {after:?} after the freeze");
    let error = rest.find("\"error\"").unwrap_or_else(|| panic!("{rest}"));
    let done = rest
        .find("data: [DONE]")
        .unwrap_or_else(|| panic!("{rest}"));
    assert!(error < done, "the error event comes before [DONE]: {rest}");
    assert!(
        rest.contains("after the first token"),
        "the error says the LM was lost after the first token: {rest}"
    );
    let (answer, after) = plain.expect("the plain request in flight was ended");
    eprintln!("the plain request ended {after:?} after the freeze: {answer}");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("\"error\""), "{answer}");

    // SIGCONT: back in rotation once a health poll finds it SERVING.
    drop(frozen);
    let small = serde_json::json!({
        "messages": [{"role": "user", "content": "hello again"}], "max_tokens": 4
    });
    let t = Instant::now();
    loop {
        let (status, text) = post_json(&http, &small);
        if status == 200 {
            break;
        }
        assert!(
            t.elapsed() < BOUND,
            "not served again after SIGCONT: {status} {text}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The two abandoned sequences were dropped by the LM (their connection is gone).
    let mut lm = vlm_proto::v1::lm_client::LmClient::new(channel(&c.lms[0].addr("grpc")).await);
    let t = Instant::now();
    loop {
        let l = lm
            .load(vlm_proto::v1::LoadRequest {})
            .await
            .unwrap()
            .into_inner();
        if l.running == 0 && l.waiting == 0 && l.free_kv_blocks == l.total_kv_blocks {
            break;
        }
        assert!(t.elapsed() < BOUND, "the LM still holds sequences: {l:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The one LM is fine but the gateway's pooled connection to it is dead (a relay in front of
/// it stops passing the bytes of the connections open, as after a stall or a dropped flow):
/// the request sent then fails on that connection, below gRPC, when the keepalive gives up;
/// the gateway dials the same replica again and serves it, without taking it out of rotation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_connection_to_the_only_lm_is_redialled_before_the_first_token() {
    let _g = serial();
    let env = keepalive_env();
    let c = Cluster::start_env(1, &[], &env).await;
    let relay = Relay::start(
        &tokio::runtime::Handle::current(),
        "127.0.0.1:0",
        c.lms[0].addr("grpc"),
    );
    let gateway = Cluster::gateway_at(
        &config_file(),
        &c.vision.addr("grpc"),
        std::slice::from_ref(&relay.addr),
        &[],
        &env,
    )
    .await;
    let http = gateway.addr("http");
    let small = serde_json::json!({
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4
    });
    let (status, text) = post_json(&http, &small);
    assert_eq!(status, 200, "{text}");

    relay.cut_open_connections();
    let t = Instant::now();
    let (status, text) = tokio::task::spawn_blocking({
        let http = http.clone();
        move || post_json(&http, &small)
    })
    .await
    .unwrap();
    eprintln!("served {:?} after the cut: {status}", t.elapsed());
    assert_eq!(
        status, 200,
        "the request after the cut is served on a new connection: {text}"
    );
    let m = scrape(&http);
    assert_eq!(
        m.sum("vlm_gateway_lm_redials_total"),
        Some(1.0),
        "{}",
        m.text
    );
}
