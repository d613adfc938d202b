//! The LM on one GPU: `vlm-model`'s text forward with [`CudaKernels`], the KV pool allocated
//! once at load in device memory. A pool of more than one GPU is refused (no tensor parallel:
//! run one LM replica per GPU).
use super::device;
use super::kernels::CudaKernels;
use crate::select::{self, CacheDtype};
use std::path::Path;
use vlm_compute::{BackendInfo, ComputeError, Result};
use vlm_model::lm_backend::TextBackend;
use vlm_model::text::TextModel;

pub fn load(
    dir: &Path,
    dtype: vlm_config::Dtype,
    num_blocks: usize,
    block_len: usize,
    devices: &[u32],
) -> Result<TextBackend<CudaKernels>> {
    let [ordinal] = devices else {
        return Err(ComputeError::options(format!(
            "the cuda backend runs the LM on one GPU; device lists {devices:?} (tensor parallel \
             is not implemented: run one LM replica per GPU)"
        )));
    };
    let device = device::open(*ordinal)?;
    let mem = device::memory(&device)?;
    let kernels = CudaKernels::new(device.clone(), device::multiprocessors(&device)?);
    let dtype = vlm_model::dtype::candle_dtype(dtype);
    let model = TextModel::load(&kernels, dir, dtype).map_err(ComputeError::from)?;
    let kv_dtype = model.kv_dtype();
    let cfg = model.config().clone();
    let cache = match kv_dtype {
        candle_core::DType::BF16 => CacheDtype::Bf16,
        _ => CacheDtype::F32,
    };
    let decode = select::decode_kernel(
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cache,
    )
    .unwrap_or_else(|| "generic (candle ops; no kernel for this head size)".into());
    let info = BackendInfo {
        backend: "cuda",
        device: format!("cuda:{ordinal} ({})", mem.name),
        dtype: vlm_model::dtype::host_dtype(dtype),
        kernels: vec![
            ("gemm".into(), format!("cublas {:?}", dtype).to_lowercase()),
            ("decode_attention".into(), decode),
            (
                "prefill_attention".into(),
                "cublas batched per block".into(),
            ),
            ("kv_cache".into(), cache.suffix().into()),
            ("graphs".into(), "none (candle allocates per op)".into()),
        ],
    };
    let backend = TextBackend::new(model, num_blocks, block_len, info)?;
    tracing::info!(
        gpu = %mem.name,
        free_bytes_at_start = mem.free,
        total_bytes = mem.total,
        kv_blocks = num_blocks,
        "cuda LM loaded"
    );
    Ok(backend)
}
