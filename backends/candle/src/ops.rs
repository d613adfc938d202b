//! [`CandleKernels`]: candle's own ops under `vlm-model`'s forward, on any device candle runs.
//! Weights stay in their storage dtype and are widened to f32 per product; attention is
//! `vlm_model::text::paged_attention` (scores per cached block, softmax in f32).
use candle_core::{DType, Device, Tensor};
use vlm_model::text::{paged_attention, AttnCall};
use vlm_model::{Kernels, Result};

#[derive(Debug, Clone)]
pub struct CandleKernels {
    device: Device,
}

impl CandleKernels {
    pub fn new(device: Device) -> CandleKernels {
        CandleKernels { device }
    }
}

impl Kernels for CandleKernels {
    /// (out, in) in the storage dtype, on the device.
    type Weight = Tensor;

    fn name(&self) -> &'static str {
        "candle"
    }
    fn device(&self) -> &Device {
        &self.device
    }
    fn weight(&self, w: Tensor) -> Result<Tensor> {
        Ok(w)
    }
    fn weight_dims(&self, w: &Tensor) -> (usize, usize) {
        let d = w.dims();
        (d[0], d[1])
    }
    fn matmul(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let w = if w.dtype() == DType::F32 {
            w.clone()
        } else {
            w.to_dtype(DType::F32)?
        };
        Ok(x.matmul(&w.t()?)?)
    }
    fn rows_of(&self, w: &Tensor, ids: &[u32]) -> Result<Tensor> {
        let idx = Tensor::new(ids, w.device())?;
        Ok(w.index_select(&idx, 0)?.to_dtype(DType::F32)?)
    }
    fn kv_dtype(&self, weights: DType) -> DType {
        vlm_model::dtype::kv_dtype(weights)
    }
    fn attention(&self, call: &AttnCall) -> Result<Tensor> {
        paged_attention::attention(call)
    }
}

/// The candle device for a pool id: the CPU in a build without `cuda`; GPU ordinal `ordinal`
/// with it.
pub fn device_for(ordinal: u32) -> Result<Device> {
    #[cfg(feature = "cuda")]
    {
        Ok(Device::new_cuda(ordinal as usize)?)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Ok(Device::Cpu)
    }
}

/// Whether this build's devices are accelerators (CUDA) rather than the host CPU.
pub fn on_accelerator() -> bool {
    cfg!(feature = "cuda")
}

/// How a device is named in logs and `Info`.
pub fn device_name(device: &Device, ordinal: u32) -> String {
    match device {
        Device::Cpu => "cpu".into(),
        _ => format!("cuda:{ordinal}"),
    }
}
