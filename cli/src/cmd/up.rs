//! `vlm up`: the whole system on this machine. Starts vision-service, lm-service and gateway as
//! child processes on loopback, waits until all three report SERVING,
//! prints the addresses (and pids), restarts a child that dies (see [`super::supervise`]), and
//! on Ctrl-C (or SIGTERM) drains them (SIGTERM to each child).
//!
//! Without `--model` it uses the tiny random checkpoint, made once and cached under
//! `$XDG_CACHE_HOME/vlm/tiny-s0` (or `~/.cache/vlm/tiny-s0`). Without `--config` it runs the
//! embedded `config/examples/local.yaml` on [`default_layout`]'s cores (shared by vision and LM
//! on a small machine, disjoint halves from four cores on), and says which at start.
use super::cache::cache_dir;
use super::child::{spawn_service, stop_child, Service};
use super::gguf::{gguf_checkpoint, is_gguf};
use super::supervise::Supervised;
use super::up_context;
use anyhow::{bail, Context};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// The embedded default deployment config.
pub const LOCAL_CONFIG: &str = include_str!("../../../config/examples/local.yaml");

#[derive(clap::Args, Debug)]
pub struct UpArgs {
    /// Checkpoint directory, or a GGUF file as llama.cpp writes it (with --mmproj); the
    /// cached tiny random checkpoint when omitted.
    #[arg(long, env = "VLM_MODEL")]
    pub model: Option<PathBuf>,
    /// The GGUF vision file (llama.cpp's `--mmproj`) that goes with a GGUF --model.
    #[arg(long, env = "VLM_MMPROJ")]
    pub mmproj: Option<PathBuf>,
    /// Deployment config; the embedded local.yaml when omitted.
    #[arg(long, env = "VLM_CONFIG")]
    pub config: Option<PathBuf>,
    /// Gateway gRPC address.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub listen: String,
    /// Gateway HTTP address (OpenAI API, /health, /metrics).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub http_listen: String,
    /// Seconds to wait for every service to report SERVING.
    #[arg(long, default_value_t = 300)]
    pub ready_timeout_s: u64,
    /// Extra arguments for the gateway (e.g. "--max-in-flight=4"), repeatable.
    #[arg(long = "gateway-arg", allow_hyphen_values = true)]
    pub gateway_args: Vec<String>,
    /// Stop everything when a service exits, instead of restarting it (with backoff: 1 s,
    /// doubling to 30 s) while the others keep serving.
    #[arg(long)]
    pub no_restart: bool,
    /// Context length (prompt + generated tokens) of the embedded config; by default the
    /// checkpoint's up to 32768, as long as one full-length sequence fits in memory.
    #[arg(long)]
    pub max_model_len: Option<u32>,
    /// The embedded config's `kv_cache_dtype`: `auto` (bf16 for a bf16 model) or `fp8`
    /// (E4M3 codes, vLLM's `--kv-cache-dtype fp8`): half the KV bytes, so twice the context
    /// in the same memory.
    #[arg(long, default_value = "auto", value_parser = ["auto", "fp8", "fp8_e4m3"])]
    pub kv_cache_dtype: String,
}

pub fn run(args: UpArgs) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(up(args))
}

