//! The ViT and the image preprocessing against the reference goldens in `fixtures`
//! (transformers' Qwen3-VL on tiny random checkpoints; see its README.md), on every backend:
//! the exact forward (the oracle) with the CPU kernels, the CPU bucket engine, the candle
//! backend's padded forward.
//!
//! - preprocessing (decoded RGB -> pixel values) within 1/127.5 per value of the PIL backend;
//! - ViT intermediates, merged embeddings and deepstack features within 1e-4 relative (f32),
//!   fed the pixel values the reference model was fed;
//! - the bucketed (padded, masked) run equals the unpadded run.
//!
//! Image decoding (limits, corrupt data, alpha, GIF) is `preprocess/tests/decode_image.rs`.
use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use vlm_backend_cpu::{CpuKernels, CpuOptions};
use vlm_compute::{HostTensor, VisionBackend};
use vlm_model::vision::{VisionModel, VisionTrace};
use vlm_preprocess::{
    decode_image, preprocess_rgb, read_image_size, PixelValues, PreprocessConfig,
};

/// `VLM_MODEL_FIXTURES` or this checkout's fixtures (as `text_support::fixtures_dir`).
fn fixtures() -> PathBuf {
    std::env::var_os("VLM_MODEL_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(vlm_test_support::fixtures_dir)
}

/// A bucketed ViT backend of this test: the CPU engine or candle's padded forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    CpuEngine,
    Candle,
    /// The CUDA backend on GPU 0 (a `cuda` build on a machine with a GPU).
    #[cfg(feature = "cuda")]
    Cuda,
}

/// The backends this build can run here: with `cuda`, candle's ops run on the GPU too, so a
/// `cuda` build is only tested where a GPU opens.
fn backends() -> Vec<Backend> {
    #[cfg(feature = "cuda")]
    {
        if let Err(e) = vlm_backend_cuda::gpu::device::open(0) {
            vlm_test_support::skip!("the candle and cuda ViT backends: no CUDA GPU here ({e})");
            return vec![Backend::CpuEngine];
        }
        vec![Backend::CpuEngine, Backend::Candle, Backend::Cuda]
    }
    #[cfg(not(feature = "cuda"))]
    vec![Backend::CpuEngine, Backend::Candle]
}

fn config_dtype(d: DType) -> vlm_config::Dtype {
    match d {
        DType::F16 => vlm_config::Dtype::F16,
        DType::BF16 => vlm_config::Dtype::Bf16,
        _ => vlm_config::Dtype::F32,
    }
}

/// The ViT of `ckpt` prepared at `buckets` on one device of `backend`.
fn bucketed(
    ckpt: &Path,
    dtype: DType,
    buckets: &[usize],
    backend: Backend,
) -> Box<dyn VisionBackend> {
    match backend {
        Backend::CpuEngine => Box::new(
            vlm_backend_cpu::vit::load(
                ckpt,
                config_dtype(dtype),
                buckets,
                &[0],
                CpuOptions::detect(),
            )
            .unwrap()
            .remove(0),
        ),
        Backend::Candle => Box::new(
            vlm_backend_candle::vision::load(ckpt, config_dtype(dtype), buckets, &[0])
                .unwrap()
                .remove(0),
        ),
        #[cfg(feature = "cuda")]
        Backend::Cuda => Box::new(
            vlm_backend_cuda::gpu::vision::load(ckpt, config_dtype(dtype), buckets, &[0])
                .unwrap()
                .remove(0),
        ),
    }
}

/// A host tensor as a CPU tensor.
fn tensor(h: &HostTensor) -> Tensor {
    Tensor::from_vec(h.to_f32(), h.shape(), &Device::Cpu).unwrap()
}

/// Pixel rows of a tensor as the preprocessor's output type.
fn pixels(values: &Tensor, grid: [usize; 3]) -> PixelValues {
    PixelValues {
        values: values.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        grid_thw: grid,
    }
}

/// The preprocessor's pixel values as a (rows, row_len) tensor.
fn pv_tensor(pv: &PixelValues) -> Tensor {
    Tensor::from_vec(pv.values.clone(), (pv.rows(), pv.row_len()), &Device::Cpu).unwrap()
}

