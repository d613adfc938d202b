//! What one forward step of the decoder computes: a prefill chunk of one sequence, or one decode
//! token for each row of a padded decode batch (the seam's [`PrefillChunk`] and [`DecodeRow`]).
use crate::error::{ModelError, Result};
use vlm_compute::{DecodeRow, PrefillChunk};

/// One forward step.
#[derive(Debug, Clone)]
pub enum BatchInput {
    Prefill(PrefillChunk),
    Decode(DecodeBatch),
}

/// One decode step over a decoder-batch bucket: `rows.len()` is the bucket size; `None` rows
/// are padding (their K/V go to the dummy block, they read no cache, their logits are garbage).
/// Logits: (rows.len(), vocab).
#[derive(Debug, Clone)]
pub struct DecodeBatch {
    pub rows: Vec<Option<DecodeRow>>,
}

impl DecodeBatch {
    /// `rows` padded with `None` up to `bucket` rows.
    pub fn padded(rows: Vec<DecodeRow>, bucket: usize) -> Result<Self> {
        if rows.len() > bucket {
            return Err(ModelError::invalid(format!(
                "{} decode rows do not fit a bucket of {bucket}",
                rows.len()
            )));
        }
        let mut rows: Vec<Option<DecodeRow>> = rows.into_iter().map(Some).collect();
        rows.resize(bucket, None);
        Ok(DecodeBatch { rows })
    }
}
