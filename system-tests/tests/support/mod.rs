//! The end-to-end harness shared by the whole-system tests (`system-tests/tests/*`) that run the
//! real services: it finds (or builds) the `vlm`, `vision-service`, `lm-service` and `gateway`
//! binaries of the same target directory, makes the tiny random checkpoint once, spawns the
//! services on loopback port 0, waits for gRPC health SERVING, and talks to them (gRPC
//! Generate, a minimal HTTP/1.1 client, Prometheus text).
//!
//! Use it with `mod support;` from a test file; [`otlp`] is an in-process trace collector.
// Each test file uses a different part of it.
#![allow(dead_code)]

pub mod otlp;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};
use vlm_proto::v1 as pb;

/// Serialises the tests of one test binary (each starts its own processes).
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// A binary of the workspace (`vlm` or a service) in the target directory these tests run from
/// (a test binary lives in `<target>/<profile>/deps`); builds all four when one is missing.
pub fn bin(name: &str) -> PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    let dir = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    let path = |n: &str| dir.join(format!("{n}{}", std::env::consts::EXE_SUFFIX));
    BUILT.get_or_init(|| {
        if ["vlm", "vision-service", "lm-service", "gateway"]
            .iter()
            .all(|n| path(n).is_file())
        {
            return;
        }
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(workspace_root()).args([
            "build",
            "-p",
            "vlm-cli",
            "-p",
            "vlm-vision-service",
            "-p",
            "vlm-lm-service",
            "-p",
            "vlm-gateway",
        ]);
        if dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("running cargo build");
        assert!(status.success(), "cargo build of the binaries failed");
    });
    path(name)
}

/// The tiny random checkpoint (seed 0), made once per target directory. It is written to a
/// temporary directory and renamed into place, so test binaries running at once never see a
/// half-written checkpoint.
/// The tiny checkpoint's tokenizer and the in-process pipeline (f32, CPU kernels, 256-token
/// blocks): the oracle the services are compared with.
pub fn tiny_oracle() -> (
    vlm_tokenizer::ChatTokenizer,
    vlm_model::oracle::Oracle<vlm_backend_cpu::CpuKernels>,
) {
    let dir = tiny_model();
    let tok = vlm_tokenizer::ChatTokenizer::from_dir(&dir).unwrap();
    let kernels = vlm_backend_cpu::CpuKernels::new(vlm_backend_cpu::CpuOptions::detect());
    let pipeline = vlm_model::oracle::Oracle::load(&kernels, &dir, vlm_model::DType::F32)
        .unwrap()
        .with_block_len(256);
    (tok, pipeline)
}

pub fn tiny_model() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("e2e-tiny-s0");
        let done = dir.join(".complete");
        if !done.is_file() {
            let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"))
                .join(format!("e2e-tiny-s0.tmp-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&tmp);
            let opts = vlm_make_model::MakeOptions::new(vlm_make_model::Preset::Tiny);
            vlm_make_model::make_model(&tmp, &opts).expect("make the tiny checkpoint");
            std::fs::write(tmp.join(".complete"), b"").unwrap();
            if !done.is_file() {
                // A leftover without `.complete` is an interrupted older run.
                let _ = std::fs::remove_dir_all(&dir);
                if std::fs::rename(&tmp, &dir).is_err() {
                    assert!(
                        done.is_file(),
                        "could not move the tiny checkpoint into {}",
                        dir.display()
                    );
                }
            }
            let _ = std::fs::remove_dir_all(&tmp);
        }
        dir
    })
    .clone()
}

/// The harness's config (`LM_DEVICE` is filled in by [`write_config`]).
pub const CONFIG: &str = "\
visual:
  max_seq_len: [1024, 4096, 16384]
  num_devices: 1
  device: [0]
  oversize: reject
max_seq_len: 4096
kvcache_partition_len: 256
kvcache_num_blocks: 64
batch_size: 8
decoder_batch_sizes: [1, 2, 4, 8]
prefill_chunk_size: 128
num_devices: 1
device: [LM_DEVICE]
";

