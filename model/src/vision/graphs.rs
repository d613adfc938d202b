//! Fixed-shape ViT runs ("bucket graphs"): an image of n raw patches runs padded to the smallest
//! bucket >= n. Padding rows carry zero pixels and zero position embeddings, padding keys are
//! never attended (every real row's keys lie inside its own frame), padding query rows are
//! computed and discarded, and the outputs are sliced back to the real rows. (The mergers are
//! per-token, so the CPU engine runs them on the real tokens only.)
use super::engine::{self, Workspace};
use super::model::VisionModel;
use crate::embeds::ImageEmbeds;
use crate::error::{ModelError, Result};
use crate::preprocess::PixelValues;
use candle_core::{DType, Tensor};
use std::sync::{Arc, Mutex};

/// How the bucket graphs execute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraphBackend {
    /// The CPU engine (`vision/engine.rs`): buffers per bucket allocated at load, direct
    /// gemm calls, fused passes, tiled attention. Needs an f32 model on the CPU, or a bf16
    /// one on a CPU with AVX512-BF16 (then its products run on the bf16 kernel).
    CpuEngine,
    /// The model's candle ops on padded inputs (any device and dtype); buffers are allocated
    /// per run, sized by the bucket.
    Candle,
}

/// What one bucketed run returns.
#[derive(Debug, Clone)]
pub struct BucketRun {
    /// Sliced to the image's real rows.
    pub embeds: ImageEmbeds,
    /// The bucket (raw patches) the image ran in.
    pub bucket: usize,
    /// Share of the bucket's rows that were padding, in [0, 1).
    pub padding_fraction: f32,
}

/// One bucket: its length and what is fixed for it at load.
#[derive(Debug, Clone)]
struct Bucket {
    len: usize,
    memory_bytes: u64,
    /// The engine's buffers (CpuEngine backend). Runs of one bucket take turns on them.
    workspace: Option<Arc<Mutex<Workspace>>>,
}

/// Whether [`GraphBackend::CpuEngine`] can run `model`: f32 on the CPU, or bf16 with its
/// weights packed for the AVX512-BF16 kernel.
fn engine_runs(model: &VisionModel) -> bool {
    model.device().is_cpu()
        && (model.dtype() == DType::F32
            || (model.dtype() == DType::BF16 && model.patch_embed.proj.packed().is_some()))
}

/// The vision model prepared for a set of input-length buckets.
#[derive(Debug, Clone)]
pub struct VisionGraphs {
    model: Arc<VisionModel>,
    backend: GraphBackend,
    /// Ascending, deduplicated.
    buckets: Vec<Bucket>,
}

impl VisionGraphs {
    /// Prepares one fixed-shape run per bucket (raw patches per image; multiples of the merge
    /// unit, 4).
    /// Uses the CPU engine when the model can run on it (see [`GraphBackend::CpuEngine`]),
    /// else candle ops.
    pub fn new(model: Arc<VisionModel>, buckets: &[usize]) -> Result<VisionGraphs> {
        let backend = if engine_runs(&model) {
            GraphBackend::CpuEngine
        } else {
            GraphBackend::Candle
        };
        Self::with_backend(model, buckets, backend)
    }

    /// [`Self::new`] with an explicit backend.
    pub fn with_backend(
        model: Arc<VisionModel>,
        buckets: &[usize],
        backend: GraphBackend,
    ) -> Result<VisionGraphs> {
        if backend == GraphBackend::CpuEngine && !engine_runs(&model) {
            return Err(ModelError::invalid(format!(
                "the CPU ViT engine needs an f32 model on the CPU, or bf16 on a CPU with \
                 AVX512-BF16 (have {:?} on {:?})",
                model.dtype(),
                model.device()
            )));
        }
        let unit = model.config().merge_unit();
        if buckets.is_empty() {
            return Err(ModelError::invalid("no ViT buckets given"));
        }
        if let Some(&bad) = buckets.iter().find(|&&b| b == 0 || b % unit != 0) {
            return Err(ModelError::invalid(format!(
                "ViT bucket {bad} must be a positive multiple of {unit} (the merge unit)"
            )));
        }
        let mut lens = buckets.to_vec();
        lens.sort_unstable();
        lens.dedup();
        let buckets = lens
            .into_iter()
            .map(|len| match backend {
                GraphBackend::CpuEngine => Bucket {
                    len,
                    memory_bytes: Workspace::bytes(
                        model.config(),
                        len,
                        rayon::current_num_threads(),
                    ),
                    workspace: Some(Arc::new(Mutex::new(Workspace::new(model.config(), len)))),
                },
                GraphBackend::Candle => Bucket {
                    len,
                    memory_bytes: estimate_memory_bytes(&model, len),
                    workspace: None,
                },
            })
            .collect();
        Ok(VisionGraphs {
            model,
            backend,
            buckets,
        })
    }

