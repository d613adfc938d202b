//! Golden cases for the parity tests: `fixtures/index.json` (see its README.md).
//! `VLM_MODEL_FIXTURES` points at another fixtures folder of the same layout. Also the kernels
//! of each backend, for tests that run the one forward on every backend.
#![allow(dead_code)]
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::PathBuf;
use vlm_backend_candle::CandleKernels;
use vlm_backend_cpu::{CpuKernels, CpuOptions};
use vlm_compute::{HostTensor, ImageEmbeds, Qwen3VlConfig};

pub fn fixtures_dir() -> PathBuf {
    std::env::var_os("VLM_MODEL_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(vlm_test_support::fixtures_dir)
}

/// The CPU backend's kernels with every option `auto` (the best this CPU has).
pub fn cpu() -> CpuKernels {
    CpuKernels::new(CpuOptions::detect())
}

/// The candle backend's kernels on the CPU.
pub fn candle() -> CandleKernels {
    CandleKernels::new(Device::Cpu)
}

/// A tensor's values as the seam's host form (f32).
pub fn host(t: &Tensor) -> HostTensor {
    let t = t.to_dtype(DType::F32).unwrap();
    let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    HostTensor::from_f32(&v, t.dims().to_vec()).unwrap()
}

/// A host tensor as a CPU tensor (f32).
pub fn tensor(h: &HostTensor) -> Tensor {
    Tensor::from_vec(h.to_f32(), h.shape(), &Device::Cpu).unwrap()
}

pub struct Case {
    pub name: String,
    /// Checkpoint folder (config.json + model.safetensors).
    pub ckpt: PathBuf,
    pub cfg: Qwen3VlConfig,
    pub grids: Vec<[usize; 3]>,
    /// The image-processor backend whose pixel values the reference fed its model.
    pub fed_backend: String,
    pub golden: HashMap<String, Tensor>,
}

/// Every case of index.json, in order.
pub fn cases() -> Vec<Case> {
    let dir = fixtures_dir();
    let index_path = dir.join("index.json");
    let text = std::fs::read_to_string(&index_path)
        .unwrap_or_else(|e| panic!("golden fixtures index {}: {e}", index_path.display()));
    let index: serde_json::Value = serde_json::from_str(&text).expect("index.json parses");
    let mut out = Vec::new();
    for c in index["cases"].as_array().expect("cases") {
        let case_dir = dir.join(c["dir"].as_str().expect("dir"));
        let ckpt = dir.join(c["checkpoint"].as_str().expect("checkpoint"));
        let grids = c["image_grid_thw"]
            .as_array()
            .expect("grids")
            .iter()
            .map(|g| {
                let v: Vec<usize> = g
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as usize)
                    .collect();
                [v[0], v[1], v[2]]
            })
            .collect();
        let golden =
            candle_core::safetensors::load(case_dir.join("golden.safetensors"), &Device::Cpu)
                .expect("golden.safetensors loads");
        out.push(Case {
            name: c["dir"].as_str().unwrap().to_string(),
            cfg: Qwen3VlConfig::from_dir(&ckpt).expect("config.json"),
            ckpt,
            grids,
            fed_backend: c["backend_fed_to_model"]
                .as_str()
                .unwrap_or("torchvision")
                .to_string(),
            golden,
        });
    }
    assert!(
        !out.is_empty(),
        "no golden cases in {}",
        index_path.display()
    );
    out
}

impl Case {
    pub fn t(&self, name: &str) -> &Tensor {
        self.golden
            .get(name)
            .unwrap_or_else(|| panic!("{}: no tensor {name}", self.name))
    }

    pub fn input_ids(&self) -> Vec<u32> {
        let ids = self
            .t("input_ids")
            .flatten_all()
            .unwrap()
            .to_dtype(DType::I64)
            .unwrap();
        ids.to_vec1::<i64>()
            .unwrap()
            .into_iter()
            .map(|v| v as u32)
            .collect()
    }

