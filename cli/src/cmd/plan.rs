//! `vlm plan`: will the config fit its devices (exit 0) or not (exit 1, with checked changes
//! that would), and `vlm plan buckets`: ViT buckets and decode graphs for observed traffic.
use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use vlm_config::plan::{
    self, buckets, report, BucketSet, CostModel, DeviceKind, ModelDims, Part, PlanOptions,
};
use vlm_config::{DeployConfig, Dtype};

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct PlanArgs {
    #[command(subcommand)]
    pub command: Option<PlanCommand>,
    #[command(flatten)]
    pub memory: MemoryArgs,
}

#[derive(Subcommand, Debug)]
pub enum PlanCommand {
    /// Choose ViT buckets (visual.max_seq_len) and decode graphs (decoder_batch_sizes) for
    /// observed traffic.
    Buckets(BucketsArgs),
}

// Where the model's dimensions come from (no doc comment: clap would take it as `about`).
#[derive(Args, Debug)]
pub struct ModelSource {
    /// A checkpoint directory (its config.json is read), or a GGUF LM file with --mmproj.
    #[arg(long, value_name = "DIR", conflicts_with = "preset")]
    pub model: Option<PathBuf>,
    /// The GGUF vision file of a GGUF --model (llama.cpp's flag name).
    #[arg(long, value_name = "FILE", requires = "model")]
    pub mmproj: Option<PathBuf>,
    /// A known model: qwen3-vl-2b.
    #[arg(long, value_name = "NAME")]
    pub preset: Option<String>,
}

// The devices the plan places parts on.
#[derive(Args, Debug)]
pub struct DeviceArgs {
    /// atom (16 GiB, 288 MiB reserved), rebel (144 GiB, 4 x 1 GiB reserved), rebel-chiplet
    /// (36 GiB, 1 GiB reserved), h200 (141 GB), cpu (this machine's RAM, one pool).
    #[arg(long, value_name = "KIND")]
    pub device_kind: Option<String>,
    /// Bytes per device (17179869184, 16GiB, 141GB): over the kind's capacity, or alone for a
    /// device of our candle backend with no reservation.
    #[arg(long, value_name = "BYTES")]
    pub device_memory: Option<String>,
    /// Dtype of weights, KV cache and activations (f32, f16, bf16), over the kind's own: RBLN
    /// kinds are 16-bit; h200/cpu hold weights in the config's dtype and KV/activations in f32.
    #[arg(long)]
    pub dtype: Option<String>,
}

#[derive(Args, Debug)]
pub struct MemoryArgs {
    /// The deployment config.
    #[arg(long, env = "VLM_CONFIG")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub model: ModelSource,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Plan kvcache_num_blocks 0 as batch_size full-length sequences (the library's default)
    /// and fit only when every sequence slot can reach max_seq_len.
    #[arg(long)]
    pub full_batch: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct BucketsArgs {
    /// Image sizes: one WxH per line, or JSON lines {"images":[{"width":W,"height":H}]}.
    #[arg(long, value_name = "FILE")]
    pub traffic: Option<PathBuf>,
    /// Active decode batch sizes, one or more integers per line.
    #[arg(long, value_name = "FILE")]
    pub batch_log: Option<PathBuf>,
    /// Buckets (and decode graphs) to choose, at most.
    #[arg(long, default_value_t = 3)]
    pub max_buckets: usize,
    /// The deployment config: its buckets are compared, its pixel limits and batch_size used,
    /// and with --device-kind its layout bounds the memory of the buckets.
    #[arg(long, env = "VLM_CONFIG")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub model: ModelSource,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: PlanArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        Some(PlanCommand::Buckets(b)) => run_buckets(b),
        None => run_memory(args.memory),
    }
}

fn load_config(path: Option<&Path>) -> anyhow::Result<DeployConfig> {
    match path {
        Some(path) => {
            let loaded = DeployConfig::from_path(path)
                .with_context(|| format!("config {}", path.display()))?;
            for w in &loaded.warnings {
                eprintln!("warning: {w}");
            }
            Ok(loaded.config)
        }
        None => Ok(DeployConfig::default_config()),
    }
}