/// The nested config every service of the harness reads (vision on core 0, the LM on core 1
/// when there is one).
pub fn config_file() -> PathBuf {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| write_config("e2e-local.yaml", CONFIG))
        .clone()
}

/// Writes `yaml` to `name` in the target's temporary directory, with `LM_DEVICE` replaced by
/// core 1 when the machine has two cores (vision keeps core 0), else 0.
pub fn write_config(name: &str, yaml: &str) -> PathBuf {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let lm = if cores > 1 { "1" } else { "0" };
    let p = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::write(&p, yaml.replace("LM_DEVICE", lm)).unwrap();
    p
}

/// Starts one service alone (`vision-service` or `lm-service` at `bin`) on `model` with
/// `config`, and waits until it reports SERVING.
pub async fn start_service(name: &str, bin: &Path, model: &Path, config: &Path) -> Proc {
    let args: Vec<String> = [
        "--model",
        &model.display().to_string(),
        "--config",
        &config.display().to_string(),
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let p = Proc::spawn_env(name, bin, &args, &[]);
    wait_serving(&p.addr("grpc")).await;
    p
}

/// Runs `vlm ARGS` to completion and returns its output; panics with its stderr unless it
/// succeeded.
pub fn vlm_ok<I, S>(args: I) -> std::process::Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let out = Command::new(bin("vlm")).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `VmRSS` (resident set) of `pid` in bytes.
pub fn vm_rss(pid: u32) -> u64 {
    proc_status_bytes(pid, "VmRSS:")
}

/// `VmHWM` (peak resident set) of `pid` in bytes.
pub fn vm_hwm(pid: u32) -> u64 {
    proc_status_bytes(pid, "VmHWM:")
}

/// A `kB` line of `/proc/PID/status`, in bytes.
fn proc_status_bytes(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(key))
        .unwrap_or_else(|| panic!("{key} in /proc/{pid}/status"));
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

/// Variables the children never inherit from the test's environment (a developer's shell may
/// point them at a real collector); pass them in `env` to set them.
const SCRUBBED_ENV: &[&str] = &[
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SERVICE_NAME",
    "OTEL_TRACES_EXPORTER",
    "OTEL_RESOURCE_ATTRIBUTES",
];

/// A child process, killed when dropped.
pub struct Proc {
    pub name: String,
    pub child: Child,
    /// Fields of its `listening k=v ...` line.
    pub addrs: Vec<(String, String)>,
}

impl Proc {
    pub fn spawn(name: &str, bin: &Path, args: &[String]) -> Proc {
        Self::spawn_env(name, bin, args, &[])
    }

    /// Starts `bin` with `env` added (`RUST_LOG` defaults to the test's own, else `warn`) and
    /// waits for its `listening ...` line. Its other stdout lines go to stderr, tagged.
    pub fn spawn_env(name: &str, bin: &Path, args: &[String], env: &[(String, String)]) -> Proc {
        let mut cmd = Command::new(bin);
        cmd.args(args)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for k in SCRUBBED_ENV {
            cmd.env_remove(k);
        }
        cmd.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let tag = name.to_string();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("listening ") {
                    if let Some(t) = tx.take() {
                        let kv: Vec<(String, String)> = rest
                            .split_whitespace()
                            .filter_map(|f| {
                                f.split_once('=')
                                    .map(|(k, v)| (k.to_string(), v.to_string()))
                            })
                            .collect();
                        let _ = t.send(kv);
                        continue;
                    }
                }
                eprintln!("[{tag}] {line}");
            }
        });
        let addrs = match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(a) => a,
            Err(e) => {
                // Exited early (stdout closed), or still silent after 120 s.
                let mut exited = child.try_wait().ok().flatten();
                let until = Instant::now() + Duration::from_secs(5);
                while exited.is_none()
                    && e == std::sync::mpsc::RecvTimeoutError::Disconnected
                    && Instant::now() < until
                {
                    std::thread::sleep(Duration::from_millis(50));
                    exited = child.try_wait().ok().flatten();
                }
                let _ = child.kill();
                let _ = child.wait();
                match exited {
                    Some(st) => panic!("{name} exited ({st}) before printing its listening line; its stderr is above"),
                    None => panic!("{name} did not print its listening line within 120 s"),
                }
            }
        };
        Proc {
            name: name.to_string(),
            child,
            addrs,
        }
    }

    pub fn addr(&self, key: &str) -> String {
        self.addrs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("{}: no {key}=", self.name))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM (graceful drain; trace export is flushed on the way out).
    pub fn terminate(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: kill(2) on our own child's pid; it has not been reaped (try_wait above).
            unsafe {
                libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
            }
        }
    }

    /// Waits up to `timeout` for the process to exit: its exit status, or None (still running).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

