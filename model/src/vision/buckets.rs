//! Fixed-shape ViT runs ("bucket graphs"): an image of n raw patches runs padded to the smallest
//! bucket >= n. Padding rows carry zero pixels and zero position embeddings, padding keys are
//! never attended (every real row's keys lie inside its own frame, see [`super::spans_for`]),
//! padding query rows are computed and discarded, and the outputs are sliced back to the real
//! rows. Every backend's bucketed run keeps these rules; this module has the shared parts.
use super::model::{VisionModel, VisionOutput};
use crate::error::{ModelError, Result};
use crate::kernels::Kernels;
use candle_core::{DType, Tensor};
use vlm_compute::PixelValues;

/// The buckets as a backend prepares them: ascending, deduplicated, each a positive multiple of
/// the merge unit (4 raw patches).
pub fn prepare(buckets: &[usize], merge_unit: usize) -> Result<Vec<usize>> {
    if buckets.is_empty() {
        return Err(ModelError::invalid("no ViT buckets given"));
    }
    if let Some(&bad) = buckets
        .iter()
        .find(|&&b| b == 0 || b % merge_unit.max(1) != 0)
    {
        return Err(ModelError::invalid(format!(
            "ViT bucket {bad} must be a positive multiple of {merge_unit} (the merge unit)"
        )));
    }
    let mut lens = buckets.to_vec();
    lens.sort_unstable();
    lens.dedup();
    Ok(lens)
}

/// The pixel rows as a (rows, patch_dim) f32 tensor on `device`.
pub fn pixels_tensor(pv: &PixelValues, device: &candle_core::Device) -> Result<Tensor> {
    Ok(Tensor::from_vec(
        pv.values.clone(),
        (pv.rows(), pv.row_len()),
        device,
    )?)
}

/// The model's own forward at `bucket` rows: the image's rows then zero rows, outputs sliced
/// back to the image's tokens (the candle backend's bucketed run).
pub fn run_padded<K: Kernels>(
    model: &VisionModel<K>,
    pv: &PixelValues,
    bucket: usize,
) -> Result<VisionOutput> {
    let grid = pv.grid_thw;
    let rows = pv.rows();
    model.check_input(&[rows, pv.row_len()], grid)?;
    if bucket < rows {
        return Err(ModelError::invalid(format!(
            "image of {rows} patches run in a bucket of {bucket}"
        )));
    }
    let values = pixels_tensor(pv, model.device())?;
    let padded = if bucket > rows {
        let pad = Tensor::zeros((bucket - rows, values.dim(1)?), DType::F32, values.device())?;
        Tensor::cat(&[&values, &pad], 0)?
    } else {
        values
    };
    let tokens = rows / model.config().merge_unit();
    let (merged, deepstack) = model.run_rows(&padded, grid, bucket, None)?;
    Ok(VisionOutput {
        embeds: merged.narrow(0, 0, tokens)?,
        deepstack: deepstack
            .into_iter()
            .map(|d| Ok(d.narrow(0, 0, tokens)?))
            .collect::<Result<Vec<_>>>()?,
        grid_thw: grid,
    })
}
