//! `patch_embed.proj`: Conv3d(C, D, kernel = stride = (T, P, P), bias) on
//! `pixel_values.view(-1, C, T, P, P)`, which is exactly a matmul with the kernel flattened
//! `[c][t][py][px]` (reference: Qwen3VLVisionPatchEmbed).
use super::linear::Linear;
use crate::error::Result;
use crate::kernels::Kernels;
use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;
use vlm_compute::VisionConfig;

#[derive(Debug, Clone)]
pub struct PatchEmbed<K: Kernels> {
    /// weight (D, C*T*P*P), bias (D,).
    pub proj: Linear<K>,
}

impl<K: Kernels> PatchEmbed<K> {
    pub fn new(k: &K, cfg: &VisionConfig, vb: VarBuilder, dtype: DType) -> Result<Self> {
        let vb = vb.pp("proj");
        let (d, c, t, p) = (
            cfg.hidden_size,
            cfg.in_channels,
            cfg.temporal_patch_size,
            cfg.patch_size,
        );
        // (D, C, T, P, P) -> (D, C*T*P*P)
        let weight = vb
            .to_dtype(dtype)
            .get((d, c, t, p, p), "weight")?
            .reshape((d, c * t * p * p))?;
        let bias = vb.to_dtype(DType::F32).get(d, "bias")?;
        Ok(PatchEmbed {
            proj: Linear::from_parts(k, weight, bias)?,
        })
    }

    /// (N, C*T*P*P) f32 -> (N, D) f32.
    pub fn forward(&self, pixel_values: &Tensor) -> Result<Tensor> {
        self.proj.forward(pixel_values)
    }
}
