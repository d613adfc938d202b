//! Dtype names between the deployment config, the seam's host types and candle.
use candle_core::DType;
use vlm_compute::HostDtype;

/// The candle dtype a part's weights are stored as for a config `dtype`.
pub fn candle_dtype(d: vlm_config::Dtype) -> DType {
    match d {
        vlm_config::Dtype::F32 => DType::F32,
        vlm_config::Dtype::F16 => DType::F16,
        vlm_config::Dtype::Bf16 => DType::BF16,
    }
}

/// The host dtype of a candle dtype (f32 for anything but the two 16-bit floats).
pub fn host_dtype(d: DType) -> HostDtype {
    match d {
        DType::F16 => HostDtype::F16,
        DType::BF16 => HostDtype::Bf16,
        _ => HostDtype::F32,
    }
}

/// The KV cache dtype for weights stored as `weights`: bf16 for bf16 weights (the reference
/// keeps its k/v states in the model dtype, so a bf16 run caches bf16 values: half the bytes per
/// token to hold and to read per decode step), f32 otherwise (f32 stays the exact path; f16
/// weights keep an f32 cache).
pub fn kv_dtype(weights: DType) -> DType {
    if weights == DType::BF16 {
        DType::BF16
    } else {
        DType::F32
    }
}
