//! What the three-service split costs: time to first token (TTFT) and output tokens/s through
//! gateway -> lm-service -> vision-service, against the same model in-process
//! (`vlm_model::oracle::Oracle` on the CPU backend's kernels, the ViT on the vision backend), at 1 and 8 concurrent requests with one 512x512 image
//! each. Runs on the tiny random checkpoint, and on `VLM_BENCH_MODEL` when set.
//!
//! `cargo bench -p vlm-gateway --bench split_overhead` (env: VLM_BENCH_TOKENS, default 32;
//! VLM_BENCH_ROUNDS, default 3; VLM_BENCH_BIN_DIR, where the service binaries are;
//! VLM_BENCH_DTYPE, f32 (default) or bf16 for both parts; VLM_BENCH_SHARED_CORES=1 gives both
//! services every core, as the in-process run has — on a 2-core machine the disjoint split
//! leaves each service one core, which measures the core split, not the service split; the
//! in-process ViT then runs each image on one thread, as a vision-service device does).
//! Reported: the fixed milliseconds per request the split adds (TTFT split - TTFT in-process
//! at concurrency 1), and both decode throughputs: in-process, the batch decode of all the
//! requests after their prefills; split, the tokens/s while every request is decoding (from the
//! last first token to the first finished request: the images are all encoded by then, so both
//! sides run the same decode steps on the same cores). Ask for enough tokens that the requests
//! overlap (at 8 concurrent 2B requests, VLM_BENCH_TOKENS=512).
use candle_core::DType;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use vlm_backend_cpu::{CpuKernels, CpuOptions};
use vlm_compute::VisionBackend;
use vlm_model::oracle::{GreedyRequest, Oracle};
use vlm_preprocess::{preprocess_bytes, PreprocessConfig};
use vlm_proto::v1 as pb;
use vlm_tokenizer::{ChatMessage, ChatPart, ChatTokenizer};

