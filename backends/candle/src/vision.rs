//! The ViT in candle's ops behind the seam's `VisionBackend`: the model's own forward run at
//! the bucket's rows (`vlm_model::vision::buckets::run_padded`); buffers are per run.
use crate::ops::{device_for, device_name, CandleKernels};
use std::path::Path;
use vlm_compute::{
    BackendInfo, BucketMemory, ComputeError, PixelValues, Result, VisionBackend, VisionMemory,
    VisionRun,
};
use vlm_config::plan::ModelDims;
use vlm_model::vision::{buckets, VisionModel};

/// The ViT on one device of the pool (its own copy of the weights).
#[derive(Debug)]
pub struct CandleVision {
    model: VisionModel<CandleKernels>,
    buckets: Vec<usize>,
    memory: VisionMemory,
    info: BackendInfo,
}

/// Loads the vision tower on each device of the pool.
pub fn load(
    dir: &Path,
    dtype: vlm_config::Dtype,
    bucket_lens: &[usize],
    devices: &[u32],
) -> Result<Vec<CandleVision>> {
    let dims = ModelDims::from_dir(dir).map_err(|e| ComputeError::Weights(e.to_string()))?;
    let weight_bytes =
        vlm_model::sizing::weight_bytes(&dims, vlm_config::plan::Part::Visual, dtype);
    let dtype = vlm_model::dtype::candle_dtype(dtype);
    // On the host every core shares one copy of the weights (tensors share their storage when
    // cloned); each GPU holds its own.
    let mut host_model: Option<VisionModel<CandleKernels>> = None;
    devices
        .iter()
        .map(|&ordinal| {
            let device = device_for(ordinal).map_err(ComputeError::from)?;
            let model = match (&host_model, device.is_cpu()) {
                (Some(m), true) => m.clone(),
                _ => {
                    let kernels = CandleKernels::new(device.clone());
                    let m = VisionModel::load(&kernels, dir, dtype).map_err(ComputeError::from)?;
                    if device.is_cpu() {
                        host_model = Some(m.clone());
                    }
                    m
                }
            };
            let lens = buckets::prepare(bucket_lens, model.config().merge_unit())?;
            let memory = VisionMemory {
                weight_bytes,
                weights_shared: device.is_cpu(),
                buckets: lens
                    .iter()
                    .map(|&b| BucketMemory {
                        bucket: b,
                        bytes: 4 * vlm_config::plan::graph_vit_elems(&dims, b as u64),
                        held_bytes: 0,
                    })
                    .collect(),
            };
            Ok(CandleVision {
                model,
                buckets: lens,
                memory,
                info: BackendInfo {
                    backend: "candle",
                    device: device_name(&device, ordinal),
                    dtype: vlm_model::dtype::host_dtype(dtype),
                    kernels: vec![("ops".into(), "candle".into())],
                },
            })
        })
        .collect()
}

impl VisionBackend for CandleVision {
    fn info(&self) -> &BackendInfo {
        &self.info
    }
    fn buckets(&self) -> &[usize] {
        &self.buckets
    }
    fn memory(&self) -> VisionMemory {
        self.memory.clone()
    }
    fn encode_in(&self, bucket: usize, pv: &PixelValues) -> Result<VisionRun> {
        if !self.buckets.contains(&bucket) {
            return Err(ComputeError::invalid(format!(
                "{bucket} is not one of the ViT buckets {:?}",
                self.buckets
            )));
        }
        let rows = pv.rows();
        let out = buckets::run_padded(&self.model, pv, bucket).map_err(ComputeError::from)?;
        Ok(VisionRun {
            embeds: out.to_host().map_err(ComputeError::from)?,
            bucket,
            padding_fraction: (bucket - rows) as f32 / bucket as f32,
        })
    }
}

impl CandleVision {
    pub fn model(&self) -> &VisionModel<CandleKernels> {
        &self.model
    }
}
