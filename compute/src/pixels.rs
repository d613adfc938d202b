//! The ViT's input, as the media preprocessing hands it over: patch rows and their grid.

/// The ViT's input for one image.
#[derive(Debug, Clone)]
pub struct PixelValues {
    /// (grid_t*grid_h*grid_w) rows of C*T*P*P f32 values, row-major, rows in merge-block order.
    pub values: Vec<f32>,
    /// `image_grid_thw` in raw patches.
    pub grid_thw: [usize; 3],
}

impl PixelValues {
    /// Raw patches per temporal patch, h * w (the bucket unit).
    pub fn patches(&self) -> usize {
        self.grid_thw[1] * self.grid_thw[2]
    }
    /// Rows of `values`: t * h * w.
    pub fn rows(&self) -> usize {
        self.grid_thw.iter().product()
    }
    /// Values per row (C*T*P*P, 1536 for Qwen3-VL); 0 for an empty grid.
    pub fn row_len(&self) -> usize {
        self.values.len().checked_div(self.rows()).unwrap_or(0)
    }
}
