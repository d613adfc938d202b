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

/// A zero-filled f32 buffer whose pages are resident: one write per page. What a service
/// reserves at start (KV pool, ViT workspaces) is then really held, so a layout that does not
/// fit fails at start-up instead of being killed for memory later, under load, and the memory
/// plan (`vlm plan`) matches the process's resident memory.
pub fn zeros_resident_f32(n: usize) -> Vec<f32> {
    zeros_resident_vec(n, 0f32)
}

/// `n` copies of `zero` (an all-zero-bits value) with every page written once (see
/// [`zeros_resident_f32`]).
fn zeros_resident_vec<T: Copy>(n: usize, zero: T) -> Vec<T> {
    let mut v = vec![zero; n];
    for x in v.iter_mut().step_by(4096 / std::mem::size_of::<T>()) {
        *x = std::hint::black_box(zero);
    }
    v
}

/// A zero tensor of `dtype` (f32 or bf16 on the CPU) whose pages are resident on the CPU (see
/// [`zeros_resident_f32`]); a plain zero tensor on other devices.
pub fn zeros_resident(
    shape: impl Into<candle_core::Shape>,
    dtype: DType,
    device: &Device,
) -> Result<candle_core::Tensor> {
    let shape: candle_core::Shape = shape.into();
    if !device.is_cpu() {
        return Ok(candle_core::Tensor::zeros(shape, dtype, device)?);
    }
    match dtype {
        DType::F32 => Ok(candle_core::Tensor::from_vec(
            zeros_resident_f32(shape.elem_count()),
            shape,
            device,
        )?),
        DType::BF16 => Ok(candle_core::Tensor::from_vec(
            zeros_resident_vec(shape.elem_count(), half::bf16::ZERO),
            shape,
            device,
        )?),
        other => Err(ModelError::invalid(format!(
            "a resident buffer of {other:?} is not supported (f32, bf16)"
        ))),
    }
}