fn model_dims(src: &ModelSource, default_preset: Option<&str>) -> anyhow::Result<ModelDims> {
    match (&src.model, src.preset.as_deref().or(default_preset)) {
        // A GGUF pair is sized by what its files store (the derived config's byte count).
        (Some(file), _) if super::gguf::is_gguf(file) => Ok(ModelDims::from_dir(
            &super::gguf::gguf_checkpoint(file, src.mmproj.as_deref())?,
        )?),
        (Some(_), _) if src.mmproj.is_some() => {
            bail!(
                "--mmproj goes with a GGUF --model; a checkpoint directory holds its vision tower"
            )
        }
        (Some(dir), _) => Ok(ModelDims::from_dir(dir)?),
        (None, Some(name)) => Ok(ModelDims::preset(name)?),
        (None, None) => {
            bail!("give --model DIR (a checkpoint with config.json) or --preset qwen3-vl-2b")
        }
    }
}

fn parse_dtype(s: &str) -> anyhow::Result<Dtype> {
    match s.to_ascii_lowercase().as_str() {
        "f32" | "float32" => Ok(Dtype::F32),
        "f16" | "float16" => Ok(Dtype::F16),
        "bf16" | "bfloat16" => Ok(Dtype::Bf16),
        _ => bail!("--dtype {s}: expected f32, f16 or bf16"),
    }
}

/// The kind (None when neither --device-kind nor --device-memory is given) and the options.
fn device_kind(d: &DeviceArgs) -> anyhow::Result<Option<DeviceKind>> {
    let memory = d
        .device_memory
        .as_deref()
        .map(plan::parse_bytes)
        .transpose()?;
    Ok(match (&d.device_kind, memory) {
        (Some(k), m) => {
            let kind = DeviceKind::by_name(k)?;
            Some(match m {
                Some(m) => kind.with_capacity(m),
                None => kind,
            })
        }
        (None, Some(m)) => {
            let mut k = DeviceKind::h200().with_capacity(m);
            k.name = "custom".into();
            Some(k)
        }
        (None, None) => None,
    })
}

fn options(d: &DeviceArgs, full_batch: bool) -> anyhow::Result<PlanOptions> {
    Ok(PlanOptions {
        dtype: d.dtype.as_deref().map(parse_dtype).transpose()?,
        require_full_batch: full_batch,
    })
}

