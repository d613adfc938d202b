//! End-to-end: `vlm up` starts the three services, `vlm generate` talks to them, and SIGTERM
//! to `vlm up` drains everything.
mod support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `vlm` under test: $VLM_E2E_VLM (e.g. an installed one), else the workspace's.
fn vlm_bin() -> String {
    std::env::var("VLM_E2E_VLM").unwrap_or_else(|_| support::bin("vlm").display().to_string())
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

/// A running `vlm up`, ended on drop (SIGTERM: it drains its children) so that a failing test
/// leaves no services behind.
struct Up(Child);

impl Drop for Up {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            unsafe {
                libc::kill(self.0.id() as libc::pid_t, libc::SIGTERM);
            }
            let _ = self.0.wait();
        }
    }
}

/// `vlm up` started with `args`, up to its "ready" line: (the process, gRPC, HTTP address).
fn start_up(vlm: &str, cache: &std::path::Path, args: &[&str]) -> (Up, String, String) {
    let mut up = vlm_up(vlm, cache)
        .args(args)
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
    (Up(up), grpc, http)
}

/// SIGTERM to `vlm up`: it drains and exits 0 within 60 s, and the gateway stops listening.
fn drain(mut up: Up, grpc: &str) {
    unsafe {
        libc::kill(up.0.id() as libc::pid_t, libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = up.0.try_wait().unwrap() {
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
        std::net::TcpStream::connect(grpc).is_err(),
        "the gateway still listens after the drain"
    );
}

#[test]
fn up_then_generate_then_drain() {
    let vlm = vlm_bin();
    let vlm = vlm.as_str();
    let cache = tempfile::tempdir().unwrap();
    let (up, grpc, _) = start_up(vlm, cache.path(), &[]);

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
    drain(up, &grpc);
}

/// `--max-model-len` sets the context of `vlm up`'s embedded config: a prompt that fits is
/// served, one past it is a 400 naming the limit.
#[test]
fn max_model_len_sets_the_context() {
    let vlm = vlm_bin();
    let cache = tempfile::tempdir().unwrap();
    let (up, grpc, http) = start_up(&vlm, cache.path(), &["--max-model-len", "1024"]);
    let ask = |n: usize| {
        let body = serde_json::json!({"prompt": vec![100; n], "max_tokens": 4, "temperature": 0});
        support::http(
            &http,
            "POST",
            "/v1/completions",
            body.to_string().as_bytes(),
        )
    };
    let (status, body) = ask(1000);
    assert_eq!(status, 200, "{body}");
    let (status, body) = ask(1100);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("1024"), "{body}");
    drain(up, &grpc);
}

/// 64 concurrent requests, each with its own 512x512 image, on `vlm up` with no config: every
/// one is answered (the vision queue holds 16 images; the rest wait their turn instead of
/// being refused), and the usage each reports is its own.
#[test]
fn sixty_four_concurrent_image_requests_all_complete() {
    use base64::Engine;
    let vlm = vlm_bin();
    let cache = tempfile::tempdir().unwrap();
    let (up, grpc, http) = start_up(&vlm, cache.path(), &[]);
    let answers: Vec<(u16, String)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..64u8)
            .map(|i| {
                let http = http.clone();
                s.spawn(move || {
                    let png = support::png(512, 512, i);
                    let b64 = base64::engine::general_purpose::STANDARD.encode(png);
                    let body = serde_json::json!({
                        "messages": [{"role": "user", "content": [
                            {"type": "image_url",
                             "image_url": {"url": format!("data:image/png;base64,{b64}")}},
                            {"type": "text", "text": format!("Describe image {i}.")}]}],
                        "max_tokens": 4, "temperature": 0,
                    });
                    support::post_json(&http, &body)
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    for (i, (status, body)) in answers.iter().enumerate() {
        assert_eq!(*status, 200, "request {i}: {body}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 4, "request {i}: {body}");
    }
    drain(up, &grpc);
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

/// A text request and a 64x64 image request through the OpenAI API at `http`: each a 200
/// with its 4 tokens.
fn answers_text_and_image(http: &str) {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(support::png(64, 64, 1));
    for content in [
        serde_json::json!("Hello there"),
        serde_json::json!([
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{b64}")}},
            {"type": "text", "text": "Describe it."}]),
    ] {
        let body = serde_json::json!({
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, "temperature": 0, "ignore_eos": true,
        });
        let (status, body) = support::post_json(http, &body);
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 4, "{body}");
    }
}

/// A GGUF pair written by `vlm quantize` (Q8_0 LM, f16 mmproj) is planned by `vlm plan` at
/// its stored size and served by `vlm up --model LM.gguf --mmproj V.gguf`: a text and an
/// image request are answered; without --mmproj the start is refused, naming the flag.
#[test]
fn a_gguf_pair_serves_text_and_images() {
    let vlm = vlm_bin();
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("tiny");
    let lm = dir.path().join("tiny-q8_0.gguf");
    let mmproj = dir.path().join("mmproj-tiny-q8_0.gguf");
    let ok = |args: &[&str]| assert_succeeded(&Command::new(&vlm).args(args).output().unwrap());
    ok(&[
        "make-model",
        "--preset",
        "tiny",
        "--out",
        ckpt.to_str().unwrap(),
    ]);
    ok(&[
        "quantize",
        "--scheme",
        "q8_0",
        ckpt.to_str().unwrap(),
        lm.to_str().unwrap(),
    ]);
    assert!(mmproj.is_file());

    // `vlm plan` sizes the pair by what its files store: the LM's bytes as the derived config
    // states them (a tied model: no table added), not the checkpoint's f32.
    let plan = |model: &[&str]| {
        let out = Command::new(&vlm)
            .args(["plan", "--device-kind", "cpu", "--json", "--config"])
            .arg(support::config_file())
            .args(model)
            .output()
            .unwrap();
        assert_succeeded(&out);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (v, String::from_utf8_lossy(&out.stderr).to_string())
    };
    let (f32_plan, _) = plan(&["--model", ckpt.to_str().unwrap()]);
    let (gguf_plan, said) = plan(&[
        "--model",
        lm.to_str().unwrap(),
        "--mmproj",
        mmproj.to_str().unwrap(),
    ]);
    let derived = said
        .split("derived checkpoint files in ")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .unwrap_or_else(|| panic!("no derived directory in {said}"));
    let config: serde_json::Value = serde_json::from_slice(
        &std::fs::read(std::path::Path::new(derived).join("config.json")).unwrap(),
    )
    .unwrap();
    let stored = &config["quantization_config"]["lm_weight_bytes"];
    assert_eq!(gguf_plan["lm"]["weights"], *stored, "{gguf_plan}");
    assert!(
        stored.as_u64().unwrap() < f32_plan["lm"]["weights"].as_u64().unwrap(),
        "{stored} vs {}",
        f32_plan["lm"]["weights"]
    );

    let refused = vlm_up(&vlm, dir.path())
        .args(["--model", lm.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("--mmproj"), "{err}");

    let (up, grpc, http) = start_up(
        &vlm,
        dir.path(),
        &[
            "--model",
            lm.to_str().unwrap(),
            "--mmproj",
            mmproj.to_str().unwrap(),
        ],
    );
    answers_text_and_image(&http);
    drain(up, &grpc);
}

/// The quantized directories `vlm quantize` writes (what vLLM serves: W8A8 int8 per channel,
/// W4A16 4-bit per group and FP8 per block, groups and blocks of 32 here, the tiny model's
/// widths being 64 and 128) are planned with their decoder linears at their stored bytes (each
/// below the f32 checkpoint, 4-bit below int8) and served by `vlm up --model DIR`: a text and an
/// image request are answered (the FP8 directory over an FP8 KV cache, `--kv-cache-dtype fp8`).
#[test]
fn quantized_directories_are_planned_and_served() {
    let vlm = vlm_bin();
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("tiny");
    let ok = |args: &[&str]| assert_succeeded(&Command::new(&vlm).args(args).output().unwrap());
    let ckpt_s = ckpt.to_str().unwrap();
    ok(&["make-model", "--preset", "tiny", "--out", ckpt_s]);
    let lm_weights = |model: &str| {
        let out = Command::new(&vlm)
            .args(["plan", "--device-kind", "cpu", "--json", "--config"])
            .arg(support::config_file())
            .args(["--model", model])
            .output()
            .unwrap();
        assert_succeeded(&out);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["lm"]["weights"].as_u64().unwrap()
    };
    let mut planned = vec![("f32", lm_weights(ckpt_s))];
    let group = &["--group-size", "32"][..];
    for (scheme, extra) in [("w8a8", &[][..]), ("w4a16", group), ("fp8-block", group)] {
        let q = dir.path().join(format!("tiny-{scheme}"));
        let q_s = q.to_str().unwrap();
        let mut args = vec!["quantize", "--scheme", scheme];
        args.extend_from_slice(extra);
        args.extend([ckpt_s, q_s]);
        ok(&args);
        planned.push((scheme, lm_weights(q_s)));
        // FP8 weights run over an FP8 KV cache too (`kv_cache_dtype: fp8_e4m3`).
        let kv: &[&str] = match scheme {
            "fp8-block" => &["--kv-cache-dtype", "fp8"],
            _ => &[],
        };
        let (up, grpc, http) = start_up(&vlm, dir.path(), &[&["--model", q_s], kv].concat());
        answers_text_and_image(&http);
        drain(up, &grpc);
    }
    let bytes = |name: &str| planned.iter().find(|p| p.0 == name).unwrap().1;
    assert!(
        planned[1..].iter().all(|p| p.1 < bytes("f32")) && bytes("w4a16") < bytes("w8a8"),
        "LM weights planned: {planned:?}"
    );
}

/// The services take a GGUF pair themselves, as a Kubernetes deployment gives them the files
/// people download: vision, LM and gateway each started with `--model LM.gguf --mmproj
/// V.gguf` serve a text and an image request, under the LM file's name as the model id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::await_holding_lock)] // the guard serializes the tests' processes
async fn the_services_take_a_gguf_pair() {
    use base64::Engine;
    let _g = support::serial();
    let vlm = vlm_bin();
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("tiny");
    let lm = dir.path().join("tiny-q4_k_m.gguf");
    let mmproj = dir.path().join("mmproj-tiny-q4_k_m.gguf");
    for args in [
        vec![
            "make-model",
            "--preset",
            "tiny",
            "--out",
            ckpt.to_str().unwrap(),
        ],
        vec![
            "quantize",
            "--scheme",
            "q4_k_m",
            ckpt.to_str().unwrap(),
            lm.to_str().unwrap(),
        ],
    ] {
        assert_succeeded(&Command::new(&vlm).args(&args).output().unwrap());
    }
    let args = |extra: &[&str]| {
        let mut a: Vec<String> = vec![
            "--model".into(),
            lm.display().to_string(),
            "--mmproj".into(),
            mmproj.display().to_string(),
            "--config".into(),
            support::config_file().display().to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let vision = support::Proc::spawn(
        "vision",
        &support::bin("vision-service"),
        &args(&["--metrics-listen", "127.0.0.1:0"]),
    );
    support::wait_serving(&vision.addr("grpc")).await;
    let lm_proc = support::Proc::spawn(
        "lm0",
        &support::bin("lm-service"),
        &args(&[
            "--metrics-listen",
            "127.0.0.1:0",
            "--vision",
            &vision.addr("grpc"),
        ]),
    );
    support::wait_serving(&lm_proc.addr("grpc")).await;
    let gateway = support::Proc::spawn(
        "gateway",
        &support::bin("gateway"),
        &args(&[
            "--http-listen",
            "127.0.0.1:0",
            "--vision",
            &vision.addr("grpc"),
            "--lm",
            &lm_proc.addr("grpc"),
        ]),
    );
    support::wait_serving(&gateway.addr("grpc")).await;
    let http = gateway.addr("http");
    let (status, models) = support::http(&http, "GET", "/v1/models", b"");
    assert_eq!(status, 200, "{models}");
    assert!(models.contains("\"id\":\"tiny-q4_k_m\""), "{models}");
    let b64 = base64::engine::general_purpose::STANDARD.encode(support::png(64, 64, 1));
    for content in [
        serde_json::json!("Hello there"),
        serde_json::json!([
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{b64}")}},
            {"type": "text", "text": "Describe it."}]),
    ] {
        let body = serde_json::json!({
            "model": "tiny-q4_k_m",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, "temperature": 0, "ignore_eos": true,
        });
        let (status, body) = support::post_json(&http, &body);
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 4, "{body}");
    }
    // A GGUF LM without its vision file is refused at start, naming the flag.
    let out = Command::new(support::bin("lm-service"))
        .args(["--model", lm.to_str().unwrap(), "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("give its vision file with --mmproj"), "{err}");
}