pub async fn channel(addr: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// Polls `grpc.health.v1` (service "") until SERVING; panics after 180 s.
pub async fn wait_serving(addr: &str) {
    use tonic_health::pb::{
        health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest,
    };
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        if let Ok(ch) = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
        {
            if let Ok(r) = HealthClient::new(ch)
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await
            {
                if r.get_ref().status == ServingStatus::Serving as i32 {
                    return;
                }
            }
        }
        assert!(Instant::now() < deadline, "{addr} never became SERVING");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls the metrics server's `GET /readyz` until 200 (the probe a kubelet uses when the
/// gRPC port needs mutual TLS); panics after 180 s.
pub async fn wait_ready_http(metrics: &str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        if let Ok(mut s) = tokio::net::TcpStream::connect(metrics).await {
            let _ = s
                .write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await;
            let mut out = String::new();
            let _ = s.read_to_string(&mut out).await;
            if out.starts_with("HTTP/1.1 200") {
                return;
            }
        }
        assert!(Instant::now() < deadline, "{metrics}/readyz never 200");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until `p` is ready: its gRPC health, or `/readyz` when its gRPC port needs mutual
/// TLS (`tls`).
async fn wait_ready(p: &Proc, tls: bool) {
    if tls {
        wait_ready_http(&p.addr("metrics")).await
    } else {
        wait_serving(&p.addr("grpc")).await
    }
}

/// `--model`, `--config`, `--listen 127.0.0.1:0` (and `--metrics-listen 127.0.0.1:0`).
pub fn service_args(listen_metrics: bool) -> Vec<String> {
    service_args_with(&config_file(), listen_metrics)
}

/// [`service_args`] with another config file.
pub fn service_args_with(config: &Path, listen_metrics: bool) -> Vec<String> {
    let mut a = vec![
        "--model".to_string(),
        tiny_model().display().to_string(),
        "--config".into(),
        config.display().to_string(),
        "--listen".into(),
        "127.0.0.1:0".into(),
    ];
    if listen_metrics {
        a.extend(["--metrics-listen".into(), "127.0.0.1:0".into()]);
    }
    a
}

/// One vision service, `lms` LM replicas and a gateway in front of them.
/// `args` plus the LM's `--vision` naming `vision` (the only replica it may dial).
pub fn lm_args(args: &[String], vision: &Proc) -> Vec<String> {
    let mut a = args.to_vec();
    a.extend(["--vision".into(), vision.addr("grpc")]);
    a
}

pub struct Cluster {
    pub gateway: Proc,
    pub lms: Vec<Proc>,
    pub vision: Proc,
}

impl Cluster {
    pub async fn start(lms: usize, gateway_args: &[&str]) -> Cluster {
        Self::start_env(lms, gateway_args, &[]).await
    }

    /// Like [`Cluster::start`], with `env` set for all three kinds of process.
    pub async fn start_env(lms: usize, gateway_args: &[&str], env: &[(String, String)]) -> Cluster {
        Self::start_config(&config_file(), lms, gateway_args, env).await
    }

    /// Like [`Cluster::start_env`], every process reading `config` (see [`write_config`]).
    pub async fn start_config(
        config: &Path,
        lms: usize,
        gateway_args: &[&str],
        env: &[(String, String)],
    ) -> Cluster {
        let args = service_args_with(config, true);
        let vision = Proc::spawn_env("vision", &bin("vision-service"), &args, env);
        let lm_args = lm_args(&args, &vision);
        let lms: Vec<Proc> = (0..lms)
            .map(|i| Proc::spawn_env(&format!("lm{i}"), &bin("lm-service"), &lm_args, env))
            .collect();
        let tls = env.iter().any(|(k, _)| k == "VLM_INTERNAL_TLS_CERT");
        wait_ready(&vision, tls).await;
        for lm in &lms {
            wait_ready(lm, tls).await;
        }
        let gateway = Self::gateway_config(config, &vision, &lms, gateway_args, env).await;
        Cluster {
            gateway,
            lms,
            vision,
        }
    }

    /// One more gateway in front of the same replicas.
    pub async fn gateway(vision: &Proc, lms: &[Proc], extra: &[&str]) -> Proc {
        Self::gateway_env(vision, lms, extra, &[]).await
    }

    pub async fn gateway_env(
        vision: &Proc,
        lms: &[Proc],
        extra: &[&str],
        env: &[(String, String)],
    ) -> Proc {
        Self::gateway_config(&config_file(), vision, lms, extra, env).await
    }

    /// A gateway reading `config`, in front of `vision` and `lms`.
    pub async fn gateway_config(
        config: &Path,
        vision: &Proc,
        lms: &[Proc],
        extra: &[&str],
        env: &[(String, String)],
    ) -> Proc {
        let lm_list = lms
            .iter()
            .map(|l| l.addr("grpc"))
            .collect::<Vec<_>>()
            .join(",");
        let mut args = vec![
            "--model".to_string(),
            tiny_model().display().to_string(),
            "--config".into(),
            config.display().to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--http-listen".into(),
            "127.0.0.1:0".into(),
            "--vision".into(),
            vision.addr("grpc"),
            "--lm".into(),
            lm_list,
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let g = Proc::spawn_env("gateway", &bin("gateway"), &args, env);
        wait_serving(&g.addr("grpc")).await;
        g
    }

    pub fn grpc(&self) -> String {
        self.gateway.addr("grpc")
    }

    pub fn http(&self) -> String {
        self.gateway.addr("http")
    }

    /// SIGTERM to every process (gateway first), then waits up to `timeout` for each to exit.
    /// Returns the names of those that did not exit in time (they are killed on drop).
    pub fn terminate_all(&mut self, timeout: Duration) -> Vec<String> {
        self.gateway.terminate();
        for lm in &mut self.lms {
            lm.terminate();
        }
        self.vision.terminate();
        let deadline = Instant::now() + timeout;
        let mut stuck = Vec::new();
        for p in std::iter::once(&mut self.gateway)
            .chain(self.lms.iter_mut())
            .chain(std::iter::once(&mut self.vision))
        {
            let left = deadline.saturating_duration_since(Instant::now());
            match p.wait_exit(left) {
                Some(st) if !st.success() => eprintln!("{} exited with {st} after SIGTERM", p.name),
                Some(_) => {}
                None => stuck.push(p.name.clone()),
            }
        }
        stuck
    }
}

// ---------------------------------------------------------------- requests

/// A noisy RGB PNG of `w` x `h`.
pub fn png(w: u32, h: u32, seed: u8) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([
            (x as u8).wrapping_mul(3).wrapping_add(seed),
            (y as u8).wrapping_mul(5),
            seed.wrapping_mul(7) ^ (x ^ y) as u8,
        ])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

/// A one-colour image: large in pixels, small in bytes.
pub fn png_flat(w: u32, h: u32) -> Vec<u8> {
    let img = image::RgbImage::from_pixel(w, h, image::Rgb([90, 120, 200]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

/// One user message: the images, then `text`; greedy, at most `max_tokens`.
pub fn grpc_request(images: &[Vec<u8>], text: &str, max_tokens: u32) -> pb::GenerateRequest {
    use pb::content_part::Part;
    let mut content: Vec<pb::ContentPart> = images
        .iter()
        .map(|d| pb::ContentPart {
            part: Some(Part::Image(pb::ImagePart {
                data: d.clone(),
                mime_type: "image/png".into(),
                ..Default::default()
            })),
        })
        .collect();
    content.push(pb::ContentPart {
        part: Some(Part::Text(text.into())),
    });
    pb::GenerateRequest {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content,
        }],
        sampling: Some(pb::SamplingParams {
            max_tokens,
            temperature: 0.0,
            ..Default::default()
        }),
        model: String::new(),
    }
}

/// Collected output of one gRPC generation.
#[derive(Debug, Default)]
pub struct Output {
    pub text: String,
    pub tokens: Vec<u32>,
    pub finish: i32,
    pub usage: pb::Usage,
    /// One per token when the request asked for logprobs.
    pub logprobs: Vec<pb::TokenLogprob>,
}

/// Gateway.Generate, read to the end.
pub async fn generate(addr: &str, req: pb::GenerateRequest) -> Result<Output, tonic::Status> {
    let mut client = pb::gateway_client::GatewayClient::new(channel(addr).await)
        .max_decoding_message_size(64 << 20);
    let mut stream = client.generate(req).await?.into_inner();
    let mut out = Output::default();
    while let Some(m) = stream.message().await? {
        out.text.push_str(&m.text);
        out.tokens.extend(m.token_ids);
        out.logprobs.extend(m.logprobs);
        if m.finish_reason != 0 {
            out.finish = m.finish_reason;
            out.usage = m.usage.unwrap_or_default();
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------- HTTP

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

/// `GET /metrics` from `addr`, parsed.
pub fn scrape(addr: &str) -> Metrics {
    let (status, body) = http(addr, "GET", "/metrics", b"");
    assert_eq!(status, 200, "GET http://{addr}/metrics: {body}");
    Metrics::parse(&body)
}

/// Prometheus text exposition: sample name -> [(labels, value)].
#[derive(Debug, Default)]
pub struct Metrics {
    pub samples: BTreeMap<String, Vec<(String, f64)>>,
    pub text: String,
}

impl Metrics {
    pub fn parse(text: &str) -> Metrics {
        let mut samples: BTreeMap<String, Vec<(String, f64)>> = BTreeMap::new();
        for line in text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
        {
            let (series, value) = match line.rsplit_once(' ') {
                Some(x) => x,
                None => continue,
            };
            let (name, labels) = match series.find('{') {
                Some(i) => (&series[..i], &series[i..]),
                None => (series, ""),
            };
            let value = match value {
                "+Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                v => v.parse().unwrap_or(f64::NAN),
            };
            samples
                .entry(name.to_string())
                .or_default()
                .push((labels.to_string(), value));
        }
        Metrics {
            samples,
            text: text.to_string(),
        }
    }

    /// The sample's values summed over its label sets; None when the name is absent.
    pub fn sum(&self, name: &str) -> Option<f64> {
        self.samples
            .get(name)
            .map(|v| v.iter().map(|(_, x)| x).sum())
    }

    /// The value of the sample `name` with exactly `labels` (`{k="v"}`, as exposed).
    pub fn get(&self, name: &str, labels: &str) -> Option<f64> {
        self.samples
            .get(name)?
            .iter()
            .find(|(l, _)| l == labels)
            .map(|(_, v)| *v)
    }

    /// The label sets a sample name has.
    pub fn labels(&self, name: &str) -> Vec<String> {
        self.samples
            .get(name)
            .map(|v| v.iter().map(|(l, _)| l.clone()).collect())
            .unwrap_or_default()
    }
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

/// A process stopped (SIGSTOP) until this is dropped (SIGCONT).
pub struct Frozen(libc::pid_t);

impl Frozen {
    pub fn new(pid: u32) -> Frozen {
        // SAFETY: kill(2) on a child process of this test.
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) }, 0);
        Frozen(pid as libc::pid_t)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        // SAFETY: as in `new`.
        unsafe { libc::kill(self.0, libc::SIGCONT) };
    }
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
