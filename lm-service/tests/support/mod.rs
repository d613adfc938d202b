//! Real processes for the integration tests: the `lm-service` binary of this crate and the
//! `vision-service` binary, each on 127.0.0.1:0, found by the `listening grpc=... metrics=...`
//! line they print.
#![allow(dead_code)]
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;
use tonic::transport::Channel;
use vlm_proto::lm_client::LmClient;
use vlm_proto::{FinishReason, LmGenerateRequest, LmImage, SamplingParams};

pub use vlm_test_support::workspace_dir;

pub fn tiny_dir() -> PathBuf {
    vlm_test_support::tiny_dir()
}

pub fn lm_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_lm-service"))
}

/// `vision-service` next to our binary (there when the workspace was built or tested as a
/// whole), else built on demand. Cargo holds the target directory's lock while tests run, so the
/// on-demand build uses its own target directory (`target/lm-service-tests`) to avoid waiting on
/// the `cargo test` that runs us.
pub fn vision_bin() -> PathBuf {
    let bin_dir = lm_bin().parent().unwrap().to_path_buf();
    let beside = bin_dir.join("vision-service");
    if beside.exists() {
        return beside;
    }
    let nested = bin_dir.parent().unwrap().join("lm-service-tests");
    let path = nested.join("debug").join("vision-service");
    static BUILD: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_build = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args([
            "build",
            "-p",
            "vlm-vision-service",
            "--bin",
            "vision-service",
        ])
        .env("CARGO_TARGET_DIR", &nested)
        .current_dir(workspace_dir())
        .status()
        .expect("run cargo build -p vlm-vision-service");
    assert!(status.success(), "cargo build -p vlm-vision-service failed");
    assert!(
        path.exists(),
        "{} is missing after the build",
        path.display()
    );
    path
}

/// A child process killed on drop.
pub struct Proc {
    pub child: Child,
    pub grpc: String,
    pub metrics: String,
    _dir: Option<tempfile::TempDir>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// Text of GET /metrics.
    pub fn metrics_text(&self) -> String {
        let mut s = TcpStream::connect(&self.metrics).expect("connect metrics");
        write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    /// The value of the metric line that starts with `name` (labels included in `name`).
    pub fn metric(&self, name: &str) -> Option<f64> {
        self.metrics_text()
            .lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    }
}

fn spawn(bin: &Path, args: &[&str], dir: Option<tempfile::TempDir>) -> Proc {
    let mut child = Command::new(bin)
        .args(args)
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(rest) = line.strip_prefix("listening ") {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(rest.to_string());
                }
            }
            // Keep draining so the child never blocks on a full pipe.
        }
    });
    let line = match rx.recv_timeout(Duration::from_secs(300)) {
        Ok(l) => l,
        Err(_) => {
            let _ = child.kill();
            panic!("{} did not print its listening line", bin.display());
        }
    };
    let field = |k: &str| {
        line.split_whitespace()
            .find_map(|f| f.strip_prefix(k))
            .unwrap_or_else(|| panic!("no {k} in {line:?}"))
            .to_string()
    };
    Proc {
        grpc: field("grpc="),
        metrics: field("metrics="),
        child,
        _dir: dir,
    }
}

/// `lm-service` on the tiny checkpoint with `config` (a deployment config JSON), with no
/// vision replica.
pub fn start_lm(config: &serde_json::Value) -> Proc {
    start_lm_with(config, &[])
}

/// [`start_lm`] allowed to dial the vision replica `vision` (`--vision`).
pub fn start_lm_for(config: &serde_json::Value, vision: &str) -> Proc {
    start_lm_with(config, &["--vision", vision])
}

fn start_lm_with(config: &serde_json::Value, extra: &[&str]) -> Proc {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("deploy.json");
    std::fs::write(&cfg, config.to_string()).unwrap();
    let model = tiny_dir();
    spawn(
        &lm_bin(),
        &[
            "--model",
            model.to_str().unwrap(),
            "--config",
            cfg.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ]
        .into_iter()
        .chain(extra.iter().copied())
        .collect::<Vec<_>>(),
        Some(dir),
    )
}

