//! Borrowing a tensor's CPU data (f32, or bf16 or FP8 E4M3 for a KV cache) as a slice, for the
//! kernels that work on slices.
use candle_core::{CpuStorage, Storage, StorageRef, Tensor};
use std::marker::PhantomData;
use vlm_model::{ModelError, Result};

/// An element type a CPU storage can be borrowed as.
pub(crate) trait CpuElem: Sized {
    const NAME: &'static str;
    fn of(s: &CpuStorage) -> Option<&[Self]>;
}
impl CpuElem for f32 {
    const NAME: &'static str = "f32";
    fn of(s: &CpuStorage) -> Option<&[f32]> {
        match s {
            CpuStorage::F32(v) => Some(v),
            _ => None,
        }
    }
}
impl CpuElem for half::bf16 {
    const NAME: &'static str = "bf16";
    fn of(s: &CpuStorage) -> Option<&[half::bf16]> {
        match s {
            CpuStorage::BF16(v) => Some(v),
            _ => None,
        }
    }
}
impl CpuElem for float8::F8E4M3 {
    const NAME: &'static str = "f8e4m3";
    fn of(s: &CpuStorage) -> Option<&[float8::F8E4M3]> {
        match s {
            CpuStorage::F8E4M3(v) => Some(v),
            _ => None,
        }
    }
}

/// A contiguous CPU tensor's data, borrowed (the storage stays locked for reading).
pub(crate) struct CpuView<'a, T> {
    guard: StorageRef<'a>,
    start: usize,
    end: usize,
    elem: PhantomData<T>,
}

/// The f32 view the engine, the kernels and the f32 KV cache use.
pub(crate) type CpuF32<'a> = CpuView<'a, f32>;

impl<'a, T: CpuElem> CpuView<'a, T> {
    /// `what` names the tensor in the error when it is not contiguous `T` on the CPU.
    pub(crate) fn new(t: &'a Tensor, what: &str) -> Result<Self> {
        let (guard, layout) = t.storage_and_layout();
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| ModelError::weights(format!("{what}: not contiguous")))?;
        if !matches!(&*guard, Storage::Cpu(s) if T::of(s).is_some()) {
            return Err(ModelError::weights(format!(
                "{what}: not {} on the CPU",
                T::NAME
            )));
        }
        Ok(CpuView {
            guard,
            start,
            end,
            elem: PhantomData,
        })
    }

    pub(crate) fn slice(&self) -> &[T] {
        match &*self.guard {
            Storage::Cpu(s) => T::of(s).map_or(&[], |v| &v[self.start..self.end]),
            _ => &[],
        }
    }
}
