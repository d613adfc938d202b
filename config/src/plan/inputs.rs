//! What a plan is asked about: the two parts, and the what-ifs besides the config.
use crate::types::Dtype;
use serde::Serialize;

/// What-ifs the plan takes besides the config.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PlanOptions {
    /// Dtype of weights, KV cache and activations, over the kind's native one.
    pub dtype: Option<Dtype>,
    /// Plan `kvcache_num_blocks: 0` as `batch_size` full-length sequences (the library's
    /// default when the key is unset) instead of the largest count that fits; a layout fits
    /// only when every sequence slot can hold a full-length context.
    pub require_full_batch: bool,
}

/// One of the two parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Part {
    /// The ViT (`visual`), served by vision-service.
    Visual,
    /// The decoder (top level), served by lm-service.
    Lm,
}

impl Part {
    pub fn as_str(self) -> &'static str {
        match self {
            Part::Visual => "visual",
            Part::Lm => "lm",
        }
    }
}
