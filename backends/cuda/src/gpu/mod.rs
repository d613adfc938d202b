//! The GPU half of the backend (`cuda` feature): the kernels behind `vlm-model`'s forward and
//! the seam's loaders.
pub mod attention;
pub mod device;
pub mod kernels;
pub mod lm;
pub mod vision;

/// `src/kernels/vlm_kernels.cu` as PTX (build.rs), loaded once per device through candle's
/// custom-module cache.
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/vlm_kernels.ptx"));
pub const MODULE: &str = "vlm_kernels";

/// The CUDA storage of a tensor, or an error naming the op.
pub(crate) fn cuda_of<'a>(
    s: &'a candle_core::Storage,
    what: &str,
) -> candle_core::Result<&'a candle_core::CudaStorage> {
    match s {
        candle_core::Storage::Cuda(c) => Ok(c),
        _ => candle_core::bail!("{what}: the tensor is not on a CUDA device"),
    }
}
