//! `vlm inspect`: runs one prompt through the whole model in process (preprocessing, ViT,
//! prefill, greedy decoding) and writes every intermediate a comparison with the reference
//! needs into one safetensors file.
use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor};
use clap::Args;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;
use vlm_backend_cpu::{CpuKernels, CpuOptions};
use vlm_compute::{HostTensor, Qwen3VlConfig};
use vlm_config::video::{Sampling, VideoGeometry, VideoProcessorConfig};
use vlm_make_model::WeightDtype;
use vlm_model::oracle::Oracle;
use vlm_preprocess::{decode_image, preprocess_rgb, PixelValues, PreprocessConfig};
use vlm_tokenizer::{ChatMessage, ChatPart, ChatTokenizer, VisionTokens};

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt", "input_ids"])))]
pub struct InspectArgs {
    /// Checkpoint directory (config.json, safetensors, tokenizer files).
    #[arg(long)]
    pub model: PathBuf,
    /// Image file (PNG, JPEG, WebP, GIF, BMP, TIFF). Repeat for several images, in prompt order.
    #[arg(long)]
    pub image: Vec<PathBuf>,
    /// Video file (MP4/MOV, WebM/MKV or AVI), sampled, resized and laid out as Qwen3-VL's video
    /// processor does (the checkpoint's video_preprocessor_config.json, else fps 2). Repeat for
    /// several; videos follow the images in the prompt.
    #[arg(long)]
    pub video: Vec<PathBuf>,
    /// User text: rendered with the checkpoint's chat template as one user turn holding the
    /// images then this text, with the generation prompt; each image's placeholder is expanded
    /// to its token count.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Raw prompt ids, comma separated, whose `<|image_pad|>` runs are already expanded
    /// (one run of t*h*w/4 per image).
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub input_ids: Option<Vec<u32>>,
    /// Output safetensors file.
    #[arg(long)]
    pub out: PathBuf,
    /// Greedy tokens to generate.
    #[arg(long, default_value_t = 8)]
    pub max_new_tokens: usize,
    /// Generate exactly --max-new-tokens tokens, not stopping at an end-of-sequence token (as
    /// the reference's golden data does).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Dtype the weights are held in while computing (activations stay f32).
    #[arg(long, default_value = "f32")]
    pub dtype: WeightDtype,
    /// Override the processor's `size.shortest_edge` (minimum pixels after resize).
    #[arg(long)]
    pub min_pixels: Option<u64>,
    /// Override the processor's `size.longest_edge` (maximum pixels after resize).
    #[arg(long)]
    pub max_pixels: Option<u64>,
}

pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let dir = &args.model;
    let config =
        Qwen3VlConfig::from_dir(dir).with_context(|| format!("checkpoint {}", dir.display()))?;
    let pp = preprocess_config(dir, &config, &args)?;
    let dtype = match args.dtype {
        WeightDtype::F32 => DType::F32,
        WeightDtype::F16 => DType::F16,
        WeightDtype::BF16 => DType::BF16,
    };

    // 1. images -> pixel values
    let mut pixels: Vec<PixelValues> = Vec::new();
    for path in &args.image {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let img = decode_image(&bytes, pp.max_decode_pixels)
            .with_context(|| format!("decoding {}", path.display()))?;
        let p = preprocess_rgb(&img, &pp)
            .with_context(|| format!("preprocessing {}", path.display()))?;
        println!(
            "image {}: {}x{} -> grid (t, h, w) = {:?}, {} patches, {} tokens",
            path.display(),
            img.width(),
            img.height(),
            p.grid_thw,
            p.rows(),
            p.rows() / config.vision.merge_unit()
        );
        pixels.push(p);
    }
    let counts: Vec<usize> = pixels
        .iter()
        .map(|p| p.rows() / config.vision.merge_unit())
        .collect();
    let mut vision: Vec<VisionTokens> = counts.iter().map(|&n| VisionTokens::Image(n)).collect();
    let images = pixels.len();
    let video_cfg = match std::fs::read_to_string(dir.join("video_preprocessor_config.json")) {
        Ok(text) => VideoProcessorConfig::from_json(&text)
            .map_err(|e| anyhow::anyhow!("video_preprocessor_config.json: {e}"))?,
        Err(_) => VideoProcessorConfig::default(),
    };
    for path in &args.video {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let info = vlm_preprocess::read_video_info(&bytes)
            .with_context(|| format!("reading {}", path.display()))?;
        let g = VideoGeometry::plan(
            info.width,
            info.height,
            info.frames,
            info.fps,
            Sampling::Default,
            &video_cfg,
        )
        .with_context(|| format!("planning {}", path.display()))?;
        let frames = vlm_preprocess::decode_video_frames(&bytes, &g.indices, pp.max_decode_pixels)
            .with_context(|| format!("decoding {}", path.display()))?;
        for (a, b) in vlm_preprocess::temporal_groups(&frames, g.resized_width, g.resized_height)? {
            pixels.push(vlm_preprocess::preprocess_video_group(&[&a, &b], &pp)?);
        }
        println!(
            "video {}: {}x{}, {} frames at {:?} fps -> frames {:?} at {}x{}, {} temporal groups of \
             grid {:?}, {} tokens each, timestamps {:?}",
            path.display(),
            info.width,
            info.height,
            info.frames,
            info.fps,
            g.indices,
            g.resized_width,
            g.resized_height,
            g.groups(),
            g.group_grid(),
            g.group_tokens(),
            g.timestamps
        );
        vision.push(VisionTokens::Video {
            tokens_per_group: g.group_tokens() as usize,
            timestamps: g.timestamps.clone(),
        });
    }

    // 2. prompt ids
    let tokenizer = match ChatTokenizer::from_dir(dir) {
        Ok(t) => Some(t),
        Err(e) if args.input_ids.is_some() => {
            eprintln!("note: no usable tokenizer ({e}); ids will not be decoded");
            None
        }
        Err(e) => return Err(e).context("loading the tokenizer"),
    };
    let input_ids: Vec<u32> = match (&args.prompt, &args.input_ids) {
        (Some(text), None) => {
            let tok = tokenizer
                .as_ref()
                .context("--prompt needs the checkpoint's tokenizer")?;
            let mut parts = vec![ChatPart::Image; images];
            parts.extend(std::iter::repeat_n(ChatPart::Video, args.video.len()));
            parts.push(ChatPart::Text(text.clone()));
            tok.encode_prompt_vision(&[ChatMessage::user(parts)], &[], &vision, usize::MAX)?
        }
        (None, Some(ids)) => ids.clone(),
        _ => bail!("give exactly one of --prompt and --input-ids"),
    };
    let video_tokens: usize = vision
        .iter()
        .map(|v| match v {
            VisionTokens::Video {
                tokens_per_group,
                timestamps,
            } => tokens_per_group * timestamps.len(),
            VisionTokens::Image(_) => 0,
        })
        .sum();
    println!(
        "prompt: {} tokens ({} image tokens, {video_tokens} video tokens)",
        input_ids.len(),
        counts.iter().sum::<usize>()
    );

    // 3. model
    let start = Instant::now();
    // The oracle on the CPU backend's kernels, as this machine detects them.
    let kernels = CpuKernels::new(CpuOptions::detect());
    let pipeline = Oracle::load(&kernels, dir, dtype).context("loading the model")?;
    println!("loaded in {:.2} s", start.elapsed().as_secs_f64());

    let start = Instant::now();
    let images = pipeline.encode_images(&pixels)?;
    println!("vision: {:.3} s", start.elapsed().as_secs_f64());

    let eos: Vec<u32> = if args.ignore_eos {
        Vec::new()
    } else if let Some(tok) = &tokenizer {
        tok.eos_ids().to_vec()
    } else {
        config.eos_token_ids.clone()
    };
    let start = Instant::now();
    let (last_logits, generated, step_logits, positions, rope_delta) = if args.max_new_tokens == 0 {
        let logits = pipeline.prefill(&input_ids, &images)?;
        let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid_thw).collect();
        let layout = vlm_compute::PromptLayout::infer(&input_ids, &grids, &config)?;
        (
            logits,
            Vec::new(),
            None,
            layout.positions,
            layout.rope_delta,
        )
    } else {
        let out = pipeline.generate_greedy(&input_ids, &images, args.max_new_tokens, &eos)?;
        let last = out.step_logits.get(0)?;
        (
            last,
            out.tokens,
            Some(out.step_logits),
            out.positions,
            out.rope_delta,
        )
    };
    println!(
        "prefill + {} decode steps: {:.3} s",
        generated.len().saturating_sub(1),
        start.elapsed().as_secs_f64()
    );
    println!("generated ids: {generated:?}");
    if let Some(tok) = &tokenizer {
        println!("generated text: {:?}", tok.decode(&generated)?);
    }

    // 4. tensors
    let cpu = Device::Cpu;
    let ids_tensor = |ids: &[u32], shape: &[usize]| -> candle_core::Result<Tensor> {
        Tensor::from_vec(
            ids.iter().map(|&i| i as i64).collect::<Vec<_>>(),
            shape,
            &cpu,
        )
    };
    let host = |t: &HostTensor| Tensor::from_vec(t.to_f32(), t.shape(), &cpu);
    let mut out: HashMap<String, Tensor> = HashMap::new();
    if !pixels.is_empty() {
        let values: Vec<Tensor> = pixels
            .iter()
            .map(|p| Tensor::from_vec(p.values.clone(), (p.rows(), p.row_len()), &cpu))
            .collect::<candle_core::Result<_>>()?;
        out.insert(
            "pixel_values".into(),
            Tensor::cat(&values, 0)?.to_dtype(DType::F32)?,
        );
        let grids: Vec<i64> = pixels
            .iter()
            .flat_map(|p| p.grid_thw.map(|x| x as i64))
            .collect();
        out.insert(
            "image_grid_thw".into(),
            Tensor::from_vec(grids, (pixels.len(), 3), &cpu)?,
        );
        let embeds: Vec<Tensor> = images
            .iter()
            .map(|i| host(&i.embeds))
            .collect::<candle_core::Result<_>>()?;
        out.insert(
            "image_embeds".into(),
            Tensor::cat(&embeds, 0)?.to_dtype(DType::F32)?,
        );
        let levels = images.first().map_or(0, |i| i.deepstack.len());
        for k in 0..levels {
            let level: Vec<Tensor> = images
                .iter()
                .map(|i| host(&i.deepstack[k]))
                .collect::<candle_core::Result<_>>()?;
            out.insert(
                format!("deepstack_{k}"),
                Tensor::cat(&level, 0)?.to_dtype(DType::F32)?,
            );
        }
    }
    let len = input_ids.len();
    out.insert("input_ids".into(), ids_tensor(&input_ids, &[1, len])?);
    let mut pos = Vec::with_capacity(3 * len);
    for axis in 0..3 {
        pos.extend(positions.iter().take(len).map(|p| p[axis]));
    }
    out.insert(
        "position_ids".into(),
        Tensor::from_vec(pos, (3, len), &cpu)?,
    );
    out.insert(
        "rope_deltas".into(),
        Tensor::from_vec(vec![rope_delta], 1, &cpu)?,
    );
    out.insert("last_logits".into(), last_logits.to_dtype(DType::F32)?);
    out.insert(
        "generated_ids".into(),
        ids_tensor(&generated, &[generated.len()])?,
    );
    if let Some(steps) = step_logits {
        out.insert("step_logits".into(), steps.to_dtype(DType::F32)?);
    }
    if let Some(parent) = args.out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    candle_core::safetensors::save(&out, &args.out)
        .with_context(|| format!("writing {}", args.out.display()))?;
    let mut names: Vec<_> = out
        .iter()
        .map(|(k, v)| format!("{k} {:?}", v.dims()))
        .collect();
    names.sort();
    println!("wrote {}: {}", args.out.display(), names.join(", "));
    Ok(())
}