    pub fn generated_ids(&self) -> Vec<u32> {
        let ids = self.t("generated_ids").to_dtype(DType::I64).unwrap();
        ids.to_vec1::<i64>()
            .unwrap()
            .into_iter()
            .map(|v| v as u32)
            .collect()
    }

    /// The golden ViT outputs split per image (rows in prompt order).
    pub fn images(&self) -> Vec<ImageEmbeds> {
        let levels = self.cfg.vision.deepstack_visual_indexes.len();
        let m = self.cfg.vision.spatial_merge_size;
        let merged = self.t("vision.merged");
        let deep: Vec<&Tensor> = (0..levels)
            .map(|k| self.t(&format!("vision.deepstack{k}")))
            .collect();
        let mut row = 0;
        self.grids
            .iter()
            .map(|&g| {
                let n = g[0] * (g[1] / m) * (g[2] / m);
                let img = ImageEmbeds {
                    embeds: host(&merged.narrow(0, row, n).unwrap()),
                    deepstack: deep
                        .iter()
                        .map(|d| host(&d.narrow(0, row, n).unwrap()))
                        .collect(),
                    grid_thw: g,
                };
                row += n;
                img
            })
            .collect()
    }
}

/// max |a - b| / max |b| (b the reference), in f32.
pub fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let b = b.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let diff = (&a - &b)
        .unwrap()
        .abs()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let scale = b.abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    diff / scale.max(f32::MIN_POSITIVE)
}

/// Greedy `tokens` and their per-step logits (on any device) against the case's goldens, each
/// step within 1e-4 relative; the worst step's difference.
pub fn check_steps(case: &Case, what: &str, tokens: &[u32], step_logits: &Tensor) -> f32 {
    assert_eq!(
        tokens,
        case.generated_ids().as_slice(),
        "{}: {what} tokens",
        case.name
    );
    let want = case.t("generate_step_logits");
    let mut worst = 0f32;
    for i in 0..tokens.len() {
        let got = step_logits.get(i).unwrap().to_device(&Device::Cpu).unwrap();
        let d = rel_diff(&got, &want.get(i).unwrap());
        assert!(d < 1e-4, "{}: {what} step {i}: {d}", case.name);
        worst = worst.max(d);
    }
    worst
}

/// Three cases of one checkpoint (to decode together in one padded bucket).
pub fn three_of_one_checkpoint(all: &[Case]) -> Vec<&Case> {
    let ckpt = &all[0].ckpt;
    let group: Vec<&Case> = all.iter().filter(|c| &c.ckpt == ckpt).take(3).collect();
    assert_eq!(group.len(), 3, "need three cases of one checkpoint");
    group
}

/// The cases' prompts as greedy requests.
pub fn greedy_requests(group: &[&Case]) -> Vec<vlm_model::oracle::GreedyRequest> {
    group
        .iter()
        .map(|c| vlm_model::oracle::GreedyRequest {
            input_ids: c.input_ids(),
            images: c.images(),
        })
        .collect()
}

/// bf16 steps against the f32 goldens: step i's logits within 1.5e-2 relative while the tokens
/// fed so far are the reference's (they are comparable up to the first token that differs).
/// The worst difference and the decode steps compared.
pub fn check_bf16_steps(
    case: &Case,
    what: &str,
    tokens: &[u32],
    step_logits: &Tensor,
) -> (f32, usize) {
    let want = case.generated_ids();
    let golden = case.t("generate_step_logits");
    let (mut worst, mut decode_steps) = (0f32, 0);
    for (i, (got, want)) in tokens.iter().zip(&want).enumerate() {
        let row = step_logits.get(i).unwrap().to_device(&Device::Cpu).unwrap();
        let d = rel_diff(&row, &golden.get(i).unwrap());
        assert!(d < 1.5e-2, "{} {what} step {i}: {d}", case.name);
        worst = worst.max(d);
        decode_steps += usize::from(i > 0);
        if got != want {
            break;
        }
    }
    (worst, decode_steps)
}
