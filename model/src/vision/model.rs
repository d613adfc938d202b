//! `model.visual`: the Qwen3-VL ViT (reference: Qwen3VLVisionModel.forward).
use super::attention::spans_for;
use super::block::{AttnContext, VisionBlock};
use super::merger::PatchMerger;
use super::patch_embed::PatchEmbed;
use super::pos_embed::PosEmbed;
use super::rope::{VisionRope, VISION_ROPE_THETA};
use crate::error::{ModelError, Result};
use crate::kernels::Kernels;
use crate::weights::var_builder;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::path::Path;
use vlm_compute::{HostTensor, ImageEmbeds, Qwen3VlConfig, VisionConfig};

/// Checkpoint prefix of the vision tower.
pub const VISION_PREFIX: &str = "model.visual";

/// What the ViT computes for one image, as tensors on the model's device.
#[derive(Debug, Clone)]
pub struct VisionOutput {
    /// (tokens, out_hidden) merged embeddings.
    pub embeds: Tensor,
    /// Per deepstack level, (tokens, out_hidden).
    pub deepstack: Vec<Tensor>,
    pub grid_thw: [usize; 3],
}

impl VisionOutput {
    /// The seam's host form (f32 values).
    pub fn to_host(&self) -> Result<ImageEmbeds> {
        let host = |t: &Tensor| -> Result<HostTensor> {
            let t = t.to_dtype(DType::F32)?;
            let values = t.flatten_all()?.to_vec1::<f32>()?;
            Ok(HostTensor::from_f32(&values, t.dims().to_vec())?)
        };
        Ok(ImageEmbeds {
            embeds: host(&self.embeds)?,
            deepstack: self.deepstack.iter().map(host).collect::<Result<_>>()?,
            grid_thw: self.grid_thw,
        })
    }
}

/// The ViT with its mergers. Activations are f32; linear weights are in the compute dtype, held
/// as the backend's kernels want them.
#[derive(Debug, Clone)]
pub struct VisionModel<K: Kernels> {
    cfg: VisionConfig,
    dtype: DType,
    device: Device,
    pub patch_embed: PatchEmbed<K>,
    pub pos_embed: PosEmbed,
    pub rope: VisionRope,
    pub blocks: Vec<VisionBlock<K>>,
    pub merger: PatchMerger<K>,
    pub deepstack_merger_list: Vec<PatchMerger<K>>,
}

/// Intermediate tensors of one forward, for parity tests (names as in the golden files).
#[derive(Debug, Clone, Default)]
pub struct VisionTrace {
    /// `vision.patch_embed_out`, (N, D).
    pub patch_embed_out: Option<Tensor>,
    /// `vision.block_input`: patch embed + interpolated position embedding, (N, D).
    pub block_input: Option<Tensor>,
    /// `vision.block{i}_out`, each (N, D).
    pub block_out: Vec<Tensor>,
}

impl<K: Kernels> VisionModel<K> {
    /// Loads the vision tower of the checkpoint in `dir` (config.json + safetensors), reading only
    /// `model.visual.*` tensors. `dtype` is the compute dtype of the linear weights (F32, F16 or
    /// BF16; activations stay f32).
    pub fn load(k: &K, dir: &Path, dtype: DType) -> Result<VisionModel<K>> {
        let cfg = Qwen3VlConfig::from_dir(dir)?;
        // A quantized checkpoint this server does not run, or int8 or packed tensors in the
        // tower, are refused here by name, as the LM refuses them (the tower loads as floats).
        crate::w8a8::open_dir(dir)?;
        crate::w4a16::open_dir(dir)?;
        crate::fp8::open_dir(dir)?;
        let vb = var_builder(dir, DType::F32, k.device())?;
        VisionModel::new(k, &cfg.vision, vb.pp(VISION_PREFIX), dtype)
    }

