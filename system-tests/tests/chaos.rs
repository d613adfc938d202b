//! Chaos: `vlm up` serves a bounded stream of mixed requests while each part is killed with
//! SIGKILL in turn and supervised back. Every request ends, before its deadline, with a result
//! or a clear error (no internal address in it); once the load stops, the LM's KV blocks and
//! slots and the gateway's queue are idle again and the surviving parts' memory is back near
//! where it was.
// Each test has its own runtime on its own thread; the std mutex only serialises them.
#![allow(clippy::await_holding_lock)]
mod support;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::*;
use vlm_proto::v1 as pb;

/// The client-side deadline of one request: nothing may take longer.
const DEADLINE: Duration = Duration::from_secs(60);
/// The deadline each gRPC request carries (`grpc-timeout`).
const GRPC_TIMEOUT: Duration = Duration::from_secs(30);
const MIB: u64 = 1 << 20;

/// `vlm up` and what it printed: each part's gRPC address and pid (updated on restarts).
struct Up {
    child: Child,
    parts: Arc<Mutex<HashMap<String, (String, u32)>>>,
    http: String,
}

impl Up {
    fn start() -> Up {
        let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("chaos-cache");
        // The tiny checkpoint the other tests made, where `vlm up` caches it.
        let model = tiny_model();
        let mut child = Command::new(bin("vlm"))
            .args([
                "up",
                "--model",
                &model.display().to_string(),
                "--listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
            ])
            .env("XDG_CACHE_HOME", &cache)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let parts: Arc<Mutex<HashMap<String, (String, u32)>>> = Arc::default();
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let out = child.stdout.take().unwrap();
        let p = parts.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                eprintln!("[vlm up] {line}");
                let mut words = line.split_whitespace();
                let first = words.next().unwrap_or("");
                let name = if first == "restarted" {
                    words.next().unwrap_or("")
                } else {
                    first
                };
                let field = |k: &str| {
                    line.split_whitespace()
                        .find_map(|f| f.strip_prefix(k))
                        .map(str::to_string)
                };
                if let (Some(grpc), Some(pid)) = (field("grpc="), field("pid=")) {
                    let pid = pid.parse().unwrap();
                    p.lock().unwrap().insert(name.to_string(), (grpc, pid));
                }
                if let Some(h) = field("http=") {
                    let _ = tx.send(h);
                }
            }
        });
        let http = rx
            .recv_timeout(Duration::from_secs(300))
            .expect("vlm up printed the gateway's addresses");
        let up = Up { child, parts, http };
        for name in ["vision", "lm", "gateway"] {
            assert!(up.part(name).is_some(), "vlm up printed no {name} line");
        }
        up
    }

    fn part(&self, name: &str) -> Option<(String, u32)> {
        self.parts.lock().unwrap().get(name).cloned()
    }
    fn grpc(&self, name: &str) -> String {
        self.part(name).unwrap().0
    }
    fn pid(&self, name: &str) -> u32 {
        self.part(name).unwrap().1
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        // Killed outright, `vlm up` still takes its children along (they get SIGTERM).
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    TextHttp,
    StreamHttp,
    InvalidHttp,
    TextGrpc,
    ImageGrpc,
}
const KINDS: [Kind; 5] = [
    Kind::TextHttp,
    Kind::StreamHttp,
    Kind::InvalidHttp,
    Kind::TextGrpc,
    Kind::ImageGrpc,
];

/// How one request ended.
#[derive(Debug, Clone)]
enum Outcome {
    Ok,
    /// A refusal or failure the caller can act on: HTTP status / gRPC code and message.
    Error(String, String),
    /// The gateway itself was unreachable or went away (only while it is the victim).
    Transport(String),
    /// Past [`DEADLINE`]: a hang.
    Hung,
}