fn env_usize(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn png(seed: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(512, 512, |x, y| {
        let v = x.wrapping_mul(31) ^ y.wrapping_mul(17) ^ seed.wrapping_mul(2654435761);
        image::Rgb([v as u8, (v >> 8) as u8, (v >> 16) as u8])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

const PROMPT: &str = "Describe the image in detail.";

#[derive(Debug, Clone, Copy, Default)]
struct Stat {
    /// Mean time to first token, ms.
    ttft_ms: f64,
    /// Output tokens per second over all requests together while all of them decode (split:
    /// [`steady_rate`]; in-process: the batch decode after every prefill).
    tok_s: f64,
}

// ------------------------------------------------------------------ in-process

/// The same model in this process: the pipeline (LM), and the ViT on the bucket engine.
struct Local {
    p: Oracle<CpuKernels>,
    tok: ChatTokenizer,
    graphs: Box<dyn VisionBackend>,
    vit_pool: Option<rayon::ThreadPool>,
}

impl Local {
    fn load(dir: &Path) -> Local {
        let p = Oracle::load(&CpuKernels::new(CpuOptions::detect()), dir, bench_dtype())
            .expect("load the oracle");
        let tok = ChatTokenizer::from_dir(dir).unwrap();
        // With VLM_BENCH_SHARED_CORES the vision service runs each image on one compute thread
        // (one core, its device): the in-process ViT gets the same, so the difference is the
        // split.
        let vit_pool = shared_cores().then(|| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap()
        });
        // The ViT in-process runs the same backend as the vision service (the oracle's own
        // `encode_images` is the unbucketed forward).
        let kernels = vlm_config::KernelConfig::default();
        let load = || {
            vlm_backends::load_vision(&vlm_backends::VisionLoad {
                model_dir: dir,
                dtype: if bench_dtype() == DType::BF16 {
                    vlm_config::Dtype::Bf16
                } else {
                    vlm_config::Dtype::F32
                },
                kernels: &kernels,
                buckets: &[1024, 4096, 16384],
                devices: &[0],
            })
        };
        let graphs = match &vit_pool {
            Some(pool) => pool.install(load),
            None => load(),
        }
        .unwrap()
        .remove(0);
        Local {
            p,
            tok,
            graphs,
            vit_pool,
        }
    }

    /// `conc` requests (images seeded from `seed`) encoded, prefilled, then decoded together.
    fn round(&self, conc: usize, tokens: usize, seed: usize) -> Stat {
        let t0 = Instant::now();
        let pre = PreprocessConfig::default();
        let mut reqs = Vec::new();
        for i in 0..conc {
            let pix = preprocess_bytes(&png((seed + i) as u32), &pre).unwrap();
            let run = match &self.vit_pool {
                Some(pool) => pool.install(|| self.graphs.encode(&pix)),
                None => self.graphs.encode(&pix),
            }
            .unwrap();
            let emb = vec![run.embeds];
            let msg = ChatMessage::user(vec![ChatPart::Image, ChatPart::Text(PROMPT.into())]);
            let ids = self.tok.encode_prompt(&[msg], &[emb[0].tokens()]).unwrap();
            reqs.push(GreedyRequest {
                input_ids: ids,
                images: emb,
            });
        }
        // TTFT: encoding + the prefills (all first tokens ready).
        for q in &reqs {
            self.p.prefill(&q.input_ids, &q.images).unwrap();
        }
        let ttft = t0.elapsed().as_secs_f64();
        // The batch call prefills again, then decodes: its decode part is the time of the full
        // call less that of the same call stopped at the first token.
        let batch = conc.next_power_of_two();
        let t1 = Instant::now();
        self.p.generate_greedy_batch(&reqs, batch, 1, &[]).unwrap();
        let first_only = t1.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let out = self
            .p
            .generate_greedy_batch(&reqs, batch, tokens, &[])
            .unwrap();
        let decode = (t1.elapsed().as_secs_f64() - first_only).max(1e-9);
        let n: usize = out.iter().map(|o| o.tokens.len().saturating_sub(1)).sum();
        Stat {
            ttft_ms: ttft * 1e3,
            tok_s: n as f64 / decode,
        }
    }
}

fn mean(v: &[Stat]) -> Stat {
    let n = v.len().max(1) as f64;
    Stat {
        ttft_ms: v.iter().map(|s| s.ttft_ms).sum::<f64>() / n,
        tok_s: v.iter().map(|s| s.tok_s).sum::<f64>() / n,
    }
}

// ------------------------------------------------------------------ split

struct Proc(Child, String);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn bin_dir() -> PathBuf {
    if let Ok(d) = std::env::var("VLM_BENCH_BIN_DIR") {
        return PathBuf::from(d);
    }
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
    let have = |d: &Path| {
        ["gateway", "lm-service", "vision-service"]
            .iter()
            .all(|b| d.join(b).is_file())
    };
    if have(&profile_dir) {
        return profile_dir;
    }
    let debug = profile_dir.parent().unwrap().join("debug");
    if have(&debug) {
        return debug;
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let st = Command::new(cargo)
        .current_dir(root)
        .args([
            "build",
            "--release",
            "-p",
            "vlm-vision-service",
            "-p",
            "vlm-lm-service",
            "-p",
            "vlm-gateway",
        ])
        .status()
        .unwrap();
    assert!(st.success());
    profile_dir
}

fn spawn(bin: &Path, args: &[String]) -> Proc {
    let mut child = Command::new(bin)
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    let out = child.stdout.take().unwrap();
    let mut lines = BufReader::new(out).lines();
    let addr = loop {
        let l = lines.next().expect("listening line").unwrap();
        if let Some(rest) = l.strip_prefix("listening grpc=") {
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    Proc(child, addr)
}

async fn wait_serving(addr: &str) {
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    for _ in 0..6000 {
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
                if r.get_ref().status == 1 {
                    return;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{addr} never SERVING");
}

/// $VLM_BENCH_SHARED_CORES=1: both services on every core.
fn shared_cores() -> bool {
    std::env::var("VLM_BENCH_SHARED_CORES").is_ok_and(|s| s == "1")
}

/// $VLM_BENCH_DTYPE: the weight dtype of both parts.
fn bench_dtype() -> DType {
    match std::env::var("VLM_BENCH_DTYPE").as_deref() {
        Ok("bf16") => DType::BF16,
        _ => DType::F32,
    }
}

fn write_config(dir: &Path) -> PathBuf {
    let n = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1) as u32;
    let v = (n / 2).max(1);
    let shared = shared_cores();
    let all: Vec<String> = (0..n).map(|i| i.to_string()).collect();
    let vis: Vec<String> = if shared {
        all.clone()
    } else {
        (0..v).map(|i| i.to_string()).collect()
    };
    let lm: Vec<String> = if shared {
        all
    } else if n > 1 {
        (v..n).map(|i| i.to_string()).collect()
    } else {
        vec!["0".into()]
    };
    let dtype = if bench_dtype() == DType::BF16 {
        "bf16"
    } else {
        "f32"
    };
    let text = format!(
        "dtype: {dtype}\nvisual:\n  dtype: {dtype}\n  max_seq_len: [1024, 4096, 16384]\n  num_devices: {}\n  device: [{}]\nmax_seq_len: 4096\n\
         kvcache_partition_len: 256\nkvcache_num_blocks: 64\nbatch_size: 8\ndecoder_batch_sizes: [1, 2, 4, 8]\n\
         prefill_chunk_size: 128\nnum_devices: {}\ndevice: [{}]\n",
        vis.len(),
        vis.join(", "),
        lm.len(),
        lm.join(", ")
    );
    let p = dir.join("bench-config.yaml");
    std::fs::write(&p, text).unwrap();
    p
}

/// One streamed request: (time to first token in s, every token message as (arrival, tokens)).
async fn one_request(addr: String, image: Vec<u8>, tokens: u32) -> (f64, Vec<(Instant, usize)>) {
    use pb::content_part::Part;
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = pb::gateway_client::GatewayClient::new(ch);
    let req = pb::GenerateRequest {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: vec![
                pb::ContentPart {
                    part: Some(Part::Image(pb::ImagePart {
                        data: image,
                        mime_type: String::new(),
                        ..Default::default()
                    })),
                },
                pb::ContentPart {
                    part: Some(Part::Text(PROMPT.into())),
                },
            ],
        }],
        sampling: Some(pb::SamplingParams {
            max_tokens: tokens,
            ignore_eos: true,
            ..Default::default()
        }),
        model: String::new(),
    };
    let t0 = Instant::now();
    let mut s = c.generate(req).await.unwrap().into_inner();
    let mut first = None;
    let mut events = Vec::new();
    while let Some(m) = s.message().await.unwrap() {
        if first.is_none() && !m.token_ids.is_empty() {
            first = Some(t0.elapsed());
        }
        if !m.token_ids.is_empty() {
            events.push((Instant::now(), m.token_ids.len()));
        }
    }
    (first.unwrap_or_default().as_secs_f64(), events)
}

/// Output tokens/s while every request was decoding: the tokens that arrived after the last
/// request's first token and up to the first request's last one, over that window. Then every
/// image is encoded and each LM step decodes all the requests: the split's steady state, what
/// the in-process batch decode measures. `None` when the window is empty (the first request
/// finished before the last one started: ask for more tokens).
fn steady_rate(streams: &[Vec<(Instant, usize)>]) -> Option<f64> {
    let start = streams
        .iter()
        .map(|s| s.first().map(|e| e.0))
        .collect::<Option<Vec<_>>>()?;
    let end = streams
        .iter()
        .map(|s| s.last().map(|e| e.0))
        .collect::<Option<Vec<_>>>()?;
    let (start, end) = (*start.iter().max()?, *end.iter().min()?);
    let n: usize = streams
        .iter()
        .flatten()
        .filter(|(t, _)| *t > start && *t <= end)
        .map(|(_, k)| k)
        .sum();
    let secs = end.checked_duration_since(start)?.as_secs_f64();
    (secs > 0.0 && n > 0).then(|| n as f64 / secs)
}

/// The same request sent straight to `Lm.Generate` (prompt built with the gateway's own
/// validator), to isolate the gateway hop.
async fn one_direct(
    lm: String,
    vision: String,
    validator: vlm_gateway::validation::Validator,
    image: Vec<u8>,
    tokens: u32,
) -> f64 {
    use vlm_gateway::validation::{ChatRequest, InputMessage, InputPart, InputSampling};
    let t0 = Instant::now();
    let valid = validator
        .validate(ChatRequest {
            messages: vec![InputMessage {
                role: "user".into(),
                content: vec![
                    InputPart::Image {
                        data: image.into(),
                        mime_type: String::new(),
                        budget: Default::default(),
                    },
                    InputPart::Text(PROMPT.into()),
                ],
                ..Default::default()
            }],
            sampling: InputSampling {
                max_tokens: tokens,
                ignore_eos: true,
                ..Default::default()
            },
            ..Default::default()
        })
        .unwrap();
    let req = vlm_gateway::client::lm_request("bench", &valid, &[], vision.to_string());
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{lm}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = pb::lm_client::LmClient::new(ch).max_encoding_message_size(256 << 20);
    let mut s = c.generate(req).await.unwrap().into_inner();
    let mut first = None;
    while let Some(m) = s.message().await.unwrap() {
        if first.is_none() && !m.token_ids.is_empty() {
            first = Some(t0.elapsed());
        }
    }
    first.unwrap_or_default().as_secs_f64()
}

/// The three services on loopback, started once per model.
struct Split {
    vision: Proc,
    lm: Proc,
    gw: Proc,
    validator: vlm_gateway::validation::Validator,
}

impl Split {
    async fn start(dir: &Path, tmp: &Path) -> Split {
        let bins = bin_dir();
        let cfg = write_config(tmp);
        let common = |extra: &[&str]| {
            let mut a = vec![
                "--model".to_string(),
                dir.display().to_string(),
                "--config".into(),
                cfg.display().to_string(),
                "--listen".into(),
                "127.0.0.1:0".into(),
            ];
            a.extend(extra.iter().map(|s| s.to_string()));
            a
        };
        let vision = spawn(
            &bins.join("vision-service"),
            &common(&["--metrics-listen", "127.0.0.1:0"]),
        );
        let lm = spawn(
            &bins.join("lm-service"),
            &common(&["--metrics-listen", "127.0.0.1:0", "--vision", &vision.1]),
        );
        wait_serving(&vision.1).await;
        wait_serving(&lm.1).await;
        let gw = spawn(
            &bins.join("gateway"),
            &common(&[
                "--http-listen",
                "127.0.0.1:0",
                "--vision",
                &vision.1,
                "--lm",
                &lm.1,
                "--poll-ms",
                "200",
            ]),
        );
        wait_serving(&gw.1).await;
        let deploy = vlm_config::DeployConfig::from_path(&cfg).unwrap().config;
        let validator = vlm_gateway::validation::Validator::new(
            ChatTokenizer::from_dir(dir).unwrap(),
            deploy.visual.clone(),
            vlm_gateway::validation::Limits::from_config(&deploy, 8, 64 << 20),
            "bench".into(),
        );
        Split {
            vision,
            lm,
            gw,
            validator,
        }
    }

    /// `conc` requests through the gateway at once.
    async fn round(&self, conc: usize, tokens: usize, seed: usize) -> Stat {
        let hs: Vec<_> = (0..conc)
            .map(|i| {
                tokio::spawn(one_request(
                    self.gw.1.clone(),
                    png((seed + i) as u32),
                    tokens as u32,
                ))
            })
            .collect();
        let mut ttft = 0.0;
        let mut streams = Vec::new();
        for h in hs {
            let (f, events) = h.await.unwrap();
            ttft += f;
            streams.push(events);
        }
        let rate = steady_rate(&streams).unwrap_or_else(|| {
            panic!("no moment when all {conc} requests were decoding: raise VLM_BENCH_TOKENS")
        });
        Stat {
            ttft_ms: ttft / conc as f64 * 1e3,
            tok_s: rate,
        }
    }

    /// Mean TTFT (ms) of the same requests sent straight to the LM: the split less the gateway.
    async fn direct_round(&self, conc: usize, tokens: usize, seed: usize) -> f64 {
        let hs: Vec<_> = (0..conc)
            .map(|i| {
                tokio::spawn(one_direct(
                    self.lm.1.clone(),
                    self.vision.1.clone(),
                    self.validator.clone(),
                    png((seed + i) as u32),
                    tokens as u32,
                ))
            })
            .collect();
        let mut t = 0.0;
        for h in hs {
            t += h.await.unwrap();
        }
        t / conc as f64 * 1e3
    }
}

fn main() {
    // `cargo bench` passes --bench; under `cargo test --benches` (no --bench) there is nothing
    // to assert, so do not spend minutes measuring.
    if !std::env::args().any(|a| a == "--bench") {
        println!("split_overhead: run with `cargo bench -p vlm-gateway --bench split_overhead`");
        return;
    }
    let tokens = env_usize("VLM_BENCH_TOKENS", 32);
    let rounds = env_usize("VLM_BENCH_ROUNDS", 3);
    let tmp = PathBuf::from(option_env!("CARGO_TARGET_TMPDIR").unwrap_or("/tmp"));
    let tiny = tmp.join("bench-tiny-s0");
    if !tiny.join("config.json").is_file() {
        vlm_make_model::make_model(
            &tiny,
            &vlm_make_model::MakeOptions::new(vlm_make_model::Preset::Tiny),
        )
        .unwrap();
    }
    let mut models = vec![("tiny", tiny)];
    if let Ok(m) = std::env::var("VLM_BENCH_MODEL") {
        models.push(("VLM_BENCH_MODEL", PathBuf::from(m)));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!("split_overhead: {tokens} output tokens per request, one 512x512 image each, {rounds} rounds (+1 warm-up)");
    for (name, dir) in models {
        let local = Local::load(&dir);
        let split = rt.block_on(Split::start(&dir, &tmp));
        for conc in [1usize, 8] {
            // In-process and split rounds alternate, so that both see the same phases of the
            // machine (its memory bandwidth swings from minute to minute).
            let (mut ls, mut ss, mut direct, mut ratios) = (vec![], vec![], vec![], vec![]);
            for r in 0..rounds + 1 {
                let seed = 1000 + r * 100;
                let l = local.round(conc, tokens, seed);
                let s = rt.block_on(split.round(conc, tokens, seed + 50));
                let d = rt.block_on(split.direct_round(conc, tokens, seed + 70));
                if r > 0 {
                    ratios.push(s.tok_s / l.tok_s);
                    ls.push(l);
                    ss.push(s);
                    direct.push(d);
                }
            }
            let (l, s) = (mean(&ls), mean(&ss));
            let d = direct.iter().sum::<f64>() / direct.len().max(1) as f64;
            ratios.sort_by(f64::total_cmp);
            println!(
                "{name:<16} conc={conc}  TTFT in-process {:>8.1} ms  split {:>8.1} ms ({:+.1} ms; gateway hop {:+.1} ms vs Lm.Generate direct {d:.1} ms)  \
                 tok/s in-process {:>8.1}  split {:>8.1} (split/in-process per round: {})",
                l.ttft_ms,
                s.ttft_ms,
                s.ttft_ms - l.ttft_ms,
                s.ttft_ms - d,
                l.tok_s,
                s.tok_s,
                ratios
                    .iter()
                    .map(|r| format!("{r:.3}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            );
        }
        drop(split);
    }
}
