//! The LM in candle's ops: `vlm-model`'s text forward with [`CandleKernels`] on one device.
use crate::ops::{device_for, device_name, CandleKernels};
use std::path::Path;
use vlm_compute::{BackendInfo, ComputeError, Result};
use vlm_model::lm_backend::TextBackend;
use vlm_model::text::TextModel;

/// Loads the LM part of the checkpoint onto its device: the host CPU (a pool of cores; the
/// caller's thread pool runs the ops), or one GPU. A pool of more than one GPU is refused: this
/// backend has no tensor parallelism (run one LM replica per GPU instead).
pub fn load(
    dir: &Path,
    dtype: vlm_config::Dtype,
    num_blocks: usize,
    block_len: usize,
    devices: &[u32],
) -> Result<TextBackend<CandleKernels>> {
    let ordinal = match devices {
        [one] => *one,
        [first, ..] if !crate::ops::on_accelerator() => *first,
        _ => {
            return Err(ComputeError::options(format!(
                "the candle backend runs the LM on one GPU; device lists {devices:?} (tensor \
                 parallel is not implemented: run one LM replica per GPU)"
            )))
        }
    };
    let device = device_for(ordinal).map_err(ComputeError::from)?;
    let kernels = CandleKernels::new(device.clone());
    let dtype = vlm_model::dtype::candle_dtype(dtype);
    let model = TextModel::load(&kernels, dir, dtype).map_err(ComputeError::from)?;
    let kv = vlm_model::dtype::host_dtype(model.kv_dtype()).as_str();
    let info = BackendInfo {
        backend: "candle",
        device: if crate::ops::on_accelerator() {
            device_name(&device, ordinal)
        } else {
            format!("cpu cores {devices:?}")
        },
        dtype: vlm_model::dtype::host_dtype(dtype),
        kernels: vec![
            ("ops".into(), "candle".into()),
            ("kv_cache".into(), kv.into()),
        ],
    };
    Ok(TextBackend::new(model, num_blocks, block_len, info)?)
}
