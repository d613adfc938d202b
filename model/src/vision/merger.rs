//! `merger` and `deepstack_merger_list.{k}` (reference: Qwen3VLVisionPatchMerger): 2x2 blocks of
//! consecutive patches (merge-block order) become one token. `merger` normalises each patch
//! (LayerNorm(D)) before the view to (N/4, 4D); the deepstack mergers (use_postshuffle_norm)
//! view first and normalise over 4D. Then linear_fc1 (4D->4D), exact erf GELU (`nn.GELU()`),
//! linear_fc2 (4D->out_hidden).
use super::linear::{LayerNorm, Linear};
use crate::error::Result;
use crate::kernels::Kernels;
use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;
use vlm_compute::VisionConfig;

#[derive(Debug, Clone)]
pub struct PatchMerger<K: Kernels> {
    /// LayerNorm(D), or LayerNorm(4D) when `postshuffle`.
    pub norm: LayerNorm,
    /// 4D -> 4D.
    pub linear_fc1: Linear<K>,
    /// 4D -> out_hidden.
    pub linear_fc2: Linear<K>,
    pub postshuffle: bool,
    /// 4D.
    pub merged_dim: usize,
}

impl<K: Kernels> PatchMerger<K> {
    pub fn new(
        k: &K,
        cfg: &VisionConfig,
        vb: VarBuilder,
        postshuffle: bool,
        dtype: DType,
    ) -> Result<Self> {
        let merged_dim = cfg.hidden_size * cfg.merge_unit();
        let norm_dim = if postshuffle {
            merged_dim
        } else {
            cfg.hidden_size
        };
        Ok(PatchMerger {
            norm: LayerNorm::new(vb.pp("norm"), norm_dim)?,
            linear_fc1: Linear::new(k, vb.pp("linear_fc1"), merged_dim, merged_dim, dtype)?,
            linear_fc2: Linear::new(
                k,
                vb.pp("linear_fc2"),
                merged_dim,
                cfg.out_hidden_size,
                dtype,
            )?,
            postshuffle,
            merged_dim,
        })
    }

    /// (N, D) f32 -> (N/4, out_hidden) f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (n, d) = x.dims2()?;
        let tokens = n * d / self.merged_dim;
        let x = if self.postshuffle {
            self.norm.forward(&x.reshape((tokens, self.merged_dim))?)? // (N/4, 4D)
        } else {
            self.norm.forward(x)?.reshape((tokens, self.merged_dim))? // (N, D) -> (N/4, 4D)
        };
        let h = self.linear_fc1.forward(&x)?.gelu_erf()?; // (N/4, 4D)
        self.linear_fc2.forward(&h) // (N/4, out_hidden)
    }
}