/// The tiny random checkpoint (seed 0) in `dir`, made the first time.
pub fn ensure_tiny_checkpoint(dir: &Path) -> anyhow::Result<()> {
    let has_weights = dir.join("config.json").is_file()
        && std::fs::read_dir(dir)
            .map(|d| {
                d.flatten()
                    .any(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
            })
            .unwrap_or(false);
    if has_weights {
        return Ok(());
    }
    eprintln!(
        "making the tiny random checkpoint in {} (once)",
        dir.display()
    );
    let opts = vlm_make_model::MakeOptions::new(vlm_make_model::Preset::Tiny);
    vlm_make_model::make_model(dir, &opts)
        .with_context(|| format!("making the tiny checkpoint in {}", dir.display()))?;
    Ok(())
}

/// Below this many cores, the default layout shares every core between vision and LM.
pub const SHARED_BELOW_CORES: u32 = 4;

/// The default layout's (vision, lm) device lists over the `n` cores this process may use, and
/// a line saying what it is. Under [`SHARED_BELOW_CORES`] both parts get every core: a request
/// is ViT then prefill then decode, so each phase then runs on all the cores (the vision
/// service spreads a lone image over its pool), and on two cores that measured faster than one
/// core each on every request kind (README, "Performance"). From there on, disjoint halves,
/// as the parts scale on Kubernetes.
pub fn default_layout(n: u32) -> (Vec<u32>, Vec<u32>, String) {
    let n = n.max(1);
    let all: Vec<u32> = (0..n).collect();
    if n < SHARED_BELOW_CORES {
        let line = format!(
            "layout: vision and LM share cores {} (under {SHARED_BELOW_CORES} cores each phase of \
             a request runs on all of them); a --config with disjoint `device` lists splits them",
            join(&all)
        );
        return (all.clone(), all, line);
    }
    let vision = n / 2;
    let (v, l) = (
        all[..vision as usize].to_vec(),
        all[vision as usize..].to_vec(),
    );
    let line = format!(
        "layout: vision on cores {}, LM on cores {} (disjoint pools, as on Kubernetes)",
        join(&v),
        join(&l)
    );
    (v, l, line)
}

/// The embedded config for `model` on the layout's cores (vision, LM), as the YAML `vlm up`
/// writes, and the lines it prints about it: which compute dtype each part runs (the config
/// leaves `dtype` at `auto`, which each service resolves the same way against the checkpoint
/// and the CPU) and the context and KV pool chosen for this machine ([`up_context::choose`];
/// `max_model_len` is `--max-model-len`).
pub fn default_config(
    model: &Path,
    (vision, lm): (&[u32], &[u32]),
    max_model_len: Option<u32>,
    kv_cache_dtype: vlm_config::KvCacheDtype,
) -> anyhow::Result<(String, Vec<String>)> {
    let mut c = vlm_config::DeployConfig::from_str_as(LOCAL_CONFIG, vlm_config::Format::Yaml)
        .expect("the embedded config is valid")
        .config;
    c.kv_cache_dtype = kv_cache_dtype;
    (c.visual.num_devices, c.visual.device) = (vision.len() as u32, vision.to_vec());
    (c.num_devices, c.device) = (lm.len() as u32, lm.to_vec());
    let facts =
        vlm_config::DtypeFacts::for_checkpoint(model, vlm_service_kit::config::cpu_has_bf16());
    let mut resolved = c.clone();
    let mut lines = resolved.resolve_auto_dtype(&facts);
    let ctx = up_context::choose(&resolved, model, max_model_len)?;
    lines.push(ctx.line);
    (c.max_seq_len, c.kvcache_num_blocks) = (ctx.max_seq_len, ctx.kv_blocks);
    let text = format!(
        "# Written by `vlm up` from the embedded config (config/examples/local.yaml) for\n\
         # {}: this machine's layout, context and KV pool.\n{}",
        model.display(),
        serde_yaml::to_string(&c.to_document())?
    );
    Ok((text, lines))
}

/// The cores this process may use.
fn available_cores() -> u32 {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1) as u32
}

