//! Decode step time per decode graph, buckets [1, 2, 4, 8] against a single [8] graph, for
//! active batches 1..=8 at contexts 256 and 8192; then total output tokens/s of the engine at
//! 1, 4 and 8 concurrent streams.
//!
//! `cargo bench -p vlm-lm-service --bench decode_buckets` (model: $VLM_BENCH_MODEL, else the
//! tiny golden checkpoint; weight dtype: $VLM_BENCH_DTYPE, f32 (default) or bf16; tables:
//! $VLM_BENCH_TABLES, `decode`, `throughput` or both; tokens per stream: $VLM_BENCH_NEW_TOKENS). A context over the checkpoint's max_position_embeddings is still
//! timed (positions have no hard limit here) and marked as such.
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use vlm_compute::{DecodeRow, PromptLayout, Qwen3VlConfig};
use vlm_config::{DeployConfig, Dtype};
use vlm_lm_service::engine::{EngineHandle, EngineOptions, SeqRequest};
use vlm_lm_service::sampler::SamplingConfig;

const BATCH: usize = 8;
const BLOCK_LEN: usize = 256;

fn model_dir() -> PathBuf {
    std::env::var_os("VLM_BENCH_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny"))
}

/// Median seconds of `a` and of `b`, run in turn (a, b, a, b, ...) at least 5 times each and
/// for about `budget`: the machine's memory bandwidth swings from one second to the next, and
/// alternating puts both sides in the same phases.
fn time_pair(budget: Duration, mut a: impl FnMut(), mut b: impl FnMut()) -> (f64, f64) {
    a(); // warm
    b();
    let (mut sa, mut sb) = (Vec::new(), Vec::new());
    let t0 = Instant::now();
    while sa.len() < 5 || (t0.elapsed() < budget && sa.len() < 200) {
        let t = Instant::now();
        a();
        sa.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        b();
        sb.push(t.elapsed().as_secs_f64());
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    (median(sa), median(sb))
}

/// The weight dtype under test ($VLM_BENCH_DTYPE).
fn bf16() -> bool {
    std::env::var("VLM_BENCH_DTYPE").is_ok_and(|d| d == "bf16")
}

fn smallest(buckets: &[usize], n: usize) -> usize {
    buckets.iter().copied().find(|&b| b >= n).unwrap_or(BATCH)
}

fn decode_table(dir: &Path, cfg: &Qwen3VlConfig) {
    let max_pos = cfg.text.max_position_embeddings;
    println!("\n## decode step time (ms), buckets [1,2,4,8] vs single [8]\n");
    println!("| context | active | graph | ms/step [1,2,4,8] | ms/step [8] | [8]/[1,2,4,8] |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for context in [256usize, 8192] {
        if context + 1 > max_pos {
            // Rotary positions have no hard limit in this implementation: the timing is valid,
            // the numbers the model would produce there are not.
            println!(
                "| {context} | (beyond max_position_embeddings {max_pos}: timing only) | | | | |"
            );
        }
        let per_seq = (context + 1).div_ceil(BLOCK_LEN);
        // The LM's backend as the service loads it (the config's default kernels).
        let runner = vlm_backends::load_lm(&vlm_backends::LmLoad {
            model_dir: dir,
            dtype: if bf16() { Dtype::Bf16 } else { Dtype::F32 },
            kv_cache_dtype: vlm_config::KvCacheDtype::Auto,
            kernels: &vlm_config::KernelConfig::default(),
            num_blocks: per_seq * BATCH,
            block_len: BLOCK_LEN,
            devices: &[0],
        })
        .expect("load model");
        let rows_for = |n: usize| -> Vec<DecodeRow> {
            (0..n)
                .map(|i| DecodeRow {
                    token: 5 + i as u32,
                    position: context as i64,
                    context_len: context,
                    block_table: ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect(),
                })
                .collect()
        };
        let budget = Duration::from_millis(1500);
        let runner = std::cell::RefCell::new(runner);
        for n in 1..=BATCH {
            let g = smallest(&[1, 2, 4, 8], n);
            let step = |graph: usize| {
                runner
                    .borrow_mut()
                    .decode(graph, &rows_for(n))
                    .expect("decode");
            };
            let (a, b) = time_pair(budget, || step(g), || step(8));
            println!(
                "| {context} | {n} | {g} | {:.3} | {:.3} | {:.2}x |",
                a * 1e3,
                b * 1e3,
                b / a
            );
        }
    }
}

fn throughput_table(dir: &Path, cfg: &Qwen3VlConfig) {
    let mut deploy = DeployConfig::default_config();
    deploy.batch_size = BATCH as u32;
    deploy.decoder_batch_sizes = vec![1, 2, 4, 8];
    deploy.max_seq_len = 2048;
    deploy.kvcache_partition_len = BLOCK_LEN as u32;
    if bf16() {
        deploy.dtype = vlm_config::Dtype::Bf16;
    }
    let num_blocks = vlm_lm_service::resolve_num_blocks(&deploy, dir).expect("KV blocks");
    let (engine, thread) = EngineHandle::start(EngineOptions {
        prefill_while_decoding: 0,
        model_dir: dir.to_path_buf(),
        deploy: deploy.clone(),
        num_blocks,
        cores: Vec::new(),
    })
    .expect("start engine");
    let prompt_len = 64usize;
    let new_tokens: usize = std::env::var("VLM_BENCH_NEW_TOKENS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(128);
    println!(
        "\n## engine output tokens/s (prompt {prompt_len}, {new_tokens} new tokens per stream, buckets [1,2,4,8])\n"
    );
    // "tokens/s" counts the whole run, prefills included; "decode tokens/s" counts the tokens
    // emitted while every stream was decoding (from the last first token to the first finish),
    // which is what the batch-size scaling of a decode step shows.
    println!("| streams | wall s | output tokens | tokens/s | decode tokens/s | TTFT avg ms |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for streams in [1usize, 4, 8] {
        let t0 = Instant::now();
        let mut rxs = Vec::new();
        for s in 0..streams {
            let ids: Vec<u32> = (0..prompt_len as u32)
                .map(|i| (i * 7 + s as u32 * 13) % 900 + 5)
                .collect();
            let layout = PromptLayout::new(&ids, &[], cfg).expect("layout");
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            engine
                .submit(SeqRequest {
                    request_id: format!("bench-{s}"),
                    prompt: ids,
                    images: Vec::new(),
                    image_hashes: Vec::new(),
                    layout,
                    image_tokens: 0,
                    video_tokens: 0,
                    sampling: SamplingConfig::greedy(),
                    guide: None,
                    n: 1,
                    index: 0,
                    max_new_tokens: new_tokens,
                    stop_ids: Vec::new(),
                    deadline: None,
                    events: tx,
                    span: tracing::Span::none(),
                    received: Instant::now(),
                })
                .expect("submit");
            rxs.push(rx);
        }
        // Drain every stream at once so each first token is timed when it arrives.
        let mut total = 0usize;
        let mut ttft = 0.0;
        let mut first = vec![true; streams];
        let mut open = streams;
        // (time, tokens so far) when the last stream got its first token / the first finished.
        let mut all_running: Option<(f64, usize)> = None;
        let mut first_done: Option<(f64, usize)> = None;
        while open > 0 {
            let mut idle = true;
            for (i, rx) in rxs.iter_mut().enumerate() {
                while let Ok(ev) = rx.try_recv() {
                    idle = false;
                    let ev = ev.expect("generation");
                    if first[i] {
                        ttft += t0.elapsed().as_secs_f64();
                        first[i] = false;
                    }
                    total += ev.tokens.len();
                    if all_running.is_none() && first.iter().all(|f| !f) {
                        all_running = Some((t0.elapsed().as_secs_f64(), total));
                    }
                    if ev.finish.is_some() {
                        if first_done.is_none() {
                            // The finishing event's tokens were produced before this moment.
                            first_done = Some((t0.elapsed().as_secs_f64(), total));
                        }
                        open -= 1;
                    }
                }
            }
            if idle {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        let wall = t0.elapsed().as_secs_f64();
        let decode_rate = match (all_running, first_done) {
            (Some((ta, na)), Some((tb, nb))) if tb > ta && nb > na => {
                format!("{:.1}", (nb - na) as f64 / (tb - ta))
            }
            _ => "-".to_string(),
        };
        println!(
            "| {streams} | {wall:.3} | {total} | {:.1} | {decode_rate} | {:.1} |",
            total as f64 / wall,
            ttft / streams as f64 * 1e3
        );
    }
    engine.shutdown();
    let _ = thread.join();
}

fn main() {
    let dir = model_dir();
    let cfg = Qwen3VlConfig::from_dir(&dir).expect("read config.json");
    println!(
        "model {} ({} layers, hidden {}, vocab {}), {} weights, block_len {BLOCK_LEN}, {} CPU threads",
        cfg.model_id,
        cfg.text.num_hidden_layers,
        cfg.text.hidden_size,
        cfg.text.vocab_size,
        if bf16() { "bf16" } else { "f32" },
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    // $VLM_BENCH_TABLES: "decode", "throughput" or both (default).
    let tables = std::env::var("VLM_BENCH_TABLES").unwrap_or_default();
    if tables.is_empty() || tables.contains("decode") {
        decode_table(&dir, &cfg);
    }
    if tables.is_empty() || tables.contains("throughput") {
        throughput_table(&dir, &cfg);
    }
}
