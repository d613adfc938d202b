//! Bucket choice: the ViT graph for an image's patch count and the decode graph for an active
//! batch, and how an image is planned under `visual.oversize`.
use crate::error::BucketError;
use crate::geometry::{image_geometry, GeometryError, ImageGeometry, PATCH_SIZE};
use crate::types::{DeployConfig, Oversize, VisualConfig};

impl VisualConfig {
    /// The smallest ViT bucket that holds `patches` raw 16-px patches.
    pub fn bucket_for(&self, patches: u64) -> Result<u32, BucketError> {
        self.max_seq_len
            .iter()
            .copied()
            .find(|&b| b as u64 >= patches)
            .ok_or_else(|| BucketError::OverLargestVitBucket {
                patches,
                largest: self.largest_bucket(),
                buckets: self.max_seq_len.clone(),
            })
    }

    pub fn largest_bucket(&self) -> u32 {
        self.max_seq_len.last().copied().unwrap_or(0)
    }

    /// Where a `width`x`height` image lands: the processor's resize, then, when its patch count
    /// is over the largest bucket, either an error (`reject`) or a smaller resize that fits
    /// (`downscale`, same aspect ratio).
    pub fn plan_image(&self, width: u32, height: u32) -> Result<PlannedImage, ImagePlanError> {
        self.plan_image_within(width, height, PixelBudget::default())
    }

    /// [`Self::plan_image`] under a request's own pixel budget (OpenAI's `detail`, vLLM's
    /// `mm_processor_kwargs`), bounded by this config: never more than `max_pixels`, and a
    /// lower `max` lowers the floor with it.
    pub fn plan_image_within(
        &self,
        width: u32,
        height: u32,
        budget: PixelBudget,
    ) -> Result<PlannedImage, ImagePlanError> {
        let (min_pixels, max_pixels) = budget.resolve(self.min_pixels, self.max_pixels)?;
        let geo = image_geometry(width, height, min_pixels, max_pixels)?;
        match self.bucket_for(geo.patches()) {
            Ok(bucket) => Ok(PlannedImage {
                geometry: geo,
                bucket,
                downscaled: false,
            }),
            Err(e) if self.oversize == Oversize::Reject => Err(e.into()),
            Err(e) => {
                let limit_pixels =
                    self.largest_bucket() as u64 * (PATCH_SIZE as u64 * PATCH_SIZE as u64);
                let geo =
                    image_geometry(width, height, min_pixels.min(limit_pixels), limit_pixels)?;
                let bucket = self.bucket_for(geo.patches()).map_err(|_| e)?;
                Ok(PlannedImage {
                    geometry: geo,
                    bucket,
                    downscaled: true,
                })
            }
        }
    }
}

impl DeployConfig {
    /// The smallest decode graph (from `decoder_batch_sizes`) that holds `active` sequences.
    pub fn decoder_graph_for(&self, active: u32) -> Result<u32, BucketError> {
        if active == 0 {
            return Err(BucketError::EmptyBatch);
        }
        self.decoder_batch_sizes
            .iter()
            .copied()
            .find(|&b| b >= active)
            .ok_or(BucketError::OverBatchSize {
                active,
                batch_size: self.batch_size,
            })
    }
}

/// An image's resize and ViT bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct PlannedImage {
    pub geometry: ImageGeometry,
    pub bucket: u32,
    /// True when `oversize: downscale` shrank it to fit the largest bucket.
    pub downscaled: bool,
}

/// Why an image cannot be planned.
/// A request's pixel budget for one image: `None` = the config's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PixelBudget {
    pub min_pixels: Option<u64>,
    pub max_pixels: Option<u64>,
}

impl PixelBudget {
    /// (min, max) within the config's: max at most the config's max; min defaults to the
    /// config's but never above max; a min above the config's max is refused.
    pub fn resolve(self, cfg_min: u64, cfg_max: u64) -> Result<(u64, u64), ImagePlanError> {
        if let Some(m) = self.min_pixels.filter(|&m| m > cfg_max) {
            return Err(ImagePlanError::Budget(format!(
                "min_pixels {m} is over the server's max_pixels of {cfg_max}"
            )));
        }
        if let (Some(lo), Some(hi)) = (self.min_pixels, self.max_pixels) {
            if lo > hi {
                return Err(ImagePlanError::Budget(format!(
                    "min_pixels {lo} is over max_pixels {hi}"
                )));
            }
        }
        let max = self.max_pixels.map_or(cfg_max, |m| m.min(cfg_max));
        let min = self.min_pixels.unwrap_or(cfg_min).min(max);
        Ok((min, max))
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ImagePlanError {
    #[error(transparent)]
    Geometry(#[from] GeometryError),
    #[error("{0}")]
    Budget(String),
    #[error(transparent)]
    Bucket(#[from] BucketError),
}
