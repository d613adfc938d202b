//! What the compressed-tensors golden tests (`w8a8_golden.rs`, `w4a16_golden.rs`) share:
//! hashing the written file, rewriting a directory with edited tensors or config, and comparing
//! a greedy run's logits with a golden's.
#![allow(dead_code)]
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use vlm_backend_cpu::{CpuKernels, CpuOptions};

pub fn cpu() -> CpuKernels {
    CpuKernels::new(CpuOptions::detect())
}

pub fn sha256(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap();
    Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A golden (`fixtures/{name}`) of one of the reference scripts, after checking that `dir`'s
/// model.safetensors is the file it was made from.
pub fn golden(name: &str, dir: &Path) -> serde_json::Value {
    let p = vlm_test_support::fixtures_dir().join(name);
    let g: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    assert_eq!(
        sha256(&dir.join("model.safetensors")),
        g["safetensors_sha256"].as_str().unwrap(),
        "`vlm quantize` wrote other bytes than the golden {name} was made from: regenerate it \
         (see the test's header)"
    );
    g
}

/// `got` step logits and tokens against the golden's, each step within `tol` of the step's
/// largest |logit|; stops at a near tie (the next steps may follow another token).
pub fn assert_steps_match(
    label: &str,
    got: &[Vec<f32>],
    tokens: &[u32],
    g: &serde_json::Value,
    tol: f32,
) {
    let want_ids: Vec<u32> = serde_json::from_value(g["greedy_ids"].clone()).unwrap();
    let want: Vec<Vec<f32>> = serde_json::from_value(g["step_logits"].clone()).unwrap();
    assert_eq!(got.len(), want.len());
    for (step, (g, w)) in got.iter().zip(&want).enumerate() {
        let scale = w.iter().fold(0f32, |m, x| m.max(x.abs()));
        let diff = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff <= tol * scale,
            "{label} step {step}: max |diff| {diff} vs scale {scale}"
        );
        let mut sorted = w.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if sorted[0] - sorted[1] <= 2.0 * tol * scale {
            break;
        }
        assert_eq!(
            tokens[step], want_ids[step],
            "{label}: greedy id of step {step}"
        );
    }
}

pub type Tensors = Vec<(String, (safetensors::Dtype, Vec<usize>, Vec<u8>))>;