/// The checkpoint's `preprocessor_config.json` (when present) over Qwen3-VL's defaults, with
/// the patch geometry taken from the vision config and the command line's pixel overrides.
fn preprocess_config(
    dir: &Path,
    config: &Qwen3VlConfig,
    args: &InspectArgs,
) -> anyhow::Result<PreprocessConfig> {
    let v = &config.vision;
    let mut pp = PreprocessConfig {
        patch_size: v.patch_size,
        merge_size: v.spatial_merge_size,
        temporal_patch_size: v.temporal_patch_size,
        ..PreprocessConfig::default()
    };
    let path = dir.join("preprocessor_config.json");
    if path.is_file() {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let num = |keys: &[&[&str]]| {
            keys.iter().find_map(|k| {
                k.iter()
                    .try_fold(&json, |j, key| j.get(*key))
                    .and_then(|x| x.as_u64())
            })
        };
        if let Some(n) = num(&[&["size", "shortest_edge"], &["min_pixels"]]) {
            pp.min_pixels = n;
        }
        if let Some(n) = num(&[&["size", "longest_edge"], &["max_pixels"]]) {
            pp.max_pixels = n;
        }
        for (key, want) in [
            ("patch_size", v.patch_size),
            ("merge_size", v.spatial_merge_size),
            ("temporal_patch_size", v.temporal_patch_size),
        ] {
            if let Some(got) = num(&[&[key]]) {
                if got as usize != want {
                    bail!(
                        "{}: {key} is {got} but config.json's vision_config says {want}",
                        path.display()
                    );
                }
            }
        }
    }
    if let Some(n) = args.min_pixels {
        pp.min_pixels = n;
    }
    if let Some(n) = args.max_pixels {
        pp.max_pixels = n;
    }
    Ok(pp)
}
