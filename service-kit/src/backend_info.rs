//! The compute backend's self-description on the wire (`Lm.Info`, `Vision.Info`): one
//! conversion for both services.
use vlm_proto::v1 as pb;

/// `backend` on `device` with its kernel choices, in order.
pub fn to_proto(backend: &str, device: &str, kernels: &[(String, String)]) -> pb::BackendInfo {
    pb::BackendInfo {
        backend: backend.to_string(),
        device: device.to_string(),
        kernels: kernels
            .iter()
            .map(|(name, value)| pb::KernelChoice {
                name: name.clone(),
                value: value.clone(),
            })
            .collect(),
    }
}