fn run_memory(a: MemoryArgs) -> anyhow::Result<ExitCode> {
    let Some(path) = a.config.as_deref() else {
        bail!("give --config FILE (the deployment config to plan)")
    };
    let cfg = load_config(Some(path))?;
    let dims = model_dims(&a.model, None)?;
    let Some(kind) = device_kind(&a.device)? else {
        bail!("give --device-kind atom|rebel|rebel-chiplet|h200|cpu or --device-memory BYTES")
    };
    let opts = options(&a.device, a.full_batch)?;
    // The sizes of the backends the services would run this config on (the same function they
    // size `kvcache_num_blocks: 0` with).
    let sizing = vlm_backends::sizing(&cfg, &kind, &opts)?;
    let p = plan::plan(&cfg, &dims, &kind, sizing.as_ref(), &opts);
    if a.json {
        let mut v = serde_json::to_value(&p)?;
        v["params"] = serde_json::to_value(dims.params())?;
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", report::render(&p, &dims));
    }
    Ok(if p.fits {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn read(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}

fn line(label: &str, s: &BucketSet, base: f64) -> String {
    format!(
        "  {label:<16} {:<28} expected cost {:.3e} FLOPs ({:.2}x)  padding {:.1}%{}",
        format!("{:?}", s.buckets),
        s.expected_cost,
        if base > 0.0 {
            s.expected_cost / base
        } else {
            0.0
        },
        100.0 * s.padding_waste,
        if s.unserved > 0.0 {
            format!("  unserved {:.1}%", 100.0 * s.unserved)
        } else {
            String::new()
        }
    )
}

fn run_buckets(a: BucketsArgs) -> anyhow::Result<ExitCode> {
    if a.traffic.is_none() && a.batch_log.is_none() {
        bail!("give --traffic FILE (image sizes) and/or --batch-log FILE (active decode batches)");
    }
    let cfg = load_config(a.config.as_deref())?;
    let dims = model_dims(&a.model, Some("qwen3-vl-2b"))?;
    let kind = device_kind(&a.device)?;
    let opts = options(&a.device, false)?;
    let fits_with = |c: &DeployConfig, part: Part| {
        kind.as_ref().is_none_or(|k| {
            vlm_backends::sizing(c, k, &opts)
                .is_ok_and(|s| plan::plan_only(c, &dims, k, s.as_ref(), &opts).part_fits(part))
        })
    };
    let mut out = serde_json::Map::new();

    if let Some(path) = &a.traffic {
        let text = read(path)?;
        let sizes = buckets::parse_traffic(&text)?;
        let mut samples =
            buckets::image_samples(&sizes, cfg.visual.min_pixels, cfg.visual.max_pixels)?;
        // Each video temporal group is one ViT run (the checkpoint's video processor settings).
        let videos = buckets::parse_video_traffic(&text)?;
        samples.extend(buckets::video_samples(
            &videos,
            &vlm_config::video::VideoProcessorConfig::default(),
        )?);
        let cost = CostModel::vit(&dims);
        let fits = |set: &[u64]| {
            let mut c = cfg.clone();
            c.visual.max_seq_len = set.iter().map(|&b| b as u32).collect();
            fits_with(&c, Part::Visual)
        };
        let best = buckets::choose(&samples, a.max_buckets, None, &cost, &fits)?;
        let largest = buckets::evaluate(&samples, &best.buckets[best.buckets.len() - 1..], &cost);
        let current: Vec<u64> = cfg.visual.max_seq_len.iter().map(|&b| b as u64).collect();
        let current = buckets::evaluate(&samples, &current, &cost);
        if !a.json {
            println!(
                "ViT buckets for {} images, at most {} buckets; cost(b) = a*b + c*b^2 FLOPs, a = {:.4e}, c = {:.4e}{}",
                samples.len(),
                a.max_buckets,
                cost.a,
                cost.c,
                kind.as_ref().map(|k| format!("; memory checked on {}", k.name)).unwrap_or_default()
            );
            println!("{}", line("recommended", &best, best.expected_cost));
            println!("{}", line("single largest", &largest, best.expected_cost));
            println!("{}", line("current config", &current, best.expected_cost));
            println!("visual.max_seq_len: {:?}", best.buckets);
        }
        out.insert(
            "vit".into(),
            serde_json::json!({ "cost_model": cost, "recommended": best, "single_largest": largest, "current": current }),
        );
    }

    if let Some(path) = &a.batch_log {
        let log = buckets::parse_batch_log(&read(path)?)?;
        let observed_max = log.iter().copied().max().unwrap_or(1);
        let batch_size = if a.config.is_some() {
            cfg.batch_size as u64
        } else {
            observed_max
        };
        if observed_max > batch_size {
            bail!("the batch log has an active batch of {observed_max}, over the config's batch_size {batch_size}");
        }
        let samples: Vec<(u64, f64)> = log.iter().map(|&b| (b, 1.0)).collect();
        let cost = CostModel::decode(&dims);
        let fits = |set: &[u64]| {
            let mut c = cfg.clone();
            c.batch_size = batch_size as u32;
            c.decoder_batch_sizes = set.iter().map(|&b| b as u32).collect();
            fits_with(&c, Part::Lm)
        };
        let best = buckets::choose(&samples, a.max_buckets, Some(batch_size), &cost, &fits)?;
        let single = buckets::evaluate(&samples, &[batch_size], &cost);
        let current: Vec<u64> = cfg.decoder_batch_sizes.iter().map(|&b| b as u64).collect();
        let current = buckets::evaluate(&samples, &current, &cost);
        if !a.json {
            println!(
                "decode graphs for {} steps, batch_size {batch_size}, at most {} graphs; cost(b) = {:.4e} FLOPs x b",
                samples.len(),
                a.max_buckets,
                cost.a
            );
            println!("{}", line("recommended", &best, best.expected_cost));
            println!("{}", line("batch_size only", &single, best.expected_cost));
            if a.config.is_some() {
                println!("{}", line("current config", &current, best.expected_cost));
            }
            println!("decoder_batch_sizes: {:?}", best.buckets);
        }
        out.insert(
            "decoder".into(),
            serde_json::json!({ "cost_model": cost, "batch_size": batch_size, "recommended": best, "batch_size_only": single, "current": current }),
        );
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(ExitCode::SUCCESS)
}
