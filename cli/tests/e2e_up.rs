//! End-to-end: `vlm up` starts the three services, `vlm generate` talks to them, and SIGTERM
//! to `vlm up` drains everything.
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The `vlm` under test: $VLM_E2E_VLM (e.g. an installed one), else the workspace's.
fn vlm_bin() -> String {
    std::env::var("VLM_E2E_VLM").unwrap_or_else(|_| match option_env!("CARGO_BIN_EXE_vlm") {
        Some(p) => p.to_string(),
        None => {
            let deps = std::env::current_exe().unwrap();
            deps.parent()
                .unwrap()
                .parent()
                .unwrap()
                .join("vlm")
                .display()
                .to_string()
        }
    })
}

/// `vlm up` on free ports, caching in `cache`, logging warnings only.
fn vlm_up(vlm: &str, cache: &std::path::Path) -> Command {
    let mut c = Command::new(vlm);
    c.args([
        "up",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
    ])
    .env("XDG_CACHE_HOME", cache)
    .env("RUST_LOG", "warn");
    c
}

/// Panics with the command's stderr unless it exited 0.
fn assert_succeeded(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn up_then_generate_then_drain() {
    let vlm = vlm_bin();
    let vlm = vlm.as_str();
    let cache = tempfile::tempdir().unwrap();
    let mut up = vlm_up(vlm, cache.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(up.stdout.take().unwrap()).lines();
    let mut grpc = String::new();
    let mut http = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("gateway ") {
            for f in rest.split_whitespace() {
                if let Some(v) = f.strip_prefix("grpc=") {
                    grpc = v.to_string();
                }
                if let Some(v) = f.strip_prefix("http=") {
                    http = v.to_string();
                }
            }
        }
        if line.starts_with("ready") {
            break;
        }
    }
    assert!(
        !grpc.is_empty() && !http.is_empty(),
        "vlm up did not print the gateway addresses"
    );
    std::thread::spawn(move || for _ in lines {});

    let out = Command::new(vlm)
        .args([
            "generate",
            "--gateway",
            &grpc,
            "--max-tokens",
            "4",
            "--show-tokens",
            "Hello",
        ])
        .output()
        .unwrap();
    assert_succeeded(&out);
    assert!(String::from_utf8_lossy(&out.stdout).contains("tokens: ["));

    unsafe {
        libc::kill(up.id() as libc::pid_t, libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = up.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "vlm up did not drain within 60 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "{status}");
    assert!(
        std::net::TcpStream::connect(&grpc).is_err(),
        "the gateway still listens after the drain"
    );
}

/// A part that dies while loading (here: its weights are cut short, which it finds only after
/// it is listening) ends `vlm up` with that part's name and exit status, instead of a wait for
/// the whole ready timeout that then blames health ("not SERVING within ..."; the timeout here
/// is 120 s, so that wait would fail this test with that message).
#[test]
fn a_part_that_dies_while_loading_is_named_at_once() {
    let vlm = vlm_bin();
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    let made = Command::new(&vlm)
        .args(["make-model", "--preset", "tiny", "--out"])
        .arg(&model)
        .output()
        .unwrap();
    assert_succeeded(&made);
    let weights = model.join("model.safetensors");
    let len = std::fs::metadata(&weights).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&weights)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let out = vlm_up(&vlm, dir.path())
        .args(["--ready-timeout-s", "120", "--model"])
        .arg(&model)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    // Both parts read the same weights; whichever fails first is named.
    assert!(
        ["vision", "lm"].iter().any(|p| err.contains(&format!(
            "error: {p} exited with exit status: 1 while loading"
        ))),
        "{err}"
    );
}
