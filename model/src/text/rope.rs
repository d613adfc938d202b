//! Interleaved multimodal RoPE (`Qwen3VLTextRotaryEmbedding`); the 3-D positions themselves
//! come from the seam's `get_rope_index`.
use crate::error::Result;
use candle_core::{Device, Tensor};
use vlm_compute::{Position3, TextConfig};

/// The rotary tables of the decoder: `inv_freq = 1/theta^(2j/head_dim)` for j < head_dim/2; the
/// frequency slot j takes the h position if `j%3==1 && j < 3*section[1]`, the w position if
/// `j%3==2 && j < 3*section[2]`, else the t position.
#[derive(Debug, Clone)]
pub struct MRope {
    inv_freq: Vec<f32>,
    /// Axis (0 t, 1 h, 2 w) of each of the head_dim/2 frequency slots.
    axis: Vec<u8>,
    head_dim: usize,
}

impl MRope {
    pub fn new(cfg: &TextConfig) -> Self {
        let hd = cfg.head_dim;
        let half = hd / 2;
        // torch computes `1.0 / base ** (arange(0, hd, 2).float() / hd)` in f32; rounding the
        // f64 value is within an ulp of it.
        let inv_freq = (0..half)
            .map(|j| (1.0 / cfg.rope_theta.powf((2 * j) as f64 / hd as f64)) as f32)
            .collect();
        let sec = cfg.mrope_section;
        let axis = (0..half)
            .map(|j| {
                if j % 3 == 1 && j < 3 * sec[1] {
                    1
                } else if j % 3 == 2 && j < 3 * sec[2] {
                    2
                } else {
                    0
                }
            })
            .collect();
        MRope {
            inv_freq,
            axis,
            head_dim: hd,
        }
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// cos and sin tables, each (n, head_dim/2) f32, one row per position: the "half" form that
    /// `candle_nn::rotary_emb::rope_thd` takes (`emb = cat(f, f)` in the reference).
    pub fn tables(&self, positions: &[Position3], device: &Device) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for p in positions {
            for (f, &a) in self.inv_freq.iter().zip(&self.axis) {
                // f32 product, as `position_ids.float() * inv_freq`.
                let ang = p[a as usize] as f32 * f;
                cos.push(ang.cos());
                sin.push(ang.sin());
            }
        }
        let n = positions.len();
        Ok((
            Tensor::from_vec(cos, (n, half), device)?,
            Tensor::from_vec(sin, (n, half), device)?,
        ))
    }
}

/// x (n, heads, head_dim) rotated by per-row tables cos, sin (n, head_dim/2), candle's
/// `rope_thd`: for k < d/2, `out[k] = x[k]·cos[k] - x[k+d/2]·sin[k]` and
/// `out[k+d/2] = x[k]·sin[k] + x[k+d/2]·cos[k]`.
pub fn rope_rows(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (n, h, d) = x.dims3()?;
    let x4 = x.contiguous()?.reshape((1, n, h, d))?;
    let y = candle_nn::rotary_emb::rope_thd(&x4, cos, sin)?;
    Ok(y.reshape((n, h, d))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleave_follows_the_section() {
        let cfg = TextConfig {
            vocab_size: 10,
            hidden_size: 8,
            intermediate_size: 8,
            num_hidden_layers: 1,
            num_attention_heads: 1,
            num_key_value_heads: 1,
            head_dim: 128,
            max_position_embeddings: 10,
            rms_norm_eps: 1e-6,
            attention_bias: false,
            rope_theta: 5e6,
            mrope_section: [24, 20, 20],
        };
        let r = MRope::new(&cfg);
        let t: Vec<usize> = (0..64).filter(|&j| r.axis[j] == 0).collect();
        assert_eq!(r.axis[0..6], [0, 1, 2, 0, 1, 2]);
        assert_eq!(&r.axis[57..64], &[0, 1, 2, 0, 0, 0, 0]);
        assert_eq!(t.len(), 24);
    }
}
