//! Zero-filled buffers whose pages are resident from the start (one write per page). What a
//! backend reserves at load (KV pool, ViT workspaces) is then really held, so a layout that does
//! not fit fails at start-up instead of being killed for memory later, under load, and the
//! memory plan (`vlm plan`) matches the process's resident memory.
use crate::error::{ModelError, Result};
use candle_core::{DType, Device};

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
    touch_pages(&mut v);
    v
}

/// Writes one value of every 4 KiB page of `v` back in place, so that its pages are resident
/// (a zeroed allocation may otherwise map them lazily).
pub fn touch_pages<T: Copy>(v: &mut [T]) {
    for x in v
        .iter_mut()
        .step_by((4096 / std::mem::size_of::<T>()).max(1))
    {
        *x = std::hint::black_box(*x);
    }
}

/// A zero tensor of `dtype` (f32, bf16 or FP8 E4M3 on the CPU) whose pages are resident on
/// the CPU (see [`zeros_resident_f32`]); a plain zero tensor on other devices.
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
        DType::F8E4M3 => Ok(candle_core::Tensor::from_vec(
            zeros_resident_vec(shape.elem_count(), float8::F8E4M3::ZERO),
            shape,
            device,
        )?),
        other => Err(ModelError::invalid(format!(
            "a resident buffer of {other:?} is not supported (f32, bf16, f8e4m3)"
        ))),
    }
}