    pub fn backend(&self) -> GraphBackend {
        self.backend
    }

    pub fn model(&self) -> &Arc<VisionModel> {
        &self.model
    }

    /// The bucket lengths, ascending.
    pub fn buckets(&self) -> Vec<usize> {
        self.buckets.iter().map(|b| b.len).collect()
    }

    /// The largest bucket.
    pub fn max_bucket(&self) -> usize {
        self.buckets.last().map(|b| b.len).unwrap_or(0)
    }

    /// The smallest bucket holding `patches` raw patches, or None when none does.
    pub fn bucket_for(&self, patches: usize) -> Option<usize> {
        self.buckets
            .iter()
            .map(|b| b.len)
            .find(|&len| len >= patches)
    }

    /// Estimated bytes one run of `bucket` holds at its peak (activations and scratch buffers,
    /// not weights). None for a length that is not a bucket.
    pub fn memory_bytes(&self, bucket: usize) -> Option<u64> {
        self.buckets
            .iter()
            .find(|b| b.len == bucket)
            .map(|b| b.memory_bytes)
    }

    /// Runs one image (t*h*w rows; t is 1 for an image) padded to the smallest bucket that holds
    /// it. Over the largest bucket -> InvalidInput naming both numbers.
    pub fn encode(&self, pv: &PixelValues) -> Result<BucketRun> {
        let grid = pv.grid_thw;
        self.model.check_input(&pv.values, grid)?;
        let rows = pv.rows();
        let bucket = self.bucket_for(rows).ok_or_else(|| {
            ModelError::invalid(format!(
                "image has {rows} patches (grid {}x{}x{}), over the largest ViT bucket of {} patches",
                grid[0],
                grid[1],
                grid[2],
                self.max_bucket()
            ))
        })?;
        let tokens = rows / self.model.config().merge_unit();
        let padding_fraction = (bucket - rows) as f32 / bucket as f32;
        let slot = self
            .buckets
            .iter()
            .find(|b| b.len == bucket)
            .and_then(|b| b.workspace.clone());
        if let Some(ws) = slot {
            let values = pv.values.to_dtype(DType::F32)?;
            let (merged, deepstack) = {
                let mut ws = ws.lock().map_err(|_| {
                    ModelError::invalid("ViT workspace poisoned by an earlier panic")
                })?;
                engine::run(&self.model, &mut ws, &values, grid)?
            };
            let out = self.model.config().out_hidden_size;
            let device = self.model.device();
            let embeds = Tensor::from_vec(merged, (tokens, out), device)?;
            let deepstack = deepstack
                .into_iter()
                .map(|d| Ok(Tensor::from_vec(d, (tokens, out), device)?))
                .collect::<Result<Vec<_>>>()?;
            return Ok(BucketRun {
                embeds: ImageEmbeds {
                    embeds,
                    deepstack,
                    grid_thw: grid,
                },
                bucket,
                padding_fraction,
            });
        }
        let values = pv.values.to_dtype(DType::F32)?;
        let padded = if bucket > rows {
            let pad = Tensor::zeros((bucket - rows, values.dim(1)?), DType::F32, values.device())?;
            Tensor::cat(&[&values, &pad], 0)?
        } else {
            values
        };
        let (merged, deepstack) = self.model.run_rows(&padded, grid, bucket, None)?;
        let embeds = merged.narrow(0, 0, tokens)?;
        let deepstack = deepstack
            .into_iter()
            .map(|d| Ok(d.narrow(0, 0, tokens)?))
            .collect::<Result<Vec<_>>>()?;
        Ok(BucketRun {
            embeds: ImageEmbeds {
                embeds,
                deepstack,
                grid_thw: grid,
            },
            bucket,
            padding_fraction,
        })
    }
}

/// Peak activation bytes of one run at `rows`: the residual stream, the norm output, qkv, the
/// attention output, the MLP hidden, one block of attention scores, the merger buffers, the
/// deepstack outputs and the rope / position tables. All f32.
pub fn estimate_memory_bytes(model: &VisionModel, rows: usize) -> u64 {
    let cfg = model.config();
    let (d, i, h) = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads);
    let tokens = rows / cfg.merge_unit().max(1);
    let merged = d * cfg.merge_unit();
    let per_row = d /* x */ + d /* norm */ + 3 * d /* qkv */ + 3 * d /* q, k, v per head */
        + d /* attn out */ + i /* mlp hidden */ + cfg.patch_dim() /* pixels */
        + d /* pos */ + cfg.head_dim() /* cos, sin */;
    let scores = super::attention::SCORE_BLOCK_ELEMS.min(h * rows * rows);
    let merger =
        tokens * (2 * merged + cfg.out_hidden_size * (1 + cfg.deepstack_visual_indexes.len()));
    4 * (rows * per_row + scores + merger) as u64
}
