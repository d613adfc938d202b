//! `Qwen3VLTextMLP`: `down(silu(gate(x)) * up(x))`.
use super::linear::Linear;
use crate::error::Result;
use crate::kernels::Kernels;
use crate::weights::Weights;
use candle_core::Tensor;
use vlm_compute::TextConfig;

#[derive(Debug, Clone)]
pub struct Mlp<K: Kernels> {
    k: K,
    gate_up: GateUp<K>,
    down_proj: Linear<K>,
}

/// gate and up projections: two layers, or one holding both weights (when the backend fuses
/// them, [`Kernels::fuse_gate_up`]) whose product gives silu(gate)·up
/// ([`Kernels::gate_up_silu`]).
#[derive(Debug, Clone)]
enum GateUp<K: Kernels> {
    Separate(Linear<K>, Linear<K>),
    Fused(Linear<K>, usize),
}

impl<K: Kernels> Mlp<K> {
    /// Whether the backend multiplies each row by these weights independently of the others.
    pub(crate) fn row_independent(&self) -> bool {
        let w = |l: &Linear<K>| self.k.row_independent(l.weight());
        let gate_up = match &self.gate_up {
            GateUp::Separate(g, u) => w(g) && w(u),
            GateUp::Fused(f, _) => w(f),
        };
        gate_up && w(&self.down_proj)
    }

    /// `vb` at `...layers.{i}.mlp`.
    pub fn new(k: &K, cfg: &TextConfig, vb: Weights) -> Result<Self> {
        let (d, i) = (cfg.hidden_size, cfg.intermediate_size);
        let gate = Linear::load(k, &vb.pp("gate_proj"), d, i)?;
        let up = Linear::load(k, &vb.pp("up_proj"), d, i)?;
        let gate_up = match Linear::fuse_gate_up(&gate, &up) {
            Some(fused) => GateUp::Fused(fused, i),
            None => GateUp::Separate(gate, up),
        };
        Ok(Mlp {
            k: k.clone(),
            gate_up,
            down_proj: Linear::load(k, &vb.pp("down_proj"), i, d)?,
        })
    }

    /// x: (n, hidden) -> (n, hidden).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = match &self.gate_up {
            GateUp::Separate(gate, up) => {
                let gate = candle_nn::ops::silu(&gate.forward(x)?)?; // (n, inter)
                (gate * up.forward(x)?)?
            }
            GateUp::Fused(gate_up, inter) => gate_up.forward_gate_up_silu(x, *inter)?,
        };
        self.down_proj.forward(&h)
    }
}
