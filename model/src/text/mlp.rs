//! `Qwen3VLTextMLP`: `down(silu(gate(x)) * up(x))`.
use super::linear::Linear;
use crate::config::TextConfig;
use crate::error::Result;
use candle_core::Tensor;
use candle_nn::VarBuilder;

#[derive(Debug, Clone)]
pub struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    /// `vb` at `...layers.{i}.mlp`.
    pub fn new(cfg: &TextConfig, vb: VarBuilder) -> Result<Self> {
        let (d, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Mlp {
            gate_proj: Linear::load(&vb.pp("gate_proj"), d, i)?,
            up_proj: Linear::load(&vb.pp("up_proj"), d, i)?,
            down_proj: Linear::load(&vb.pp("down_proj"), i, d)?,
        })
    }

    /// x: (n, hidden) -> (n, hidden).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = candle_nn::ops::silu(&self.gate_proj.forward(x)?)?; // (n, inter)
        let up = self.up_proj.forward(x)?; // (n, inter)
        self.down_proj.forward(&(gate * up)?)
    }
}
