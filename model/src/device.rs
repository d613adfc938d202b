//! Compute device and dtype selection.
use crate::error::{ModelError, Result};
use candle_core::{DType, Device};

/// Parses a compute dtype name as used in the deployment config ("f32", "f16", "bf16").
pub fn parse_dtype(name: &str) -> Result<DType> {
    match name.to_ascii_lowercase().as_str() {
        "f32" | "float32" => Ok(DType::F32),
        "f16" | "float16" | "half" => Ok(DType::F16),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        other => Err(ModelError::invalid(format!(
            "dtype {other:?} is not supported; use one of f32, f16, bf16"
        ))),
    }
}

/// The device for a service's first pool id: the CPU in the default build; with the `cuda`
/// feature, GPU ordinal `ordinal`.
pub fn device_for(ordinal: usize) -> Result<Device> {
    #[cfg(feature = "cuda")]
    {
        Ok(Device::new_cuda(ordinal)?)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Ok(Device::Cpu)
    }
}
