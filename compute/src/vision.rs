//! The vision side of the seam: one device's ViT, prepared at the configured input-length
//! buckets.
use crate::embeds::ImageEmbeds;
use crate::error::{ComputeError, Result};
use crate::info::BackendInfo;
use crate::memory::VisionMemory;
use crate::pixels::PixelValues;

/// What one bucketed run returns.
#[derive(Debug, Clone)]
pub struct VisionRun {
    /// Sliced to the image's real rows.
    pub embeds: ImageEmbeds,
    /// The bucket (raw patches) the image ran in.
    pub bucket: usize,
    /// Share of the bucket's rows that were padding, in [0, 1).
    pub padding_fraction: f32,
}

/// What the vision service needs from compute: one instance per device of the pool, each run
/// from its own compute thread, one image at a time.
pub trait VisionBackend: Send + Sync {
    fn info(&self) -> &BackendInfo;
    /// The buckets in raw patches, ascending.
    fn buckets(&self) -> &[usize];
    fn memory(&self) -> VisionMemory;
    /// Runs one image (`t*h*w` rows) padded to `bucket` rows, which holds it; padding rows take
    /// no part in the real rows' results.
    fn encode_in(&self, bucket: usize, pixels: &PixelValues) -> Result<VisionRun>;

    /// The smallest bucket holding `patches` raw patches.
    fn bucket_for(&self, patches: usize) -> Option<usize> {
        self.buckets().iter().copied().find(|&b| b >= patches)
    }

    /// Runs one image in the smallest bucket that holds it. Over the largest bucket ->
    /// InvalidInput naming both numbers.
    fn encode(&self, pixels: &PixelValues) -> Result<VisionRun> {
        let rows = pixels.rows();
        let [t, h, w] = pixels.grid_thw;
        let bucket = self.bucket_for(rows).ok_or_else(|| {
            ComputeError::invalid(format!(
                "image has {rows} patches (grid {t}x{h}x{w}), over the largest ViT bucket of {} patches",
                self.buckets().last().copied().unwrap_or(0)
            ))
        })?;
        self.encode_in(bucket, pixels)
    }
}
