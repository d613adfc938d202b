//! Test support: a tiny checkpoint, the real `vision-service` binary on 127.0.0.1:0, a gRPC
//! client over the socket, images, and the in-process oracle.
#![allow(dead_code)]
use image::RgbImage;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tonic::transport::Channel;
use vlm_compute::{HostDtype, VisionBackend};
use vlm_preprocess::{self as preprocess, PreprocessConfig};
use vlm_proto::v1 as pb;
use vlm_proto::v1::vision_client::VisionClient;

/// The tiny random checkpoint, written once per test process.
pub fn checkpoint() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = vlm_make_model::MakeOptions::new(vlm_make_model::Preset::Tiny);
        vlm_make_model::make_model(dir.path(), &opts).expect("tiny checkpoint");
        dir
    })
    .path()
}

/// A running `vision-service` process; killed on drop.
pub struct TestServer {
    pub child: Child,
    pub grpc: SocketAddr,
    pub metrics: SocketAddr,
    /// Everything the process printed on stdout so far.
    pub stdout: Arc<Mutex<Vec<String>>>,
    _config_dir: tempfile::TempDir,
}

pub fn write_config(dir: &Path, config_json: &str) -> PathBuf {
    let path = dir.join("deploy.json");
    std::fs::write(&path, config_json).expect("write config");
    path
}

pub fn command(config: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vision-service"));
    cmd.arg("--model")
        .arg(checkpoint())
        .arg("--config")
        .arg(config)
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .args(extra)
        .env("RUST_LOG", "info")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    cmd
}