struct Image {
    rgb_key: String,
    file: String,
    grid: [usize; 3],
    /// Rows of this image in the case's concatenated pixel values.
    pixel_rows: (usize, usize),
    merged_rows: (usize, usize),
}

struct Case {
    name: String,
    dir: PathBuf,
    ckpt: PathBuf,
    fed: String,
    cfg: PreprocessConfig,
    images: Vec<Image>,
    golden: HashMap<String, Tensor>,
}

fn grid_of(v: &Value) -> [usize; 3] {
    let g = &v["image_grid_thw"][0];
    [0, 1, 2].map(|i| g[i].as_u64().expect("grid") as usize)
}

fn cases() -> Vec<Case> {
    let root = fixtures();
    let index_path = root.join("index.json");
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(&index_path)
            .unwrap_or_else(|e| panic!("{}: {e}", index_path.display())),
    )
    .expect("index.json");
    let mut out = Vec::new();
    for c in index["cases"].as_array().expect("cases") {
        let dir = root.join(c["dir"].as_str().expect("dir"));
        let ckpt = root.join(c["checkpoint"].as_str().expect("checkpoint"));
        let meta: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("golden.json")).expect("golden.json"),
        )
        .expect("golden.json parses");
        let fed = c["backend_fed_to_model"].as_str().expect("fed").to_string();
        let (proc_meta, images) = if let Some(list) = meta["images"].as_array() {
            let merge = 4;
            let imgs = list
                .iter()
                .enumerate()
                .map(|(j, im)| {
                    let pr = &im["pixel_rows"];
                    let (a, b) = (
                        pr[0].as_u64().unwrap() as usize,
                        pr[1].as_u64().unwrap() as usize,
                    );
                    Image {
                        rgb_key: format!("image{j}_rgb_u8"),
                        file: im["file"].as_str().unwrap().to_string(),
                        grid: grid_of(im),
                        pixel_rows: (a, b),
                        merged_rows: (a / merge, b / merge),
                    }
                })
                .collect();
            (meta["processor"].clone(), imgs)
        } else {
            let im = &meta["image"];
            let grid = grid_of(im);
            let n = grid.iter().product::<usize>();
            let img = Image {
                rgb_key: "image_rgb_u8".into(),
                file: im["file"].as_str().unwrap().to_string(),
                grid,
                pixel_rows: (0, n),
                merged_rows: (0, n / 4),
            };
            (im["processor"].clone(), vec![img])
        };
        let cfg = PreprocessConfig {
            min_pixels: proc_meta["min_pixels"].as_u64().unwrap_or(65536),
            max_pixels: proc_meta["max_pixels"].as_u64().unwrap_or(16777216),
            ..PreprocessConfig::default()
        };
        let golden = candle_core::safetensors::load(dir.join("golden.safetensors"), &Device::Cpu)
            .expect("golden.safetensors");
        out.push(Case {
            name: c["name"].as_str().unwrap().to_string(),
            dir,
            ckpt,
            fed,
            cfg,
            images,
            golden,
        });
    }
    assert!(!out.is_empty(), "no cases in {}", index_path.display());
    out
}

