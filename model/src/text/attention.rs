//! `Qwen3VLTextAttention` over the paged KV cache: q/k/v projections, per-head q/k RMSNorm,
//! MRoPE, then the backend's attention (GQA over the cache), o projection.
use super::kv_cache::PagedKvCache;
use super::linear::Linear;
use super::norm::RmsNorm;
use super::step::{AttnCall, AttnRows};
use crate::error::{ModelError, Result};
use crate::kernels::Kernels;
use crate::weights::Weights;
use candle_core::Tensor;
use vlm_compute::TextConfig;

/// Everything a layer needs for one forward step besides its input.
pub(crate) struct Step<'a> {
    /// (n, head_dim/2) rotary tables of the step's rows.
    pub cos: Tensor,
    pub sin: Tensor,
    /// The step's rows in order, as runs that attend apart: a prefill chunk of one sequence,
    /// or a decode batch (one row per sequence). A packed step has several chunks and at most
    /// one decode batch (last).
    pub segments: Vec<Segment<'a>>,
    pub kv: &'a PagedKvCache,
}

/// `rows` consecutive rows of a step, attending as `attn` says.
pub(crate) struct Segment<'a> {
    pub rows: usize,
    pub attn: AttnRows<'a>,
}

/// q/k/v projections: three layers, or one with the three weights stacked (when the backend
/// fuses them).
#[derive(Debug, Clone)]
enum Projections<K: Kernels> {
    Separate(Linear<K>, Linear<K>, Linear<K>),
    Fused(Linear<K>),
}

#[derive(Debug, Clone)]
pub struct Attention<K: Kernels> {
    k: K,
    qkv: Projections<K>,
    o_proj: Linear<K>,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    scale: f64,
}

impl<K: Kernels> Attention<K> {
    /// `vb` at `...layers.{i}.self_attn`.
    pub fn new(k: &K, cfg: &TextConfig, vb: Weights) -> Result<Self> {
        if cfg.attention_bias {
            return Err(ModelError::weights(
                "text_config attention_bias=true is not supported (Qwen3-VL has no attention bias)",
            ));
        }
        let (h, kv, hd, d) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.hidden_size,
        );
        let q_proj = Linear::load(k, &vb.pp("q_proj"), d, h * hd)?;
        let k_proj = Linear::load(k, &vb.pp("k_proj"), d, kv * hd)?;
        let v_proj = Linear::load(k, &vb.pp("v_proj"), d, kv * hd)?;
        let qkv = match Linear::fuse(&[&q_proj, &k_proj, &v_proj]) {
            Some(fused) => Projections::Fused(fused),
            None => Projections::Separate(q_proj, k_proj, v_proj),
        };
        Ok(Attention {
            k: k.clone(),
            qkv,
            o_proj: Linear::load(k, &vb.pp("o_proj"), h * hd, d)?,
            q_norm: RmsNorm::new(hd, cfg.rms_norm_eps, vb.pp("q_norm").vb().clone())?,
            k_norm: RmsNorm::new(hd, cfg.rms_norm_eps, vb.pp("k_norm").vb().clone())?,
            num_heads: h,
            num_kv_heads: kv,
            head_dim: hd,
            scale: 1.0 / (hd as f64).sqrt(),
        })
    }

    /// Whether the backend multiplies each row by these weights independently of the others.
    pub(crate) fn row_independent(&self) -> bool {
        let w = |l: &Linear<K>| self.k.row_independent(l.weight());
        let qkv = match &self.qkv {
            Projections::Separate(q, k, v) => w(q) && w(k) && w(v),
            Projections::Fused(f) => w(f),
        };
        qkv && w(&self.o_proj)
    }

    /// x: (n, hidden) normalised input. Writes this step's K/V of `layer` into the cache and
    /// returns (n, hidden).
    pub(crate) fn forward(&self, x: &Tensor, step: &Step, layer: usize) -> Result<Tensor> {
        self.project(&self.attend(x, step, layer)?)
    }

    /// The o projection: (n, heads * head_dim) -> (n, hidden).
    pub(crate) fn project(&self, y: &Tensor) -> Result<Tensor> {
        self.o_proj.forward(y)
    }

    /// [`Self::forward`] before the o projection: (n, heads * head_dim).
    pub(crate) fn attend(&self, x: &Tensor, step: &Step, layer: usize) -> Result<Tensor> {
        let (cos, sin) = (&step.cos, &step.sin);
        let (n, _) = x.dims2()?;
        let (h, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        // 1. projections, (n, heads, hd); q/k norm per head, then rope.
        let (q, k, v) = match &self.qkv {
            Projections::Separate(q, k, v) => (q.forward(x)?, k.forward(x)?, v.forward(x)?),
            Projections::Fused(qkv) => {
                let y = qkv.forward(x)?;
                (
                    y.narrow(1, 0, h * hd)?,
                    y.narrow(1, h * hd, nkv * hd)?,
                    y.narrow(1, (h + nkv) * hd, nkv * hd)?,
                )
            }
        };
        let q = q.reshape((n, h, hd))?;
        let k = k.reshape((n, nkv, hd))?;
        let v = v.reshape((n, nkv, hd))?;
        let q = self.k.rope(&self.q_norm.forward(&self.k, &q)?, cos, sin)?;
        let k = self.k.rope(&self.k_norm.forward(&self.k, &k)?, cos, sin)?;
        // 2. cache write, then attention over the cache: (n, H*hd).
        let call = |q: &Tensor, k: &Tensor, v: &Tensor, rows: &AttnRows| {
            self.k.attention(&AttnCall {
                q,
                k,
                v,
                kv: step.kv,
                layer,
                rows,
                scale: self.scale as f32,
            })
        };
        // Each segment attends as in a step of its own (its sequence's cache and causal mask).
        if let [only] = step.segments.as_slice() {
            return call(&q, &k, &v, &only.attn);
        }
        let mut outs = Vec::with_capacity(step.segments.len());
        let mut at = 0;
        for seg in &step.segments {
            let part = |t: &Tensor| t.narrow(0, at, seg.rows);
            outs.push(call(&part(&q)?, &part(&k)?, &part(&v)?, &seg.attn)?);
            at += seg.rows;
        }
        if at != n {
            return Err(ModelError::invalid(format!(
                "a step's segments cover {at} rows of {n}"
            )));
        }
        Ok(Tensor::cat(&outs, 0)?)
    }
}
