//! `Qwen3VLTextDecoderLayer`: pre-norm attention and MLP with residuals.
use super::attention::{Attention, Step};
use super::mlp::Mlp;
use super::norm::RmsNorm;
use super::step::take_rows;
use crate::error::Result;
use crate::kernels::Kernels;
use crate::weights::Weights;
use candle_core::Tensor;
use vlm_compute::TextConfig;

#[derive(Debug, Clone)]
pub struct DecoderLayer<K: Kernels> {
    self_attn: Attention<K>,
    mlp: Mlp<K>,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    k: K,
}

impl<K: Kernels> DecoderLayer<K> {
    /// `vb` at `model.language_model.layers.{i}`.
    pub fn new(k: &K, cfg: &TextConfig, vb: Weights) -> Result<Self> {
        Ok(DecoderLayer {
            self_attn: Attention::new(k, cfg, vb.pp("self_attn"))?,
            mlp: Mlp::new(k, cfg, vb.pp("mlp"))?,
            input_layernorm: RmsNorm::new(
                cfg.hidden_size,
                cfg.rms_norm_eps,
                vb.pp("input_layernorm").vb().clone(),
            )?,
            post_attention_layernorm: RmsNorm::new(
                cfg.hidden_size,
                cfg.rms_norm_eps,
                vb.pp("post_attention_layernorm").vb().clone(),
            )?,
            k: k.clone(),
        })
    }

    /// Whether the backend multiplies each row by this layer's weights independently of the
    /// others.
    pub(crate) fn row_independent(&self) -> bool {
        self.self_attn.row_independent() && self.mlp.row_independent()
    }

    /// x: (n, hidden) -> (n, hidden); `layer` is this layer's index (its KV-cache slot).
    pub(crate) fn forward(&self, x: &Tensor, step: &Step, layer: usize) -> Result<Tensor> {
        let h = self.input_layernorm.forward(&self.k, x)?;
        let h = self.self_attn.forward(&h, step, layer)?;
        let x = self.k.add(x, &h)?;
        let h = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&self.k, &x)?)?;
        self.k.add(&x, &h)
    }

    /// [`Self::forward`] of the model's last layer where only the rows `keep` of its output
    /// are read (the logits of each prefill chunk's last position and of the decode rows):
    /// every row's K/V still goes to the cache and every row attends (a kernel's attention
    /// covers the chunk), but the o projection and the MLP run on the kept rows alone.
    /// x: (n, hidden) -> (keep.len(), hidden), the values of those rows of `forward` where the
    /// products are row-independent.
    pub(crate) fn forward_rows(
        &self,
        x: &Tensor,
        step: &Step,
        layer: usize,
        keep: &[usize],
    ) -> Result<Tensor> {
        let h = self.input_layernorm.forward(&self.k, x)?;
        let y = self.self_attn.attend(&h, step, layer)?;
        let h = self.self_attn.project(&take_rows(&y, keep)?)?;
        let x = self.k.add(&take_rows(x, keep)?, &h)?;
        let h = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&self.k, &x)?)?;
        self.k.add(&x, &h)
    }
}
