//! The ViT on each GPU of the pool: the model's forward at the bucket's rows through
//! [`CudaKernels`] (bf16 GEMMs on resident weights), loaded by the candle backend's generic
//! ViT loader. Buffers come from the device's stream-ordered pool, which keeps them after the
//! warm-up run of each bucket (`device::open`).
use super::device;
use super::kernels::CudaKernels;
use std::path::Path;
use vlm_backend_candle::vision::{load_with, CandleVision};
use vlm_compute::Result;

pub type CudaVision = CandleVision<CudaKernels>;

pub fn load(
    dir: &Path,
    dtype: vlm_config::Dtype,
    bucket_lens: &[usize],
    devices: &[u32],
) -> Result<Vec<CudaVision>> {
    load_with(dir, dtype, bucket_lens, devices, "cuda", |ordinal| {
        let dev = device::open(ordinal)?;
        let name = device::memory(&dev)?.name;
        let sms = device::multiprocessors(&dev)?;
        Ok((
            CudaKernels::new(dev, sms),
            format!("cuda:{ordinal} ({name})"),
        ))
    })
}
