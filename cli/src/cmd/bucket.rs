//! `vlm bucket`: which ViT bucket an image lands in, and which decode graph a batch runs.
use anyhow::Context;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;
use vlm_config::DeployConfig;

#[derive(Args, Debug)]
pub struct BucketArgs {
    /// The deployment config (defaults apply when omitted).
    #[arg(long, env = "VLM_CONFIG")]
    config: Option<PathBuf>,
    /// An image size WxH: resized like Qwen3-VL's processor (smart_resize, factor 32, the
    /// config's visual.min_pixels / visual.max_pixels).
    #[arg(long, value_name = "WxH", conflicts_with = "patches")]
    image: Option<String>,
    /// A raw patch count, skipping the resize.
    #[arg(long)]
    patches: Option<u64>,
    /// An active decode batch: print the decode graph chosen for it.
    #[arg(long)]
    batch: Option<u32>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: BucketArgs) -> anyhow::Result<ExitCode> {
    let cfg = match &args.config {
        Some(path) => {
            let loaded = DeployConfig::from_path(path)
                .with_context(|| format!("config {}", path.display()))?;
            for w in &loaded.warnings {
                eprintln!("warning: {w}");
            }
            loaded.config
        }
        None => DeployConfig::default_config(),
    };
    if args.image.is_none() && args.patches.is_none() && args.batch.is_none() {
        anyhow::bail!("give --image WxH, --patches N or --batch N");
    }
    let mut out = serde_json::Map::new();
    let mut failed = false;
    if let Some(size) = &args.image {
        let (w, h) = parse_size(size)?;
        match cfg.visual.plan_image(w, h) {
            Ok(p) => {
                let g = p.geometry;
                if !args.json {
                    println!(
                        "image {w}x{h} -> resized {}x{}",
                        g.resized_width, g.resized_height
                    );
                    println!(
                        "grid (t, h, w) = ({}, {}, {})",
                        g.grid_t, g.grid_h, g.grid_w
                    );
                    println!("raw patches = {}", g.patches());
                    println!("image tokens = {}", g.tokens());
                    println!(
                        "vit bucket = {}{}",
                        p.bucket,
                        if p.downscaled {
                            " (downscaled to fit: visual.oversize = downscale)"
                        } else {
                            ""
                        }
                    );
                }
                out.insert("image".into(), serde_json::to_value(p)?);
            }
            Err(e) => {
                eprintln!("error: image {w}x{h}: {e}");
                out.insert("image_error".into(), e.to_string().into());
                failed = true;
            }
        }
    }
    if let Some(n) = args.patches {
        match cfg.visual.bucket_for(n) {
            Ok(b) => {
                if !args.json {
                    println!("patches {n} -> vit bucket {b}");
                }
                out.insert("vit_bucket".into(), b.into());
            }
            Err(e) => {
                eprintln!("error: {e}");
                out.insert("vit_bucket_error".into(), e.to_string().into());
                failed = true;
            }
        }
    }
    if let Some(n) = args.batch {
        match cfg.decoder_graph_for(n) {
            Ok(b) => {
                if !args.json {
                    println!(
                        "active batch {n} -> decoder_batch_{b} (graphs {:?})",
                        cfg.decoder_batch_sizes
                    );
                }
                out.insert("decoder_graph".into(), b.into());
            }
            Err(e) => {
                eprintln!("error: {e}");
                out.insert("decoder_graph_error".into(), e.to_string().into());
                failed = true;
            }
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn parse_size(s: &str) -> anyhow::Result<(u32, u32)> {
    let (w, h) = s
        .split_once(['x', 'X'])
        .with_context(|| format!("image size {s:?} is not WxH (e.g. 1024x768)"))?;
    Ok((
        w.trim()
            .parse()
            .with_context(|| format!("width in {s:?}"))?,
        h.trim()
            .parse()
            .with_context(|| format!("height in {s:?}"))?,
    ))
}