/// The tensors of `dir`'s model.safetensors.
pub fn read_tensors(dir: &Path) -> Tensors {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    safetensors::SafeTensors::deserialize(&bytes)
        .unwrap()
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

/// A checkpoint directory `d` of `st`, with `q`'s tokenizer and generation files and its
/// config.json as `edit` leaves it.
pub fn write_dir(
    q: &Path,
    d: &Path,
    st: &Tensors,
    edit: &dyn Fn(&mut serde_json::Value),
) -> PathBuf {
    std::fs::create_dir_all(d).unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(q.join(f), d.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(q.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    let views: Vec<(String, safetensors::tensor::TensorView)> = st
        .iter()
        .map(|(n, (dt, sh, data))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*dt, sh.clone(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &d.join("model.safetensors")).unwrap();
    d.to_path_buf()
}

/// A quantized directory `q` against its golden `g`, on the SIMD path and on the scalar one:
/// within `scalar_tol` on the scalar path (and on CPUs without the bf16 GEMM), `bf16_tol` where
/// the weight-only schemes round activations (and their dequantized weights) to bf16.
pub fn assert_matches_on_both_paths(
    q: &Path,
    g: &serde_json::Value,
    scalar_tol: f32,
    bf16_tol: f32,
) {
    use vlm_model::oracle::Oracle;
    let ids: Vec<u32> = serde_json::from_value(g["input_ids"].clone()).unwrap();
    let steps = g["step_logits"].as_array().unwrap().len();
    for simd in [true, false] {
        let mut opts = CpuOptions::detect();
        if !simd {
            opts.gemv = vlm_backend_cpu::kernels::gemv::Isa::Scalar;
        }
        let oracle =
            Oracle::load_text_only(&CpuKernels::new(opts), q, candle_core::DType::F32).unwrap();
        let out = oracle.generate_greedy(&ids, &[], steps, &[]).unwrap();
        let got = out.step_logits.to_vec2::<f32>().unwrap();
        let bf16_prefill = simd && vlm_backend_cpu::kernels::bf16_gemm::available();
        let tol = if bf16_prefill { bf16_tol } else { scalar_tol };
        assert_steps_match(&format!("simd {simd}"), &got, &out.tokens, g, tol);
    }
}

/// The first-step logits of checkpoint `a` and `b` on the same prompt: (max |diff|, largest
/// |logit| of `a`).
pub fn first_step_diff(a: &Path, b: &Path) -> (f32, f32) {
    use vlm_model::oracle::Oracle;
    let ids: Vec<u32> = (0..24).map(|i| (i * 37 % 900) as u32).collect();
    let run = |d: &Path| {
        let o = Oracle::load_text_only(&cpu(), d, candle_core::DType::F32).unwrap();
        let out = o.generate_greedy(&ids, &[], 1, &[]).unwrap();
        out.step_logits.to_vec2::<f32>().unwrap().remove(0)
    };
    let (x, y) = (run(a), run(b));
    let scale = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = x
        .iter()
        .zip(&y)
        .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
    (diff, scale)
}

/// The seed-0 tiny-256 checkpoint, made in `dir/tiny-256`.
pub fn tiny256(dir: &Path) -> PathBuf {
    use vlm_make_model::{make_model, MakeOptions, Preset};
    let ckpt = dir.join("tiny-256");
    make_model(&ckpt, &MakeOptions::new(Preset::Tiny256)).unwrap();
    ckpt
}

/// The seed-0 tiny-256 checkpoint in `dir` and the directory `quantize` writes from it
/// (`tiny-256-{name}`).
pub fn tiny256_pair(
    dir: &Path,
    name: &str,
    quantize: impl Fn(&Path, &Path) -> vlm_model::Result<()>,
) -> (PathBuf, PathBuf) {
    let ckpt = tiny256(dir);
    let q = dir.join(format!("tiny-256-{name}"));
    quantize(&ckpt, &q).unwrap();
    (ckpt, q)
}

/// Rewrites of a quantized directory `q` (its tensors `st`) under `dir`, each loaded as the
/// LM: the error it is refused with.
pub struct Rewrites<'a> {
    pub q: &'a Path,
    pub dir: &'a Path,
    pub st: Tensors,
}

impl Rewrites<'_> {
    pub fn new<'a>(q: &'a Path, dir: &'a Path) -> Rewrites<'a> {
        Rewrites {
            q,
            dir,
            st: read_tensors(q),
        }
    }

    /// Directory `name` with tensors `st` and the config as `edit` leaves it.
    pub fn write_with(
        &self,
        name: &str,
        st: &Tensors,
        edit: &dyn Fn(&mut serde_json::Value),
    ) -> PathBuf {
        write_dir(self.q, &self.dir.join(name), st, edit)
    }

    /// Directory `name` with the tensors `keep` keeps and the config as `edit` leaves it.
    pub fn write(
        &self,
        name: &str,
        keep: &dyn Fn(&str) -> bool,
        edit: &dyn Fn(&mut serde_json::Value),
    ) -> PathBuf {
        let kept: Tensors = self.st.iter().filter(|(n, _)| keep(n)).cloned().collect();
        self.write_with(name, &kept, edit)
    }

    /// The tensors with `name` replaced by `dtype` values of its shape, each byte `byte`.
    pub fn with_tensor(&self, name: &str, dtype: safetensors::Dtype, byte: u8) -> Tensors {
        self.st
            .iter()
            .map(|(n, (dt, sh, data))| {
                if n != name {
                    return (n.clone(), (*dt, sh.clone(), data.clone()));
                }
                let len = sh.iter().product::<usize>() * dtype.bitsize() / 8;
                (n.clone(), (dtype, sh.clone(), vec![byte; len]))
            })
            .collect()
    }
}

/// The error loading `d` as the LM is refused with (panics if it loads).
pub fn refused(d: &Path) -> String {
    match vlm_model::oracle::Oracle::load_text_only(&cpu(), d, candle_core::DType::F32) {
        Ok(_) => panic!("{} loaded", d.display()),
        Err(e) => e.to_string(),
    }
}

/// The errors the LM and the vision tower refuse `d` with.
pub fn refused_by_both(d: &Path) -> [String; 2] {
    let vision = vlm_model::vision::VisionModel::load(&cpu(), d, candle_core::DType::F32)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_else(|| panic!("{}: the vision tower loaded", d.display()));
    [refused(d), vision]
}
