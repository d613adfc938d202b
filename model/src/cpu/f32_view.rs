//! Borrowing a tensor's f32 CPU data as a slice, for the kernels that work on slices.
use crate::error::{ModelError, Result};
use candle_core::{CpuStorage, Storage, StorageRef, Tensor};

/// A contiguous f32 CPU tensor's data, borrowed (the storage stays locked for reading).
pub(crate) struct CpuF32<'a> {
    guard: StorageRef<'a>,
    start: usize,
    end: usize,
}

impl<'a> CpuF32<'a> {
    /// `what` names the tensor in the error when it is not contiguous f32 on the CPU.
    pub(crate) fn new(t: &'a Tensor, what: &str) -> Result<Self> {
        let (guard, layout) = t.storage_and_layout();
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| ModelError::Weights(format!("{what}: not contiguous")))?;
        if !matches!(&*guard, Storage::Cpu(CpuStorage::F32(_))) {
            return Err(ModelError::Weights(format!("{what}: not f32 on the CPU")));
        }
        Ok(CpuF32 { guard, start, end })
    }

    pub(crate) fn slice(&self) -> &[f32] {
        match &*self.guard {
            Storage::Cpu(CpuStorage::F32(v)) => &v[self.start..self.end],
            _ => &[],
        }
    }
}