fn join(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

async fn wait_all_serving(services: &mut [Service], timeout: Duration) -> anyhow::Result<()> {
    for i in 0..services.len() {
        let (name, addr) = (services[i].name, services[i].grpc.clone());
        wait_serving(name, &addr, timeout, || exited(services)).await?;
    }
    Ok(())
}

/// The first service that has exited, as an error naming it and its status.
fn exited(services: &mut [Service]) -> anyhow::Result<()> {
    for s in services.iter_mut() {
        if let Some(status) = s.child.try_wait()? {
            let hint = if exit_signal(&status) == Some(9) {
                " (SIGKILL: out of memory if the kernel log says so; see `vlm plan`)"
            } else {
                ""
            };
            bail!("{} exited with {status} while loading{hint}", s.name);
        }
    }
    Ok(())
}

#[cfg(unix)]
fn exit_signal(status: &std::process::ExitStatus) -> Option<i32> {
    std::os::unix::process::ExitStatusExt::signal(status)
}
#[cfg(not(unix))]
fn exit_signal(_: &std::process::ExitStatus) -> Option<i32> {
    None
}

/// Polls `grpc.health.v1` at `addr` until it answers SERVING; `alive` is checked on every
/// poll and its error ends the wait.
async fn wait_serving(
    name: &str,
    addr: &str,
    timeout: Duration,
    mut alive: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    use tonic_health::pb::{
        health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest,
    };
    let deadline = Instant::now() + timeout;
    let url = if addr.starts_with("http") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    let mut last = String::from("no answer yet");
    while Instant::now() < deadline {
        alive()?;
        if let Ok(ch) = tonic::transport::Endpoint::from_shared(url.clone())?
            .connect()
            .await
        {
            match HealthClient::new(ch)
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await
            {
                Ok(r) if r.get_ref().status == ServingStatus::Serving as i32 => return Ok(()),
                Ok(r) => last = format!("status {:?}", r.get_ref().status),
                Err(s) => last = s.message().to_string(),
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("{name} at {addr} was not SERVING within {timeout:?} ({last})")
}

/// The directory holding the service binaries: the running executable's.
pub fn bin_dir() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the vlm executable")?;
    Ok(exe
        .parent()
        .context("the vlm executable has no directory")?
        .to_path_buf())
}

fn binary(dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let p = dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    if !p.is_file() {
        bail!(
            "{} not found next to vlm; build it with `cargo build -p vlm-{name}`",
            p.display()
        );
    }
    Ok(p)
}

async fn up(args: UpArgs) -> anyhow::Result<ExitCode> {
    let dir = bin_dir()?;
    let bins = [
        binary(&dir, "vision-service")?,
        binary(&dir, "lm-service")?,
        binary(&dir, "gateway")?,
    ];
    let model = match args.model {
        Some(m) if is_gguf(&m) => gguf_checkpoint(&m, args.mmproj.as_deref())?,
        Some(_) if args.mmproj.is_some() => {
            bail!(
                "--mmproj goes with a GGUF --model; a checkpoint directory holds its vision tower"
            )
        }
        Some(m) => m,
        None => {
            let m = cache_dir().join("tiny-s0");
            ensure_tiny_checkpoint(&m)?;
            m
        }
    };
    let (config, devices) = match args.config {
        Some(_) if args.max_model_len.is_some() => bail!(
            "--max-model-len sets the embedded config's context; with --config, set max_seq_len \
             (and kvcache_num_blocks) in that file"
        ),
        Some(_) if args.kv_cache_dtype != "auto" => bail!(
            "--kv-cache-dtype sets the embedded config's; with --config, set kv_cache_dtype in \
             that file"
        ),
        Some(c) => (c, None),
        None => {
            let p = cache_dir().join("local.yaml");
            std::fs::create_dir_all(cache_dir())?;
            let (v, l, line) = default_layout(available_cores());
            eprintln!("{line}");
            let kv = match args.kv_cache_dtype.as_str() {
                "auto" => vlm_config::KvCacheDtype::Auto,
                _ => vlm_config::KvCacheDtype::Fp8E4m3,
            };
            let (text, lines) = default_config(&model, (&v, &l), args.max_model_len, kv)?;
            for line in lines {
                eprintln!("{line}");
            }
            std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))?;
            (p, Some((v, l)))
        }
    };
    let timeout = Duration::from_secs(args.ready_timeout_s);
    let common = |listen: &str| {
        vec![
            "--model".to_string(),
            model.display().to_string(),
            "--config".into(),
            config.display().to_string(),
            "--listen".into(),
            listen.to_string(),
            "--metrics-listen".into(),
            "127.0.0.1:0".into(),
        ]
    };
    let mut services: Vec<Service> = Vec::new();
    let mut launch: Vec<(PathBuf, Vec<String>)> = Vec::new();
    let result: anyhow::Result<()> = async {
        let mut va = common("127.0.0.1:0");
        let mut la = common("127.0.0.1:0");
        if let Some((v, l)) = &devices {
            va.extend(["--device".into(), join(v)]);
            la.extend(["--device".into(), join(l)]);
        }
        services.push(spawn_service("vision", &bins[0], &va, timeout)?);
        launch.push((bins[0].clone(), va));
        // The LM dials only the vision replicas it is given.
        la.extend(["--vision".into(), services[0].grpc.clone()]);
        services.push(spawn_service("lm", &bins[1], &la, timeout)?);
        launch.push((bins[1].clone(), la));
        let mut ga = vec![
            "--model".to_string(),
            model.display().to_string(),
            "--config".into(),
            config.display().to_string(),
            "--listen".into(),
            args.listen.clone(),
            "--http-listen".into(),
            args.http_listen.clone(),
            "--vision".into(),
            services[0].grpc.clone(),
            "--lm".into(),
            services[1].grpc.clone(),
        ];
        ga.extend(args.gateway_args.iter().cloned());
        services.push(spawn_service("gateway", &bins[2], &ga, timeout)?);
        launch.push((bins[2].clone(), ga));
        wait_all_serving(&mut services, timeout).await?;
        Ok(())
    }
    .await;
    if let Err(e) = result {
        for s in services.iter_mut().rev() {
            stop_child(&mut s.child, Duration::from_secs(5));
        }
        return Err(e);
    }
    let pid = |i: usize| services[i].child.id();
    println!("vision  grpc={} pid={}", services[0].grpc, pid(0));
    println!("lm      grpc={} pid={}", services[1].grpc, pid(1));
    println!(
        "gateway grpc={} http={} pid={}",
        services[2].grpc,
        services[2].http,
        pid(2)
    );
    println!("model   {}", model.display());
    println!(
        "ready: try `vlm generate --gateway {} \"Describe the image\" --image PATH`",
        services[2].grpc
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();

    // Until Ctrl-C / SIGTERM: a child that dies is restarted where it was (or, with
    // --no-restart, everything stops).
    let mut children: Vec<Supervised> = services
        .into_iter()
        .zip(launch)
        .map(|(s, (bin, args))| Supervised::new(s, bin, &args))
        .collect();
    let mut signal = std::pin::pin!(shutdown_signal());
    let exited = loop {
        tokio::select! {
            _ = &mut signal => break None,
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
        if args.no_restart {
            if let Some(i) = children
                .iter_mut()
                .position(|c| matches!(c.service.child.try_wait(), Ok(Some(_))))
            {
                break Some(children[i].service.name);
            }
            continue;
        }
        for c in &mut children {
            // A restart waits for the child's address line (blocking this loop), as the
            // first start did.
            if let Some(event) = tokio::task::block_in_place(|| c.tick(timeout)) {
                println!("{event}");
                use std::io::Write;
                let _ = std::io::stdout().flush();
            }
        }
    };
    eprintln!("draining: SIGTERM to gateway, lm, vision");
    for c in children.iter_mut().rev() {
        stop_child(&mut c.service.child, Duration::from_secs(30));
    }
    match exited {
        Some(name) => {
            eprintln!("error: {name} exited; stopped the others (--no-restart)");
            Ok(ExitCode::FAILURE)
        }
        None => Ok(ExitCode::SUCCESS),
    }
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_machines_share_every_core_and_larger_ones_split_in_halves() {
        for n in [1, 2, 3] {
            let (v, l, line) = default_layout(n);
            let all: Vec<u32> = (0..n).collect();
            assert_eq!((&v, &l), (&all, &all), "{n} cores");
            assert!(line.contains("share"), "{line}");
        }
        let (v, l, line) = default_layout(4);
        assert_eq!((v, l), (vec![0, 1], vec![2, 3]));
        assert!(line.contains("disjoint"), "{line}");
        let (v, l, _) = default_layout(7);
        assert_eq!((v, l), (vec![0, 1, 2], vec![3, 4, 5, 6]));
    }

    #[test]
    fn the_embedded_config_leaves_the_dtype_to_the_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("tiny");
        let opts = vlm_make_model::MakeOptions::new(vlm_make_model::Preset::Tiny);
        vlm_make_model::make_model(&model, &opts).unwrap();
        let parse = |text: &str| {
            vlm_config::DeployConfig::from_str_as(text, vlm_config::Format::Yaml)
                .unwrap()
                .config
        };
        let cores: &[u32] = &[0, 1];
        let (text, lines) =
            default_config(&model, (cores, cores), None, Default::default()).unwrap();
        let c = parse(&text);
        assert!(c.dtype_auto && c.visual.dtype_auto, "{text}");
        assert_eq!((&c.device, &c.visual.device), (&vec![0, 1], &vec![0, 1]));
        assert!(lines[0].contains("float32"), "{lines:?}");
        assert!(
            lines[2].starts_with("context: max_seq_len 4096"),
            "{lines:?}"
        );
        assert_eq!(c.max_seq_len, 4096);

        // A bf16 checkpoint: the LM runs bf16 (weights, with f32 math off AVX512-BF16).
        let config = model.join("config.json");
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
        json["text_config"]["dtype"] = "bfloat16".into();
        json["dtype"] = "bfloat16".into();
        std::fs::write(&config, json.to_string()).unwrap();
        let (text, lines) =
            default_config(&model, (cores, cores), Some(2048), Default::default()).unwrap();
        assert!(lines[0].starts_with("dtype auto: LM bf16"), "{lines:?}");
        let vit = if vlm_service_kit::config::cpu_has_bf16() {
            "bf16"
        } else {
            "f32"
        };
        assert!(
            lines[1].starts_with(&format!("dtype auto: ViT {vit}")),
            "{lines:?}"
        );
        assert_eq!(parse(&text).max_seq_len, 2048, "{lines:?}");
    }
}