async fn one(kind: Kind, grpc: &str, http: &str, seed: u8) -> Outcome {
    let chat = |stream: bool, role: &str| {
        serde_json::json!({"max_tokens": 6, "stream": stream,
            "messages": [{"role": role, "content": "tell me a story"}]})
        .to_string()
    };
    let http_call = |body: String| {
        let http = http.to_string();
        tokio::task::spawn_blocking(move || {
            try_http(
                &http,
                "POST",
                "/v1/chat/completions",
                body.as_bytes(),
                DEADLINE,
            )
        })
    };
    let grpc_call = |req: pb::GenerateRequest| {
        let grpc = grpc.to_string();
        async move {
            let ch = match tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
                .unwrap()
                .connect_timeout(Duration::from_secs(5))
                .connect()
                .await
            {
                Ok(c) => c,
                Err(e) => return Outcome::Transport(e.to_string()),
            };
            let mut client = pb::gateway_client::GatewayClient::new(ch);
            let mut r = tonic::Request::new(req);
            r.set_timeout(GRPC_TIMEOUT);
            let mut stream = match client.generate(r).await {
                Ok(s) => s.into_inner(),
                Err(s) => return status_outcome(s),
            };
            let mut tokens = 0;
            loop {
                match stream.message().await {
                    Ok(Some(m)) => tokens += m.token_ids.len(),
                    Ok(None) if tokens > 0 => return Outcome::Ok,
                    Ok(None) => return Outcome::Error("grpc".into(), "no tokens".into()),
                    Err(s) => return status_outcome(s),
                }
            }
        }
    };
    let fut = async {
        match kind {
            Kind::TextHttp | Kind::StreamHttp | Kind::InvalidHttp => {
                let body = match kind {
                    Kind::TextHttp => chat(false, "user"),
                    Kind::StreamHttp => chat(true, "user"),
                    _ => chat(false, "wizard"),
                };
                match http_call(body).await.unwrap() {
                    Ok((200, body)) if kind == Kind::StreamHttp => {
                        // An error after the first token arrives as an error event.
                        if body.contains("\"error\"") {
                            Outcome::Error("sse".into(), body)
                        } else if body.ends_with("data: [DONE]\n\n") {
                            Outcome::Ok
                        } else {
                            Outcome::Transport(format!("stream cut: {body:?}"))
                        }
                    }
                    Ok((200, _)) => Outcome::Ok,
                    Ok((status, body)) => Outcome::Error(status.to_string(), body),
                    Err(e) => Outcome::Transport(e),
                }
            }
            Kind::TextGrpc => grpc_call(grpc_request(&[], "tell me a story", 6)).await,
            Kind::ImageGrpc => {
                grpc_call(grpc_request(&[png(32, 32, seed)], "what is it?", 6)).await
            }
        }
    };
    tokio::time::timeout(DEADLINE, fut)
        .await
        .unwrap_or(Outcome::Hung)
}

fn status_outcome(s: tonic::Status) -> Outcome {
    // tonic reports a connection the gateway dropped as UNKNOWN / UNAVAILABLE with a
    // transport message, or as CANCELLED with hyper's "operation was canceled" when the
    // socket closes mid-call; the gateway's own statuses carry its messages.
    if [
        "transport error",
        "h2 protocol error",
        "operation was canceled",
    ]
    .iter()
    .any(|t| s.message().contains(t))
    {
        return Outcome::Transport(s.message().to_string());
    }
    Outcome::Error(format!("{:?}", s.code()), s.message().to_string())
}

