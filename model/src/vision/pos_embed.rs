//! The learned position table resampled to the image grid: bilinear, align_corners=True
//! (reference: vision_utils.get_vision_interpolation_indices_and_weights with mode "bilinear",
//! align_corners=True, and _interpolation_axis_taps_weights), emitted in merge-block order and
//! repeated per frame.
use crate::error::Result;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

/// Two taps and their weights on one axis: target index `i` of `size` over a `side` table.
/// Computed in f32 as the reference does: `src = i*(side-1)/max(size-1, 1)`,
/// taps `floor`, `floor+1` (clamped), weights `1-|src-floor-o|` clamped at 0.
pub fn axis_taps(i: usize, size: usize, side: usize) -> ([usize; 2], [f32; 2]) {
    let src = (i as f32 * (side - 1) as f32) / ((size.max(2) - 1) as f32);
    let src = if size == 1 { 0.0 } else { src };
    let floor = src.floor();
    let mut taps = [0usize; 2];
    let mut weights = [0f32; 2];
    for o in 0..2 {
        taps[o] = ((floor as usize) + o).min(side - 1);
        let distance = (src - floor - o as f32).abs();
        weights[o] = (1.0 - distance).max(0.0);
    }
    (taps, weights)
}

/// (row, col) of raw patch `index` of one frame in merge-block order.
pub fn merge_block_coords(index: usize, grid_w: usize, merge: usize) -> (usize, usize) {
    let blocks_w = grid_w / merge;
    let in_col = index % merge;
    let in_row = (index / merge) % merge;
    let block_col = (index / (merge * merge)) % blocks_w;
    let block_row = index / (merge * merge * blocks_w);
    (block_row * merge + in_row, block_col * merge + in_col)
}

/// `pos_embed`: an `Embedding(side*side, D)`.
#[derive(Debug, Clone)]
pub struct PosEmbed {
    /// (side*side, D) f32.
    table: Tensor,
    side: usize,
    merge: usize,
}

impl PosEmbed {
    /// Loads `{vb}.weight` (num_position_embeddings, D).
    pub fn new(
        vb: VarBuilder,
        num_positions: usize,
        dim: usize,
        side: usize,
        merge: usize,
    ) -> Result<Self> {
        let table = vb
            .to_dtype(DType::F32)
            .get((num_positions, dim), "weight")?;
        Ok(PosEmbed { table, side, merge })
    }

    /// Gather indices (rows, 4) and weights (rows, 4) for a t x h x w grid, padded with zero
    /// weights to `rows` (>= t*h*w).
    pub fn taps(&self, grid_thw: [usize; 3], rows: usize) -> (Vec<u32>, Vec<f32>) {
        let [t, h, w] = grid_thw;
        let mut idx = vec![0u32; rows * 4];
        let mut wts = vec![0f32; rows * 4];
        let frame = h * w;
        for n in 0..(t * frame).min(rows) {
            let (r, c) = merge_block_coords(n % frame, w, self.merge);
            let (rt, rw) = axis_taps(r, h, self.side);
            let (ct, cw) = axis_taps(c, w, self.side);
            for a in 0..2 {
                for b in 0..2 {
                    idx[n * 4 + a * 2 + b] = (rt[a] * self.side + ct[b]) as u32;
                    wts[n * 4 + a * 2 + b] = rw[a] * cw[b];
                }
            }
        }
        (idx, wts)
    }

    /// The interpolated embeddings, (rows, D) f32; rows past t*h*w are zero.
    pub fn forward(&self, grid_thw: [usize; 3], rows: usize) -> Result<Tensor> {
        let device = self.table.device();
        let (idx, wts) = self.taps(grid_thw, rows);
        let idx = Tensor::from_vec(idx, (rows, 4), &Device::Cpu)?.to_device(device)?;
        let wts = Tensor::from_vec(wts, (rows, 4), &Device::Cpu)?.to_device(device)?;
        let mut acc: Option<Tensor> = None;
        for k in 0..4 {
            let gathered = self
                .table
                .index_select(&idx.narrow(1, k, 1)?.squeeze(1)?, 0)?; // (rows, D)
            let term = gathered.broadcast_mul(&wts.narrow(1, k, 1)?)?;
            acc = Some(match acc {
                None => term,
                Some(a) => (a + term)?,
            });
        }
        match acc {
            Some(a) => Ok(a),
            None => Ok(Tensor::zeros(
                (rows, self.table.dim(1)?),
                DType::F32,
                device,
            )?),
        }
    }

    /// The table itself, (side*side, D) f32.
    pub fn table(&self) -> &Tensor {
        &self.table
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn align_corners_endpoints() {
        // First and last index land exactly on the table corners.
        assert_eq!(axis_taps(0, 14, 48), ([0, 1], [1.0, 0.0]));
        let (t, w) = axis_taps(13, 14, 48);
        assert_eq!(t, [47, 47]);
        assert_eq!(w[0], 1.0);
        assert_eq!(axis_taps(0, 1, 48), ([0, 1], [1.0, 0.0]));
    }

    #[test]
    fn merge_block_coords_order() {
        let coords: Vec<_> = (0..8).map(|i| merge_block_coords(i, 4, 2)).collect();
        assert_eq!(
            coords,
            [
                (0, 0),
                (0, 1),
                (1, 0),
                (1, 1),
                (0, 2),
                (0, 3),
                (1, 2),
                (1, 3)
            ]
        );
    }
}