impl TestServer {
    /// Starts the binary with `config_json` as its deployment config and waits for the
    /// `listening` line, then for SERVING on grpc.health.v1.
    pub async fn start(config_json: &str, extra: &[&str]) -> TestServer {
        let config_dir = tempfile::tempdir().expect("tempdir");
        let config = write_config(config_dir.path(), config_json);
        let mut child = command(&config, extra)
            .spawn()
            .expect("spawn vision-service");
        let stdout = child.stdout.take().expect("stdout");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = Arc::clone(&lines);
        // Keep draining stdout for the life of the process so logging never blocks it.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("listening ") {
                    let _ = tx.send(rest.to_string());
                }
                sink.lock().unwrap().push(line);
            }
        });
        let rest = rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| {
                let _ = child.kill();
                panic!("no `listening` line; stdout: {:?}", lines.lock().unwrap())
            });
        let addr = |key: &str| -> SocketAddr {
            rest.split_whitespace()
                .find_map(|kv| kv.strip_prefix(key))
                .and_then(|a| a.parse().ok())
                .unwrap_or_else(|| panic!("no {key} in `listening {rest}`"))
        };
        let server = TestServer {
            grpc: addr("grpc="),
            metrics: addr("metrics="),
            child,
            stdout: lines,
            _config_dir: config_dir,
        };
        server.wait_serving().await;
        server
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.grpc))
            .unwrap()
            .connect()
            .await
            .expect("connect")
    }

    pub async fn client(&self) -> VisionClient<Channel> {
        VisionClient::new(self.channel().await).max_decoding_message_size(8 << 20)
    }

    pub async fn health(&self, service: &str) -> Option<i32> {
        let mut h = tonic_health::pb::health_client::HealthClient::new(self.channel().await);
        h.check(tonic_health::pb::HealthCheckRequest {
            service: service.into(),
        })
        .await
        .ok()
        .map(|r| r.into_inner().status)
    }

    pub async fn wait_serving(&self) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(ch) = Channel::from_shared(format!("http://{}", self.grpc))
                .unwrap()
                .connect()
                .await
            {
                let mut h = tonic_health::pb::health_client::HealthClient::new(ch);
                let req = tonic_health::pb::HealthCheckRequest {
                    service: "vlm.v1.Vision".into(),
                };
                if let Ok(r) = h.check(req).await {
                    if r.into_inner().status
                        == tonic_health::pb::health_check_response::ServingStatus::Serving as i32
                    {
                        return;
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "vision-service never reported SERVING"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn info(&self) -> pb::VisionInfo {
        self.client()
            .await
            .info(pb::VisionInfoRequest {})
            .await
            .expect("info")
            .into_inner()
    }

    /// GET /metrics over a plain socket.
    pub fn metrics_text(&self) -> String {
        let mut s = std::net::TcpStream::connect(self.metrics).expect("metrics connect");
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let ok = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(ok.success());
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A deterministic, detailed test picture (so that every patch differs).
pub fn picture(w: u32, h: u32, seed: u32) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        let v = x
            .wrapping_mul(2654435761)
            .wrapping_add(y.wrapping_mul(40503))
            .wrapping_add(seed.wrapping_mul(97));
        image::Rgb([
            (x * 255 / w.max(1)) as u8,
            (y * 255 / h.max(1)) as u8,
            (v >> 13) as u8,
        ])
    })
}

pub fn png_bytes(img: &RgbImage) -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

pub fn png(w: u32, h: u32, seed: u32) -> Vec<u8> {
    png_bytes(&picture(w, h, seed))
}

pub fn encoded(data: Vec<u8>) -> pb::ImageInput {
    pb::ImageInput {
        source: Some(pb::image_input::Source::Encoded(pb::EncodedImage {
            data,
            mime_type: String::new(),
        })),
        content_hash: vec![],
        expected_grid: None,
        ..Default::default()
    }
}

pub fn request(images: Vec<pb::ImageInput>) -> pb::EncodeRequest {
    pb::EncodeRequest {
        request_id: "test".into(),
        images,
        dtype: 0,
    }
}

/// Reads a whole Encode stream.
pub async fn collect(
    client: &mut VisionClient<Channel>,
    req: pb::EncodeRequest,
) -> Result<Vec<pb::EmbeddingChunk>, tonic::Status> {
    let mut stream = client.encode(req).await?.into_inner();
    let mut chunks = Vec::new();
    while let Some(c) = stream.message().await? {
        chunks.push(c);
    }
    Ok(chunks)
}

/// One image's outputs reassembled from its chunks (checking the row ranges as it goes).
#[derive(Debug, Clone, PartialEq)]
pub struct Reassembled {
    pub grid: [u32; 3],
    pub bucket: u32,
    pub total_rows: u32,
    pub hidden: u32,
    pub dtype: i32,
    pub embeds: Vec<u8>,
    pub deepstack: Vec<Vec<u8>>,
    pub chunks: usize,
    pub content_hash: Vec<u8>,
}

pub fn reassemble(chunks: &[pb::EmbeddingChunk], image: u32) -> Reassembled {
    let mine: Vec<&pb::EmbeddingChunk> = chunks.iter().filter(|c| c.image_index == image).collect();
    assert!(!mine.is_empty(), "no chunk for image {image}");
    let first = mine[0];
    let g = first.grid.expect("grid");
    let mut out = Reassembled {
        grid: [g.t, g.h, g.w],
        bucket: first.bucket,
        total_rows: first.total_rows,
        hidden: first.hidden_size,
        dtype: first.dtype,
        embeds: vec![],
        deepstack: vec![vec![]; first.deepstack.len()],
        chunks: mine.len(),
        content_hash: first.content_hash.clone(),
    };
    let mut next = 0;
    for c in mine {
        assert_eq!(
            c.row_start, next,
            "chunks of image {image} out of order or with a gap"
        );
        assert!(c.row_end > c.row_start);
        assert_eq!(
            (c.total_rows, c.hidden_size, c.bucket, c.dtype),
            (out.total_rows, out.hidden, out.bucket, out.dtype)
        );
        assert_eq!(
            c.deepstack.len(),
            out.deepstack.len(),
            "every chunk carries every level"
        );
        out.embeds.extend_from_slice(&c.embeds);
        for (acc, d) in out.deepstack.iter_mut().zip(&c.deepstack) {
            acc.extend_from_slice(d);
        }
        next = c.row_end;
    }
    assert_eq!(
        next, out.total_rows,
        "image {image}: rows missing at the end"
    );
    out
}

/// The model computed in this process, on one thread, on the backend the service picks for the
/// same config.
pub struct Oracle {
    backend: Box<dyn VisionBackend>,
    pool: rayon::ThreadPool,
}

impl Oracle {
    pub fn new(buckets: &[usize]) -> Oracle {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let kernels = vlm_config::KernelConfig::default();
        let backend = pool.install(|| {
            vlm_backends::load_vision(&vlm_backends::VisionLoad {
                model_dir: checkpoint(),
                dtype: vlm_config::Dtype::F32,
                kernels: &kernels,
                buckets,
                devices: &[0],
            })
            .expect("load the vision backend")
            .remove(0)
        });
        Oracle { backend, pool }
    }

    /// (bucket, grid, raw embeds, raw deepstack levels) for an encoded image, in `dtype`.
    pub fn encode_bytes(
        &self,
        bytes: &[u8],
        dtype: HostDtype,
    ) -> (usize, [usize; 3], Vec<u8>, Vec<Vec<u8>>) {
        let cfg = PreprocessConfig::default();
        let img = preprocess::decode_image(bytes, cfg.max_decode_pixels).expect("decode");
        self.pool.install(|| {
            let pv = preprocess::preprocess_rgb(&img, &cfg).expect("preprocess");
            let run = self.backend.encode(&pv).expect("encode");
            let ds = run
                .embeds
                .deepstack
                .iter()
                .map(|d| d.to_le_bytes(dtype))
                .collect();
            (
                run.bucket,
                run.embeds.grid_thw,
                run.embeds.embeds.to_le_bytes(dtype),
                ds,
            )
        })
    }
}

/// A PNG whose IHDR claims `w` x `h` (valid CRC) over a tiny real image: a decompression bomb
/// as far as the header goes.
pub fn png_claiming(w: u32, h: u32) -> Vec<u8> {
    let mut bytes = png(8, 8, 1);
    // Signature (8) + IHDR length (4) + "IHDR" (4) -> width at 16, height at 20, CRC at 29.
    assert_eq!(&bytes[12..16], b"IHDR");
    bytes[16..20].copy_from_slice(&w.to_be_bytes());
    bytes[20..24].copy_from_slice(&h.to_be_bytes());
    let crc = vlm_test_support::png::crc32(&bytes[12..29]);
    bytes[29..33].copy_from_slice(&crc.to_be_bytes());
    bytes
}

/// The config used by most tests: small buckets, the tiny model's defaults otherwise.
pub const SMALL_BUCKETS: &str = r#"{"visual": {"max_seq_len": [256, 1024, 4096]}}"#;
