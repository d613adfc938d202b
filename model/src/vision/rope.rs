//! The ViT's 2-D ("axial") rotary embedding (reference: Qwen3VLVisionRotaryEmbedding,
//! get_vision_position_ids, apply_rotary_pos_emb_vision). For head_dim hd:
//! `inv_freq = 1/theta^(arange(0, hd/2, 2)/(hd/2))` (hd/4 values), the angle of a patch at
//! (row, col) is `cat(row*inv_freq, col*inv_freq)` (hd/2 values) and `emb = cat(f, f)`, applied
//! as `x*cos + rotate_half(x)*sin` in f32. Tables here hold the hd/2 distinct angles.
use super::pos_embed::merge_block_coords;
use crate::error::Result;
use candle_core::{Device, Tensor};

/// The ViT's rope base (`vision_config.rope_parameters.rope_theta`, default 10000).
pub const VISION_ROPE_THETA: f32 = 10000.0;

#[derive(Debug, Clone)]
pub struct VisionRope {
    /// hd/4 inverse frequencies, f32 as torch computes them.
    inv_freq: Vec<f32>,
    merge: usize,
}

impl VisionRope {
    pub fn new(head_dim: usize, merge: usize, theta: f32) -> Self {
        let spatial = head_dim / 2;
        let inv_freq = (0..spatial)
            .step_by(2)
            .map(|i| 1.0f32 / theta.powf(i as f32 / spatial as f32))
            .collect();
        VisionRope { inv_freq, merge }
    }

    /// Width of the cos / sin tables: hd/2.
    pub fn half_dim(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// cos and sin, each (rows, hd/2) row-major, for a t x h x w grid in merge-block order;
    /// rows past t*h*w (padding) get angle 0 (cos 1, sin 0).
    pub fn tables(&self, grid_thw: [usize; 3], rows: usize) -> (Vec<f32>, Vec<f32>) {
        let [t, h, w] = grid_thw;
        let half = self.half_dim();
        let quarter = self.inv_freq.len();
        let mut cos = vec![1f32; rows * half];
        let mut sin = vec![0f32; rows * half];
        let frame = h * w;
        for n in 0..(t * frame).min(rows) {
            let (r, c) = merge_block_coords(n % frame, w, self.merge);
            for (j, &f) in self.inv_freq.iter().enumerate() {
                let (a_r, a_c) = (r as f32 * f, c as f32 * f);
                cos[n * half + j] = a_r.cos();
                sin[n * half + j] = a_r.sin();
                cos[n * half + quarter + j] = a_c.cos();
                sin[n * half + quarter + j] = a_c.sin();
            }
        }
        (cos, sin)
    }

    /// [`Self::tables`] as (rows, hd/2) f32 tensors on `device`.
    pub fn forward(
        &self,
        grid_thw: [usize; 3],
        rows: usize,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let half = self.half_dim();
        let (cos, sin) = self.tables(grid_thw, rows);
        let cos = Tensor::from_vec(cos, (rows, half), &Device::Cpu)?.to_device(device)?;
        let sin = Tensor::from_vec(sin, (rows, half), &Device::Cpu)?.to_device(device)?;
        Ok((cos, sin))
    }
}
