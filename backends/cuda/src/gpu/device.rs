//! One GPU: opened through candle, its free memory (`cuMemGetInfo`), name and multiprocessor
//! count; and its stream-ordered memory pool told to keep what it has allocated (so the
//! buffers of the warm-up runs, one per ViT bucket and decode batch, stay with the process
//! instead of going back to the driver between steps).
use crate::plan::GpuMemory;
use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::Device;
use vlm_compute::{ComputeError, Result};

fn err(e: impl std::fmt::Display) -> ComputeError {
    ComputeError::Backend(format!("cuda: {e}"))
}

/// GPU `ordinal` as a candle device, its pool set to keep its memory.
pub fn open(ordinal: u32) -> Result<Device> {
    let device = Device::new_cuda(ordinal as usize).map_err(err)?;
    keep_pool_memory(&device)?;
    Ok(device)
}

/// Name and free/total memory of the device, as the driver reports them now.
pub fn memory(device: &Device) -> Result<GpuMemory> {
    let ctx = device.as_cuda_device().map_err(err)?.cuda_stream();
    let ctx = ctx.context();
    let (free, total) = ctx.mem_get_info().map_err(err)?;
    Ok(GpuMemory {
        name: ctx.name().map_err(err)?,
        free: free as u64,
        total: total as u64,
    })
}

/// Streaming multiprocessors of the device (the decode split's target).
pub fn multiprocessors(device: &Device) -> Result<usize> {
    let stream = device.as_cuda_device().map_err(err)?.cuda_stream();
    let n = stream
        .context()
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(err)?;
    Ok(n.max(1) as usize)
}

/// Release threshold of the device's default memory pool = unlimited: freed blocks stay in
/// the pool for the next step (cudarc allocates stream-ordered from this pool).
fn keep_pool_memory(device: &Device) -> Result<()> {
    let stream = device.as_cuda_device().map_err(err)?.cuda_stream();
    let ctx = stream.context();
    ctx.bind_to_thread().map_err(err)?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold: u64 = u64::MAX;
    // SAFETY: plain driver calls on this context's device; `threshold` outlives the call.
    unsafe {
        let dev = ctx.cu_device();
        let r = sys::cuDeviceGetDefaultMemPool(&mut pool, dev);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(err(format!("cuDeviceGetDefaultMemPool: {r:?}")));
        }
        let r = sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        );
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(err(format!("cuMemPoolSetAttribute: {r:?}")));
        }
    }
    Ok(())
}
