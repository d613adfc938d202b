//! `Qwen3VLTextMLP`: `down(silu(gate(x)) * up(x))`.
use super::linear::Linear;
use crate::config::TextConfig;
use crate::error::Result;
use candle_core::Tensor;
use candle_nn::VarBuilder;

#[derive(Debug, Clone)]
pub struct Mlp {
    gate_up: GateUp,
    down_proj: Linear,
}

/// gate and up projections: two layers, or one with both weights stacked (packed bf16), whose
/// output `[gate | up]` goes through one fused silu-multiply pass.
#[derive(Debug, Clone)]
enum GateUp {
    Separate(Linear, Linear),
    Fused(Linear, usize),
}

impl Mlp {
    /// `vb` at `...layers.{i}.mlp`.
    pub fn new(cfg: &TextConfig, vb: VarBuilder) -> Result<Self> {
        let (d, i) = (cfg.hidden_size, cfg.intermediate_size);
        let gate = Linear::load(&vb.pp("gate_proj"), d, i)?;
        let up = Linear::load(&vb.pp("up_proj"), d, i)?;
        let gate_up = match Linear::fuse(&[&gate, &up]) {
            Some(fused) => GateUp::Fused(fused, i),
            None => GateUp::Separate(gate, up),
        };
        Ok(Mlp {
            gate_up,
            down_proj: Linear::load(&vb.pp("down_proj"), i, d)?,
        })
    }

    /// x: (n, hidden) -> (n, hidden).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = match &self.gate_up {
            GateUp::Separate(gate, up) => {
                let gate = candle_nn::ops::silu(&gate.forward(x)?)?; // (n, inter)
                (gate * up.forward(x)?)?
            }
            GateUp::Fused(gate_up, inter) => silu_mul(&gate_up.forward(x)?, *inter)?,
        };
        self.down_proj.forward(&h)
    }
}

/// y: (n, 2 * inter) = [gate | up] -> (n, inter) = silu(gate) * up, one pass.
fn silu_mul(y: &Tensor, inter: usize) -> Result<Tensor> {
    use rayon::prelude::*;
    let n = y.dim(0)?;
    let y = y.contiguous()?;
    let view = crate::cpu::cpu_view::CpuF32::new(&y, "fused gate/up output")?;
    let data = view.slice();
    let mut out = vec![0f32; n * inter];
    out.par_chunks_mut(inter)
        .zip(data.par_chunks(2 * inter))
        .for_each(|(o, row)| {
            let (gate, up) = row.split_at(inter);
            for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                *o = g / (1.0 + (-g).exp()) * u;
            }
        });
    drop(view);
    Ok(Tensor::from_vec(out, (n, inter), y.device())?)
}
