//! The LM on the CPU: `vlm-model`'s text forward with [`CpuKernels`] over a paged KV cache in
//! host memory (bf16 for bf16 weights, else f32; FP8 E4M3 when the config asks), pre-faulted at
//! load. One engine serves the whole LM pool: its steps run on the rayon pool the caller
//! installs (one thread per core).
use crate::ops::CpuKernels;
use crate::options::CpuOptions;
use std::path::Path;
use vlm_compute::{BackendInfo, ComputeError, Result};
use vlm_model::lm_backend::TextBackend;
use vlm_model::text::TextModel;

/// Loads the LM part of the checkpoint in `dir` with weights stored as `dtype` and allocates a
/// KV pool of `num_blocks` blocks of `block_len` tokens (plus the dummy block) in `kv_dtype`.
#[allow(clippy::too_many_arguments)]
pub fn load(
    dir: &Path,
    dtype: vlm_config::Dtype,
    kv_dtype: vlm_config::KvCacheDtype,
    num_blocks: usize,
    block_len: usize,
    cores: &[usize],
    opts: CpuOptions,
) -> Result<TextBackend<CpuKernels>> {
    let kernels = CpuKernels::new(opts);
    let dtype = vlm_model::dtype::candle_dtype(dtype);
    let mut model = TextModel::load(&kernels, dir, dtype).map_err(ComputeError::from)?;
    if kv_dtype == vlm_config::KvCacheDtype::Fp8E4m3 {
        model = model.with_fp8_kv_cache();
    }
    let mut described = opts.describe();
    described.retain(|(k, _)| !k.starts_with("vit_"));
    let kv = kernels_kv_dtype(&model);
    described.push(("kv_cache".into(), kv.into()));
    let info = BackendInfo {
        backend: "cpu",
        device: format!("cpu cores {cores:?}"),
        dtype: vlm_model::dtype::host_dtype(dtype),
        kernels: described,
    };
    Ok(TextBackend::new(model, num_blocks, block_len, info)?)
}

fn kernels_kv_dtype(model: &TextModel<CpuKernels>) -> &'static str {
    match model.kv_dtype() {
        candle_core::DType::F8E4M3 => "fp8_e4m3",
        d => vlm_model::dtype::host_dtype(d).as_str(),
    }
}