    /// Builds the model from a VarBuilder positioned at `model.visual`.
    pub fn new(k: &K, cfg: &VisionConfig, vb: VarBuilder, dtype: DType) -> Result<VisionModel<K>> {
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(ModelError::weights(format!(
                "vision compute dtype {dtype:?} is not supported (f32, f16, bf16)"
            )));
        }
        let merge = cfg.spatial_merge_size;
        if merge == 0 || cfg.num_heads == 0 || !cfg.head_dim().is_multiple_of(4) {
            return Err(ModelError::weights(format!(
                "vision_config: spatial_merge_size {merge} must be positive and head_dim {} a multiple of 4",
                cfg.head_dim()
            )));
        }
        let device = vb.device().clone();
        let patch_embed = PatchEmbed::new(k, cfg, vb.pp("patch_embed"), dtype)?;
        let side = cfg.num_grid_per_side();
        let pos_embed = PosEmbed::new(
            vb.pp("pos_embed"),
            cfg.num_position_embeddings,
            cfg.hidden_size,
            side,
            merge,
        )?;
        let rope = VisionRope::new(cfg.head_dim(), merge, VISION_ROPE_THETA);
        let blocks = (0..cfg.depth)
            .map(|i| VisionBlock::new(k, cfg, vb.pp("blocks").pp(i), dtype))
            .collect::<Result<Vec<_>>>()?;
        let merger = PatchMerger::new(k, cfg, vb.pp("merger"), false, dtype)?;
        let deepstack_merger_list = (0..cfg.deepstack_visual_indexes.len())
            .map(|i| PatchMerger::new(k, cfg, vb.pp("deepstack_merger_list").pp(i), true, dtype))
            .collect::<Result<Vec<_>>>()?;
        Ok(VisionModel {
            cfg: cfg.clone(),
            dtype,
            device,
            patch_embed,
            pos_embed,
            rope,
            blocks,
            merger,
            deepstack_merger_list,
        })
    }

    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }
    /// Compute dtype of the linear weights.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Checks the shape of `pixel_values` (t*h*w, C*T*P*P) against `grid_thw`.
    pub fn check_input(&self, pixel_values: &[usize], grid_thw: [usize; 3]) -> Result<()> {
        let [t, h, w] = grid_thw;
        let m = self.cfg.spatial_merge_size;
        if t == 0 || h == 0 || w == 0 || h % m != 0 || w % m != 0 {
            return Err(ModelError::invalid(format!(
                "image grid {grid_thw:?} must be positive with h and w multiples of the merge size {m}"
            )));
        }
        let want = [t * h * w, self.cfg.patch_dim()];
        if pixel_values != want {
            return Err(ModelError::invalid(format!(
                "pixel_values shape {pixel_values:?} does not match grid {grid_thw:?}: expected {want:?}"
            )));
        }
        Ok(())
    }

    /// The exact, unpadded forward of one image (or one video's frames): merged embeddings and
    /// deepstack features. The numerical oracle for every backend's bucketed path, and the
    /// candle backend's forward (run at the bucket's rows, see [`Self::run_rows`]).
    pub fn forward(&self, pixel_values: &Tensor, grid_thw: [usize; 3]) -> Result<VisionOutput> {
        self.forward_traced(pixel_values, grid_thw, None)
    }

    /// [`Self::forward`], recording intermediates into `trace` when given.
    pub fn forward_traced(
        &self,
        pixel_values: &Tensor,
        grid_thw: [usize; 3],
        trace: Option<&mut VisionTrace>,
    ) -> Result<VisionOutput> {
        self.check_input(pixel_values.dims(), grid_thw)?;
        let rows = grid_thw.iter().product();
        let (embeds, deepstack) = self.run_rows(pixel_values, grid_thw, rows, trace)?;
        Ok(VisionOutput {
            embeds,
            deepstack,
            grid_thw,
        })
    }

    /// Runs the tower on `pixel_values` of `rows` >= t*h*w rows (the rest is padding, masked out
    /// of attention). Returns merged (rows/4, out) and deepstack features, padding included.
    pub fn run_rows(
        &self,
        pixel_values: &Tensor,
        grid_thw: [usize; 3],
        rows: usize,
        mut trace: Option<&mut VisionTrace>,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let pv = pixel_values.to_device(&self.device)?.to_dtype(DType::F32)?;
        // 1. patch embed: (rows, 1536) -> (rows, D)
        let x = self.patch_embed.forward(&pv)?;
        // 2. + interpolated learned positions (zero on padding rows)
        let pos = self.pos_embed.forward(grid_thw, rows)?;
        if let Some(t) = trace.as_deref_mut() {
            t.patch_embed_out = Some(x.clone());
        }
        let mut x = (x + pos)?;
        if let Some(t) = trace.as_deref_mut() {
            t.block_input = Some(x.clone());
        }
        // 3. rope tables (rows, hd/2) and attention spans
        let (cos, sin) = self.rope.forward(grid_thw, rows, &self.device)?;
        let spans = spans_for(grid_thw, rows);
        let ctx = AttnContext {
            cos: &cos,
            sin: &sin,
            spans: &spans,
        };
        // 4. blocks, tapping the deepstack levels
        let mut deepstack = Vec::with_capacity(self.deepstack_merger_list.len());
        for (i, block) in self.blocks.iter().enumerate() {
            x = block.forward(&x, &ctx)?;
            if let Some(t) = trace.as_deref_mut() {
                t.block_out.push(x.clone());
            }
            if let Some(k) = self
                .cfg
                .deepstack_visual_indexes
                .iter()
                .position(|&j| j == i)
            {
                deepstack.push(self.deepstack_merger_list[k].forward(&x)?);
            }
        }
        // 5. merger: (rows, D) -> (rows/4, out_hidden)
        let merged = self.merger.forward(&x)?;
        Ok((merged, deepstack))
    }
}