/// Three clients cycling through every kind until `stop`.
fn load(
    grpc: String,
    http: String,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<(Kind, Outcome)>> {
    tokio::spawn(async move {
        let workers: Vec<_> = (0..3u8)
            .map(|w| {
                let (grpc, http, stop) = (grpc.clone(), http.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut out = Vec::new();
                    let mut i = w as usize;
                    while !stop.load(Ordering::Relaxed) {
                        let kind = KINDS[i % KINDS.len()];
                        let seed = (i as u8).wrapping_mul(7).wrapping_add(w);
                        let o = one(kind, &grpc, &http, seed).await;
                        // A client backs off a little on a failure, as it would in production.
                        if !matches!(o, Outcome::Ok) {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        out.push((kind, o));
                        i += 1;
                    }
                    out
                })
            })
            .collect();
        let mut all = Vec::new();
        for w in workers {
            all.extend(w.await.unwrap());
        }
        all
    })
}

async fn lm_load(addr: &str) -> Option<pb::LoadReport> {
    let mut c = pb::lm_client::LmClient::new(channel(addr).await);
    c.load(pb::LoadRequest {})
        .await
        .ok()
        .map(|r| r.into_inner())
}

/// Waits until a text and an image request both succeed again.
async fn until_served(up: &Up, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut seed = 200u8;
    loop {
        let text = one(Kind::TextGrpc, &up.grpc("gateway"), &up.http, 0).await;
        seed = seed.wrapping_add(1);
        let image = one(Kind::ImageGrpc, &up.grpc("gateway"), &up.http, seed).await;
        if matches!((&text, &image), (Outcome::Ok, Outcome::Ok)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "not served again 90 s after {what}: {text:?} {image:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_each_part_in_turn_loses_no_request_and_leaks_nothing() {
    let _g = serial();
    let up = Up::start();
    until_served(&up, "start").await;
    let idle = lm_load(&up.grpc("lm")).await.unwrap();
    let mut table = Vec::new();
    for victim in ["vision", "lm", "gateway"] {
        let survivors: Vec<(&str, u32, u64)> = ["vision", "lm", "gateway"]
            .into_iter()
            .filter(|p| *p != victim)
            .map(|p| (p, up.pid(p), vm_rss(up.pid(p))))
            .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let running = load(up.grpc("gateway"), up.http.clone(), stop.clone());
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let old = up.pid(victim);
        unsafe {
            libc::kill(old as libc::pid_t, libc::SIGKILL);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while up.pid(victim) == old {
            assert!(
                Instant::now() < deadline,
                "{victim} was not restarted within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        until_served(&up, &format!("killing {victim}")).await;
        tokio::time::sleep(Duration::from_millis(1000)).await;
        stop.store(true, Ordering::Relaxed);
        let outcomes = running.await.unwrap();

        // Every request ended in time, with a result or a clear error.
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for (kind, o) in &outcomes {
            match o {
                Outcome::Hung => {
                    panic!("a {kind:?} request hung past {DEADLINE:?} ({victim} killed)")
                }
                Outcome::Ok => {
                    assert_ne!(*kind, Kind::InvalidHttp, "an invalid request was served");
                    *counts.entry("ok").or_default() += 1;
                }
                Outcome::Transport(e) => {
                    assert_eq!(victim, "gateway", "{kind:?}: {e} while the gateway was up");
                    *counts.entry("gateway gone").or_default() += 1;
                }
                Outcome::Error(code, msg) => {
                    assert!(
                        !msg.contains("127.0.0.1"),
                        "{kind:?} {code}: an internal address reached the client: {msg}"
                    );
                    let expected = match kind {
                        Kind::InvalidHttp => code == "400",
                        _ => ["503", "504", "Unavailable", "DeadlineExceeded", "sse"]
                            .contains(&code.as_str()),
                    };
                    assert!(expected, "{kind:?} got {code}: {msg}");
                    let label = if *kind == Kind::InvalidHttp {
                        "refused (invalid)"
                    } else {
                        "unavailable"
                    };
                    *counts.entry(label).or_default() += 1;
                }
            }
        }
        assert!(
            counts.get("ok").copied().unwrap_or(0) > 0,
            "{victim}: nothing served"
        );

        // Idle again: no sequence, queue entry or KV block left behind.
        let lm = up.grpc("lm");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let l = lm_load(&lm).await.unwrap_or_default();
            let g = scrape(&up.http);
            let gauge = |n: &str| g.sum(n).unwrap_or(-1.0);
            let idle_now = l.running == 0
                && l.waiting == 0
                && l.tokens_in_flight == 0
                && l.free_kv_blocks == idle.total_kv_blocks
                && gauge("vlm_gateway_in_flight") == 0.0
                && gauge("vlm_gateway_queue_depth") == 0.0;
            if idle_now {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "not idle 30 s after the load stopped ({victim} killed): {l:?}, gateway in flight \
                 {}, queued {}",
                gauge("vlm_gateway_in_flight"),
                gauge("vlm_gateway_queue_depth")
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // The parts that were not killed are back near their memory.
        let mut mem = Vec::new();
        for (name, pid, before) in &survivors {
            assert_eq!(
                up.pid(name),
                *pid,
                "{name} restarted though only {victim} was killed"
            );
            let after = vm_rss(*pid);
            assert!(
                after < before + 64 * MIB,
                "{name} grew from {} to {} MiB while {victim} was killed",
                before / MIB,
                after / MIB
            );
            mem.push(format!("{name} {}->{} MiB", before / MIB, after / MIB));
        }
        table.push(format!(
            "| kill -9 {victim} | {} requests | {counts:?} | {} |",
            outcomes.len(),
            mem.join(", ")
        ));
    }
    eprintln!("chaos results:\n{}", table.join("\n"));

    // `vlm up` itself killed outright: its children go with it (they get SIGTERM and drain).
    let mut up = up;
    let pids: Vec<u32> = ["vision", "lm", "gateway"].map(|p| up.pid(p)).to_vec();
    up.child.kill().unwrap();
    up.child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(40);
    let alive = |pid: &u32| std::path::Path::new(&format!("/proc/{pid}")).exists() && !zombie(*pid);
    while pids.iter().any(alive) {
        assert!(
            Instant::now() < deadline,
            "children of a killed vlm up still run: {pids:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether `pid` has exited and waits to be reaped.
fn zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(true)
}