/// `vision-service` on the tiny checkpoint.
pub fn start_vision() -> Proc {
    let model = tiny_dir();
    spawn(
        &vision_bin(),
        &[
            "--model",
            model.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        None,
    )
}

/// A client once the service reports SERVING.
pub async fn lm_client(p: &Proc) -> LmClient<Channel> {
    wait_serving(p).await;
    LmClient::connect(p.endpoint())
        .await
        .expect("connect lm")
        .max_decoding_message_size(64 << 20)
}

/// A text prompt of `n` tokens (ids below the special tokens of the tiny vocab).
pub fn text_prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| {
            (i.wrapping_mul(2654435761)
                .wrapping_add(seed.wrapping_mul(40503))
                >> 7)
                % 900
                + 5
        })
        .collect()
}

pub fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

pub fn request(
    ids: Vec<u32>,
    images: Vec<LmImage>,
    endpoint: &str,
    sampling: SamplingParams,
) -> LmGenerateRequest {
    LmGenerateRequest {
        request_id: "test".into(),
        input_ids: ids,
        images,
        vision_replica: endpoint.into(),
        sampling: Some(sampling),
    }
}

/// Runs a generation to the end: the tokens and the finish reason.
pub async fn generate(
    client: &mut LmClient<Channel>,
    req: LmGenerateRequest,
) -> Result<(Vec<u32>, FinishReason), tonic::Status> {
    let mut stream = client.generate(req).await?.into_inner();
    let mut tokens = Vec::new();
    let mut finish = FinishReason::Unspecified;
    while let Some(ev) = stream.message().await? {
        tokens.extend_from_slice(&ev.token_ids);
        if ev.finish_reason != 0 {
            finish = FinishReason::try_from(ev.finish_reason).unwrap();
        }
    }
    Ok((tokens, finish))
}

/// Waits until the process's gRPC health reports SERVING (overall status "").
pub async fn wait_serving(p: &Proc) {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let t0 = std::time::Instant::now();
    loop {
        if let Ok(ch) = tonic::transport::Endpoint::from_shared(p.endpoint())
            .unwrap()
            .connect()
            .await
        {
            let mut c = HealthClient::new(ch);
            if let Ok(r) = c
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await
            {
                if r.into_inner().status == ServingStatus::Serving as i32 {
                    return;
                }
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "{} never became SERVING",
            p.grpc
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The tiny checkpoint's LM backend as the engine loads it: `dtype` weights, 64 KV blocks of
/// `block_len` tokens, on core 0.
pub fn tiny_lm_backend(
    dtype: vlm_config::Dtype,
    block_len: usize,
) -> Box<dyn vlm_compute::LmBackend> {
    vlm_backends::load_lm(&vlm_backends::LmLoad {
        model_dir: &tiny_dir(),
        dtype,
        kv_cache_dtype: vlm_config::KvCacheDtype::Auto,
        kernels: &vlm_config::KernelConfig::default(),
        num_blocks: 64,
        block_len,
        devices: &[0],
    })
    .unwrap()
}

/// One image's embeddings from the oracle's exact ViT (tiny checkpoint, f32).
pub fn tiny_image_embeds() -> vlm_compute::ImageEmbeds {
    use vlm_backend_cpu::{CpuKernels, CpuOptions};
    let oracle = vlm_model::oracle::Oracle::load(
        &CpuKernels::new(CpuOptions::detect()),
        &tiny_dir(),
        vlm_model::DType::F32,
    )
    .unwrap();
    let bytes = std::fs::read(tiny_dir().join("synth_100x75/synthetic.png")).unwrap();
    let pv = vlm_preprocess::preprocess_bytes(&bytes, &Default::default()).unwrap();
    oracle.encode_images(&[pv]).unwrap().remove(0)
}