/// (max |a - b|, max |a - b| / max |b|).
fn diff(a: &Tensor, b: &Tensor) -> (f32, f32) {
    assert_eq!(a.dims(), b.dims(), "shape mismatch");
    let a = a.to_dtype(DType::F32).unwrap();
    let b = b.to_dtype(DType::F32).unwrap();
    let d = (&a - &b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let s = b
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    (d, d / s.max(1e-30))
}

fn rgb_of(t: &Tensor) -> image::RgbImage {
    let (h, w, _) = t.dims3().unwrap();
    let data = t.flatten_all().unwrap().to_vec1::<u8>().unwrap();
    image::RgbImage::from_raw(w as u32, h as u32, data).unwrap()
}

fn rows(t: &Tensor, (a, b): (usize, usize)) -> Tensor {
    t.narrow(0, a, b - a).unwrap()
}

#[test]
fn preprocess_matches_pil_backend() {
    let tol = 1.0 / 127.5 + 1e-6;
    for case in cases() {
        for im in &case.images {
            let rgb = rgb_of(&case.golden[&im.rgb_key]);
            let pv = preprocess_rgb(&rgb, &case.cfg).unwrap();
            assert_eq!(pv.grid_thw, im.grid, "{} {}: grid", case.name, im.file);
            for backend in ["pil", "torchvision"] {
                let Some(reference) = case.golden.get(&format!("pixel_values_{backend}")) else {
                    continue;
                };
                let reference = rows(reference, im.pixel_rows);
                let (max_abs, _) = diff(&pv_tensor(&pv), &reference);
                let differing = (&pv_tensor(&pv) - &reference)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .gt(1e-6)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .mean_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                println!(
                    "preprocess {}/{}: vs {backend}: max abs {max_abs:.3e} ({:.2} levels), {:.4}% of values differ",
                    case.name,
                    im.file,
                    max_abs * 127.5,
                    differing * 100.0
                );
                if backend == "pil" {
                    assert!(
                        max_abs <= tol,
                        "{} {}: max abs diff {max_abs} vs PIL",
                        case.name,
                        im.file
                    );
                }
            }
        }
    }
}

#[test]
fn decoded_inputs_match_reference_rgb() {
    // Our decoder on the exact files the reference decoded. PNG is lossless and must match
    // exactly (including the alpha composite); JPEG decoders may differ by a level or two.
    for case in cases() {
        for im in &case.images {
            let bytes = std::fs::read(case.dir.join(&im.file)).unwrap();
            let ours = decode_image(&bytes, 1 << 30).unwrap();
            let theirs = rgb_of(&case.golden[&im.rgb_key]);
            assert_eq!(ours.dimensions(), theirs.dimensions());
            assert_eq!(read_image_size(&bytes).unwrap(), theirs.dimensions());
            let max = ours
                .as_raw()
                .iter()
                .zip(theirs.as_raw())
                .map(|(a, b)| (*a as i32 - *b as i32).abs())
                .max()
                .unwrap_or(0);
            println!(
                "decode {}/{}: max diff vs PIL {max} levels",
                case.name, im.file
            );
            if im.file.ends_with(".png") {
                assert_eq!(
                    max, 0,
                    "{} {}: PNG decode differs from PIL",
                    case.name, im.file
                );
            } else {
                assert!(
                    max <= 8,
                    "{} {}: JPEG decode differs by {max} levels",
                    case.name,
                    im.file
                );
            }
        }
    }
}

/// The exact forward (the oracle) with the CPU backend's kernels.
fn load(ckpt: &Path, dtype: DType) -> VisionModel<CpuKernels> {
    VisionModel::load(&CpuKernels::new(CpuOptions::detect()), ckpt, dtype).unwrap()
}

#[test]
fn vision_matches_reference() {
    let mut models: HashMap<PathBuf, VisionModel<CpuKernels>> = HashMap::new();
    for case in cases() {
        let model = models
            .entry(case.ckpt.clone())
            .or_insert_with(|| load(&case.ckpt, DType::F32));
        let pv_all = &case.golden[&format!("pixel_values_{}", case.fed)];
        let mut merged = Vec::new();
        let mut deepstack: Vec<Vec<Tensor>> = Vec::new();
        let mut traces = Vec::new();
        for im in &case.images {
            let pv = rows(pv_all, im.pixel_rows);
            let mut trace = VisionTrace::default();
            let out = model
                .forward_traced(&pv, im.grid, Some(&mut trace))
                .unwrap();
            assert_eq!(out.grid_thw, im.grid);
            assert_eq!(
                out.embeds.dim(0).unwrap(),
                im.merged_rows.1 - im.merged_rows.0
            );
            merged.push(out.embeds);
            for (k, d) in out.deepstack.into_iter().enumerate() {
                if deepstack.len() <= k {
                    deepstack.push(Vec::new());
                }
                deepstack[k].push(d);
            }
            traces.push(trace);
        }
        let cat = |v: &[Tensor]| Tensor::cat(v, 0).unwrap();
        let mut checks: Vec<(String, Tensor)> = vec![
            (
                "vision.patch_embed_out".into(),
                cat(&traces
                    .iter()
                    .map(|t| t.patch_embed_out.clone().unwrap())
                    .collect::<Vec<_>>()),
            ),
            (
                "vision.block_input".into(),
                cat(&traces
                    .iter()
                    .map(|t| t.block_input.clone().unwrap())
                    .collect::<Vec<_>>()),
            ),
        ];
        for i in 0..model.config().depth {
            checks.push((
                format!("vision.block{i}_out"),
                cat(&traces
                    .iter()
                    .map(|t| t.block_out[i].clone())
                    .collect::<Vec<_>>()),
            ));
        }
        checks.push(("vision.merged".into(), cat(&merged)));
        for (k, d) in deepstack.iter().enumerate() {
            checks.push((format!("vision.deepstack{k}"), cat(d)));
        }
        assert_eq!(
            deepstack.len(),
            model.config().deepstack_visual_indexes.len()
        );
        // The bucketed CPU engine (padded to a bucket) against the reference too.
        let graphs = bucketed(&case.ckpt, DType::F32, &[1024], Backend::CpuEngine);
        let mut g_merged = Vec::new();
        let mut g_deep: Vec<Vec<Tensor>> = vec![Vec::new(); deepstack.len()];
        for im in &case.images {
            let pv = pixels(&rows(pv_all, im.pixel_rows), im.grid);
            let run = graphs.encode(&pv).unwrap();
            g_merged.push(tensor(&run.embeds.embeds));
            for (k, d) in run.embeds.deepstack.iter().enumerate() {
                g_deep[k].push(tensor(d));
            }
        }
        checks.push(("bucketed:vision.merged".into(), cat(&g_merged)));
        for (k, d) in g_deep.iter().enumerate() {
            checks.push((format!("bucketed:vision.deepstack{k}"), cat(d)));
        }
        for (label, ours) in &checks {
            let name = label.trim_start_matches("bucketed:");
            let reference = case
                .golden
                .get(name)
                .unwrap_or_else(|| panic!("{}: no {name}", case.name));
            let (abs, rel) = diff(ours, reference);
            println!(
                "vision {}: {label}: max abs {abs:.3e}, rel {rel:.3e}",
                case.name
            );
            assert!(
                rel <= 1e-4,
                "{}: {label} differs: max abs {abs}, rel {rel}",
                case.name
            );
        }
        // The rope tables, where the case holds them (golden: cat(cos, cos) over hd).
        if let (Some(gc), Some(gs), [im]) = (
            case.golden.get("vision.rope_cos"),
            case.golden.get("vision.rope_sin"),
            case.images.as_slice(),
        ) {
            let rows = im.grid.iter().product();
            let (cos, sin) = model.rope.forward(im.grid, rows, &Device::Cpu).unwrap();
            let half = cos.dim(1).unwrap();
            for (name, ours, reference) in [("cos", &cos, gc), ("sin", &sin, gs)] {
                for part in 0..2 {
                    let (abs, _) = diff(ours, &reference.narrow(1, part * half, half).unwrap());
                    assert!(abs <= 1e-5, "{}: rope {name} differs by {abs}", case.name);
                }
            }
        }
    }
}

#[test]
fn bucketed_run_equals_unpadded_run() {
    let mut seen = std::collections::HashSet::new();
    for case in cases() {
        if !seen.insert(case.ckpt.clone()) {
            continue;
        }
        let model = load(&case.ckpt, DType::F32);
        let pv_all = &case.golden[&format!("pixel_values_{}", case.fed)];
        for im in &case.images {
            let n: usize = im.grid.iter().product();
            let pv = pixels(&rows(pv_all, im.pixel_rows), im.grid);
            let exact = model.forward(&pv_tensor(&pv), im.grid).unwrap();
            // A bucket with padding (n + 100 rounded to 4), and one that fits exactly.
            let padded = (n + 100).div_ceil(4) * 4;
            let configs = backends()
                .into_iter()
                .flat_map(|b| [(b, vec![8, padded, 4 * padded]), (b, vec![n])]);
            for (backend, buckets) in configs {
                let graphs = bucketed(&case.ckpt, DType::F32, &buckets, backend);
                let run = graphs.encode(&pv).unwrap();
                let want_bucket = graphs.bucket_for(n).unwrap();
                assert_eq!(run.bucket, want_bucket);
                assert!(
                    (run.padding_fraction - (want_bucket - n) as f32 / want_bucket as f32).abs()
                        < 1e-6
                );
                let memory = graphs.memory();
                assert!(memory
                    .buckets
                    .iter()
                    .any(|b| b.bucket == want_bucket && b.bytes > 0));
                let (abs, rel) = diff(&tensor(&run.embeds.embeds), &exact.embeds);
                println!(
                    "bucketed {backend:?} {}/{} bucket {} (n {n}): merged max abs {abs:.3e}, rel {rel:.3e}",
                    case.name, im.file, run.bucket
                );
                assert!(
                    rel <= 1e-5,
                    "{}: bucketed merged differs: {abs} / {rel}",
                    case.name
                );
                assert_eq!(run.embeds.deepstack.len(), exact.deepstack.len());
                for (a, b) in run.embeds.deepstack.iter().zip(&exact.deepstack) {
                    let (abs, rel) = diff(&tensor(a), b);
                    println!(
                        "bucketed {backend:?} {}/{}: deepstack max abs {abs:.3e}, rel {rel:.3e}",
                        case.name, im.file
                    );
                    assert!(
                        rel <= 1e-5,
                        "{}: bucketed deepstack differs: {abs} / {rel}",
                        case.name
                    );
                }
                assert_eq!(run.embeds.grid_thw, im.grid);
            }
            // Over the largest bucket: a clear error naming both numbers.
            let graphs = bucketed(&case.ckpt, DType::F32, &[8], Backend::CpuEngine);
            let err = graphs.encode(&pv).unwrap_err().to_string();
            assert!(
                err.contains(&n.to_string()) && err.contains("8 patches"),
                "{err}"
            );
            assert_eq!(graphs.bucket_for(n), None);
        }
    }
}

#[test]
fn f16_weights_stay_close() {
    let case = cases().into_iter().next().unwrap();
    let im = &case.images[0];
    let pv = rows(
        &case.golden[&format!("pixel_values_{}", case.fed)],
        im.pixel_rows,
    );
    let model = load(&case.ckpt, DType::F16);
    let out = model.forward(&pv, im.grid).unwrap();
    let (abs, rel) = diff(&out.embeds, &case.golden["vision.merged"]);
    println!(
        "f16 weights {}: merged max abs {abs:.3e}, rel {rel:.3e}",
        case.name
    );
    assert!(rel <= 2e-2, "f16 merged rel diff {rel}");
}

#[test]
fn bf16_engine_stays_close_to_the_reference() {
    // bf16 weights and bf16 products (f32 accumulation), as the reference run in bfloat16: on a
    // CPU with AVX512-BF16 the bucket engine runs every linear and both attention products on
    // the bf16 kernel, including padded buckets with masked key tiles; elsewhere candle ops.
    for case in cases() {
        let pv_all = &case.golden[&format!("pixel_values_{}", case.fed)];
        let mut start = 0;
        for (i, im) in case.images.iter().enumerate() {
            let n: usize = im.grid.iter().product();
            let pv = pixels(&rows(pv_all, im.pixel_rows), im.grid);
            // A bucket of whole 32-row panels takes the fused AMX attention where the CPU has
            // AMX tiles; one that is not takes the unfused bf16 kernel.
            let mut tokens = 0;
            for padded in [(n + 100).div_ceil(4) * 4, (n + 100).next_multiple_of(32)] {
                let backend = if vlm_backend_cpu::kernels::bf16_dot_available() {
                    Backend::CpuEngine
                } else {
                    Backend::Candle
                };
                let graphs = bucketed(&case.ckpt, DType::BF16, &[padded], backend);
                let run = graphs.encode(&pv).unwrap();
                tokens = run.embeds.tokens();
                let want = case.golden["vision.merged"]
                    .narrow(0, start, tokens)
                    .unwrap();
                let (abs, rel) = diff(&tensor(&run.embeds.embeds), &want);
                println!(
                    "bf16 {backend:?} {}/{} (n {n}, bucket {padded}): merged max abs {abs:.3e}, rel {rel:.3e}",
                    case.name,
                    im.file
                );
                assert!(
                    rel <= 3e-2,
                    "{} image {i}: bf16 merged rel diff {rel}",
                    case.name
                );
                for (k, ds) in run.embeds.deepstack.iter().enumerate() {
                    let want = case.golden[&format!("vision.deepstack{k}")]
                        .narrow(0, start, tokens)
                        .unwrap();
                    let (_, rel) = diff(&tensor(ds), &want);
                    assert!(
                        rel <= 3e-2,
                        "{} image {i}: bf16 deepstack {k} rel diff {rel}",
                        case.name
                    );
                }
            }
            start += tokens;
        }
    }
}

#[test]
fn engine_matches_oracle_on_larger_and_multi_frame_grids() {
    // Grids big enough that attention runs in several query blocks per head, plus a two-frame
    // grid (attention restricted per frame), on random pixels.
    let ckpt = fixtures().join("tiny");
    let model = load(&ckpt, DType::F32);
    let dim = model.config().patch_dim();
    for (grid, bucket) in [([1, 40, 40], 1700), ([1, 6, 90], 560), ([2, 8, 12], 200)] {
        let n: usize = grid.iter().product();
        let values = Tensor::randn(0f32, 0.6, (n, dim), &Device::Cpu).unwrap();
        let exact = model.forward(&values, grid).unwrap();
        let pv = pixels(&values, grid);
        for backend in backends() {
            let graphs = bucketed(&ckpt, DType::F32, &[bucket], backend);
            let run = graphs.encode(&pv).unwrap();
            let mut pairs = vec![(tensor(&run.embeds.embeds), &exact.embeds)];
            pairs.extend(
                run.embeds
                    .deepstack
                    .iter()
                    .map(tensor)
                    .zip(&exact.deepstack),
            );
            for (a, b) in pairs {
                let (abs, rel) = diff(&a, b);
                println!(
                    "grid {grid:?} bucket {bucket} {backend:?}: max abs {abs:.3e}, rel {rel:.3e}"
                );
                assert!(rel <= 1e-5, "grid {grid:?} {backend:?}: {abs} / {rel}");
            }
        }
    }
}

/// Extra preprocessing goldens made with `golden.py --preprocess-only` (each dir holds
/// preprocess.json, preprocess.safetensors and the input image): set
/// `VLM_EXTRA_PREPROCESS=dir1:dir2:...`. Without it this test checks nothing.
#[test]
fn extra_preprocess_goldens_from_env() {
    let Some(dirs) = std::env::var_os("VLM_EXTRA_PREPROCESS") else {
        return;
    };
    for dir in std::env::split_paths(&dirs) {
        let meta: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("preprocess.json")).unwrap())
                .unwrap();
        let im = &meta["image"];
        let cfg = PreprocessConfig {
            min_pixels: im["processor"]["min_pixels"].as_u64().unwrap(),
            max_pixels: im["processor"]["max_pixels"].as_u64().unwrap(),
            ..PreprocessConfig::default()
        };
        let golden =
            candle_core::safetensors::load(dir.join("preprocess.safetensors"), &Device::Cpu)
                .unwrap();
        let bytes = std::fs::read(dir.join(im["file"].as_str().unwrap())).unwrap();
        let decoded = decode_image(&bytes, 1 << 30).unwrap();
        assert_eq!(decoded.as_raw(), rgb_of(&golden["image_rgb_u8"]).as_raw());
        let pv = preprocess_rgb(&decoded, &cfg).unwrap();
        assert_eq!(pv.grid_thw, grid_of(im));
        for backend in ["pil", "torchvision"] {
            if let Some(reference) = golden.get(&format!("pixel_values_{backend}")) {
                let (abs, _) = diff(&pv_tensor(&pv), reference);
                println!(
                    "extra {}: vs {backend}: max abs {abs:.3e} ({:.2} levels)",
                    dir.display(),
                    abs * 127.5
                );
                if backend == "pil" {
                    assert!(abs <= 1.0 / 127.5 + 1e-6, "{}: {abs}", dir.display());
                }
            }
        }
    }
}
