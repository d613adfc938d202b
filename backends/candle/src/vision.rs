//! The ViT in candle's ops behind the seam's `VisionBackend`: the model's own forward run at
//! the bucket's rows (`vlm_model::vision::buckets::run_padded`); buffers are per run. Generic
//! over the [`Kernels`] so that another backend on candle devices (`backends/cuda`) loads its
//! ViT through the same code.
use crate::ops::{device_for, device_name, CandleKernels};
use candle_core::Device;
use std::path::Path;
use vlm_compute::{
    BackendInfo, BucketMemory, ComputeError, PixelValues, Result, VisionBackend, VisionMemory,
    VisionRun,
};
use vlm_config::plan::ModelDims;
use vlm_model::vision::{buckets, VisionModel};
use vlm_model::Kernels;

/// The ViT on one device of the pool (its own copy of the weights).
#[derive(Debug)]
pub struct CandleVision<K: Kernels = CandleKernels> {
    model: VisionModel<K>,
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
    load_with(dir, dtype, bucket_lens, devices, "candle", |ordinal| {
        let device = device_for(ordinal).map_err(ComputeError::from)?;
        let name = device_name(&device, ordinal);
        Ok((CandleKernels::new(device), name))
    })
}

/// Loads the vision tower on each device of the pool with the kernels `open` makes for a device
/// ordinal (with the device's name for `Info`), reported as `backend`.
pub fn load_with<K: Kernels>(
    dir: &Path,
    dtype: vlm_config::Dtype,
    bucket_lens: &[usize],
    devices: &[u32],
    backend: &'static str,
    open: impl Fn(u32) -> Result<(K, String)>,
) -> Result<Vec<CandleVision<K>>> {
    let dims = ModelDims::from_dir(dir).map_err(|e| ComputeError::Weights(e.to_string()))?;
    let weight_bytes =
        vlm_model::sizing::weight_bytes(&dims, vlm_config::plan::Part::Visual, dtype);
    let dtype = vlm_model::dtype::candle_dtype(dtype);
    // On the host every core shares one copy of the weights (tensors share their storage when
    // cloned); each GPU holds its own.
    let mut host_model: Option<VisionModel<K>> = None;
    devices
        .iter()
        .map(|&ordinal| {
            let (kernels, device_label) = open(ordinal)?;
            let on_host = matches!(kernels.device(), Device::Cpu);
            let model = match (&host_model, on_host) {
                (Some(m), true) => m.clone(),
                _ => {
                    let m = VisionModel::load(&kernels, dir, dtype).map_err(ComputeError::from)?;
                    if on_host {
                        host_model = Some(m.clone());
                    }
                    m
                }
            };
            let lens = buckets::prepare(bucket_lens, model.config().merge_unit())?;
            let memory = VisionMemory {
                weight_bytes,
                weights_shared: on_host,
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
                    backend,
                    device: device_label,
                    dtype: vlm_model::dtype::host_dtype(dtype),
                    kernels: vec![("ops".into(), kernels.name().into())],
                },
            })
        })
        .collect()
}

impl<K: Kernels> VisionBackend for CandleVision<K> {
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

impl<K: Kernels> CandleVision<K> {
    pub fn model(&self) -> &VisionModel<K> {
        &self.model
    }
}
