//! One ViT block (reference: Qwen3VLVisionBlock, Qwen3VLVisionAttention, Qwen3VLVisionMLP):
//! pre-LN, `x += proj(attn(norm1(x)))`, `x += fc2(gelu_tanh(fc1(norm2(x))))`.
use super::attention::{attention_blocked, Span};
use super::linear::{LayerNorm, Linear};
use crate::error::Result;
use crate::kernels::Kernels;
use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;
use vlm_compute::VisionConfig;

/// Per-run inputs shared by every block: the rope tables and the attention spans.
pub struct AttnContext<'a> {
    /// (rows, hd/2) f32.
    pub cos: &'a Tensor,
    /// (rows, hd/2) f32.
    pub sin: &'a Tensor,
    pub spans: &'a [Span],
}

/// `attn`: fused qkv projection, 2-D rope on q and k, attention per frame, output projection.
#[derive(Debug, Clone)]
pub struct VisionAttention<K: Kernels> {
    /// D -> 3D, output `[q | k | v]`, each `[head][hd]`.
    pub qkv: Linear<K>,
    /// D -> D.
    pub proj: Linear<K>,
    pub num_heads: usize,
    pub head_dim: usize,
}

impl<K: Kernels> VisionAttention<K> {
    pub fn new(k: &K, cfg: &VisionConfig, vb: VarBuilder, dtype: DType) -> Result<Self> {
        let d = cfg.hidden_size;
        Ok(VisionAttention {
            qkv: Linear::new(k, vb.pp("qkv"), d, 3 * d, dtype)?,
            proj: Linear::new(k, vb.pp("proj"), d, d, dtype)?,
            num_heads: cfg.num_heads,
            head_dim: cfg.head_dim(),
        })
    }

    /// (N, D) f32 -> (N, D) f32.
    pub fn forward(&self, x: &Tensor, ctx: &AttnContext) -> Result<Tensor> {
        let (n, d) = x.dims2()?;
        let (h, hd) = (self.num_heads, self.head_dim);
        // 1. qkv: (N, 3D) -> (N, 3, H, hd) -> (3, H, N, hd)
        let qkv = self
            .qkv
            .forward(x)?
            .reshape((n, 3, h, hd))?
            .permute((1, 2, 0, 3))?;
        // 2. rope on q and k in f32 (apply_rotary_pos_emb_vision): (1, H, N, hd)
        let rope = |t: Tensor| -> Result<Tensor> {
            let t = t.contiguous()?.unsqueeze(0)?;
            Ok(candle_nn::rotary_emb::rope(&t, ctx.cos, ctx.sin)?.squeeze(0)?)
        };
        let q = rope(qkv.get(0)?)?;
        let k = rope(qkv.get(1)?)?;
        let v = qkv.get(2)?.contiguous()?;
        // 3. attention per span: (H, N, hd)
        let o = attention_blocked(&q, &k, &v, ctx.spans, (hd as f64).powf(-0.5))?;
        // 4. (H, N, hd) -> (N, H, hd) -> (N, D) -> proj
        let o = o.transpose(0, 1)?.reshape((n, d))?;
        self.proj.forward(&o)
    }
}

/// `mlp`: linear_fc1 -> gelu (tanh approximation, `gelu_pytorch_tanh`) -> linear_fc2.
#[derive(Debug, Clone)]
pub struct VisionMlp<K: Kernels> {
    /// D -> I.
    pub linear_fc1: Linear<K>,
    /// I -> D.
    pub linear_fc2: Linear<K>,
}

impl<K: Kernels> VisionMlp<K> {
    pub fn new(k: &K, cfg: &VisionConfig, vb: VarBuilder, dtype: DType) -> Result<Self> {
        let (d, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(VisionMlp {
            linear_fc1: Linear::new(k, vb.pp("linear_fc1"), d, i, dtype)?,
            linear_fc2: Linear::new(k, vb.pp("linear_fc2"), i, d, dtype)?,
        })
    }

    /// (N, D) -> (N, D).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.linear_fc1.forward(x)?.gelu()?; // (N, I), tanh approximation
        self.linear_fc2.forward(&h)
    }
}

/// `blocks.{i}`.
#[derive(Debug, Clone)]
pub struct VisionBlock<K: Kernels> {
    pub norm1: LayerNorm,
    pub norm2: LayerNorm,
    pub attn: VisionAttention<K>,
    pub mlp: VisionMlp<K>,
}

impl<K: Kernels> VisionBlock<K> {
    pub fn new(k: &K, cfg: &VisionConfig, vb: VarBuilder, dtype: DType) -> Result<Self> {
        Ok(VisionBlock {
            norm1: LayerNorm::new(vb.pp("norm1"), cfg.hidden_size)?,
            norm2: LayerNorm::new(vb.pp("norm2"), cfg.hidden_size)?,
            attn: VisionAttention::new(k, cfg, vb.pp("attn"), dtype)?,
            mlp: VisionMlp::new(k, cfg, vb.pp("mlp"), dtype)?,
        })
    }

    /// (N, D) -> (N, D).
    pub fn forward(&self, x: &Tensor, ctx: &AttnContext) -> Result<Tensor> {
        let x = (x + self.attn.forward(&self.norm1.forward(x)?, ctx)?)?;
        Ok((&x + self.mlp.forward(&self.norm2.forward(&x)?)?)?)
    }
}
