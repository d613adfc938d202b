//! End-to-end: `vlm up` starts the three services, `vlm generate` talks to them, and SIGTERM
//! to `vlm up` drains everything.
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn up_then_generate_then_drain() {
    // VLM_E2E_VLM overrides which `vlm` runs (e.g. an installed one).
    let vlm =
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
        });
    let vlm = vlm.as_str();
    let cache = tempfile::tempdir().unwrap();
    let mut up = Command::new(vlm)
        .args([
            "up",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .env("XDG_CACHE_HOME", cache.path())
        .env("RUST_LOG", "warn")
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
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
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
