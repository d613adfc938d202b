//! `Qwen3VLTextAttention` over the paged KV cache: q/k/v projections, per-head q/k RMSNorm,
//! MRoPE, GQA, o projection.
use super::chunk_attention::chunk_attention;
use super::decode_attention::{decode_attention, CacheGeometry};
use super::kv_cache::{KvLayer, PagedKvCache};
use super::linear::Linear;
use super::norm::RmsNorm;
use super::rope::MRope;
use crate::config::TextConfig;
use crate::cpu::cpu_view::CpuF32;
use crate::error::{ModelError, Result};
use candle_core::{DType, Tensor, D};
use candle_nn::VarBuilder;

/// Where the rows of one attention call come from and go to.
pub(crate) enum AttnRows<'a> {
    /// n consecutive tokens of one sequence at cache indices [start, start+n); `mask` is
    /// [`causal_mask`]`(start, n)` (built once per step, shared by the layers).
    Chunk {
        start: usize,
        table: &'a [u32],
        mask: Option<&'a Tensor>,
    },
    /// One token per row; `None` rows are padding.
    Decode(&'a [Option<(usize, &'a [u32])>]),
}

/// Everything a layer needs for one forward step besides its input.
pub(crate) struct Step<'a> {
    /// (n, head_dim/2) rotary tables of the step's rows.
    pub cos: Tensor,
    pub sin: Tensor,
    pub rope: &'a MRope,
    pub rows: AttnRows<'a>,
    pub kv: &'a PagedKvCache,
}

/// q/k/v projections: three layers, or one with the three weights stacked (packed bf16).
#[derive(Debug, Clone)]
enum Projections {
    Separate(Linear, Linear, Linear),
    Fused(Linear),
}

#[derive(Debug, Clone)]
pub struct Attention {
    qkv: Projections,
    o_proj: Linear,
    /// The weights are bf16 on the AVX512-BF16 kernel: the chunk attention runs on it too.
    bf16: bool,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    scale: f64,
}

impl Attention {
    /// `vb` at `...layers.{i}.self_attn`.
    pub fn new(cfg: &TextConfig, vb: VarBuilder) -> Result<Self> {
        if cfg.attention_bias {
            return Err(ModelError::Weights(
                "text_config attention_bias=true is not supported (Qwen3-VL has no attention bias)"
                    .into(),
            ));
        }
        let (h, kv, hd, d) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.hidden_size,
        );
        let q_proj = Linear::load(&vb.pp("q_proj"), d, h * hd)?;
        let k_proj = Linear::load(&vb.pp("k_proj"), d, kv * hd)?;
        let v_proj = Linear::load(&vb.pp("v_proj"), d, kv * hd)?;
        let bf16 = q_proj.packed().is_some();
        let qkv = match Linear::fuse(&[&q_proj, &k_proj, &v_proj]) {
            Some(fused) => Projections::Fused(fused),
            None => Projections::Separate(q_proj, k_proj, v_proj),
        };
        Ok(Attention {
            qkv,
            o_proj: Linear::load(&vb.pp("o_proj"), h * hd, d)?,
            bf16,
            q_norm: RmsNorm::new(hd, cfg.rms_norm_eps, vb.pp("q_norm"))?,
            k_norm: RmsNorm::new(hd, cfg.rms_norm_eps, vb.pp("k_norm"))?,
            num_heads: h,
            num_kv_heads: kv,
            head_dim: hd,
            scale: 1.0 / (hd as f64).sqrt(),
        })
    }

    /// x: (n, hidden) normalised input. Writes this step's K/V of `layer` into the cache and
    /// returns (n, hidden).
    pub(crate) fn forward(&self, x: &Tensor, step: &Step, layer: usize) -> Result<Tensor> {
        let (cos, sin, rope, kv) = (&step.cos, &step.sin, step.rope, step.kv);
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
        let q = rope.apply(&self.q_norm.forward(&q)?, cos, sin)?;
        let k = rope.apply(&self.k_norm.forward(&k)?, cos, sin)?;

        // 2. cache write, then attention over the cache.
        let y = match &step.rows {
            AttnRows::Chunk { start, table, .. } if self.bf16 && kv.is_cpu() => {
                // bf16 model: the chunk's attention on the bf16 kernel too.
                kv.write(layer, table, *start, &k, &v)?;
                let scale = self.scale as f32;
                self.on_cache_memory(&q, kv, layer, |cache, geo, qd, out| match cache {
                    KvLayer::F32(kc, vc) => {
                        chunk_attention(kc, vc, geo, h, qd, *start, table, scale, out)
                    }
                    KvLayer::Bf16(kc, vc) => {
                        chunk_attention(kc, vc, geo, h, qd, *start, table, scale, out)
                    }
                })?
            }
            AttnRows::Chunk { start, table, mask } => {
                kv.write(layer, table, *start, &k, &v)?;
                self.attend(&q, kv, layer, table, *start, *mask)?
            }
            AttnRows::Decode(rows) if kv.is_cpu() => {
                let (k, v) = (k.contiguous()?, v.contiguous()?);
                let (kd, vd) = (CpuF32::new(&k, "k")?, CpuF32::new(&v, "v")?);
                kv.write_decode_rows(layer, rows, kd.slice(), vd.slice())?;
                let scale = self.scale as f32;
                self.on_cache_memory(&q, kv, layer, |cache, geo, qd, out| match cache {
                    KvLayer::F32(kc, vc) => decode_attention(kc, vc, geo, h, qd, rows, scale, out),
                    KvLayer::Bf16(kc, vc) => decode_attention(kc, vc, geo, h, qd, rows, scale, out),
                })?
            }
            AttnRows::Decode(rows) => {
                let mut outs = Vec::with_capacity(n);
                for (r, row) in rows.iter().enumerate() {
                    let (kr, vr) = (k.get(r)?, v.get(r)?);
                    match row {
                        Some((ctx, table)) => {
                            kv.write(layer, table, *ctx, &kr.unsqueeze(0)?, &vr.unsqueeze(0)?)?;
                            outs.push(self.attend(
                                &q.narrow(0, r, 1)?,
                                kv,
                                layer,
                                table,
                                *ctx,
                                None,
                            )?);
                        }
                        None => {
                            let slot = r % kv.block_len();
                            kv.write_slot(layer, kv.dummy_block(), slot, &kr, &vr)?;
                            outs.push(Tensor::zeros((1, h * hd), DType::F32, x.device())?);
                        }
                    }
                }
                Tensor::cat(&outs, 0)?
            }
        };
        // 3. (n, hidden)
        self.o_proj.forward(&y)
    }

    /// Runs an attention kernel on the layer's cache memory: `f(cache, geometry, q, out)` with
    /// q (n, H, hd) and out (n, H*hd) as f32 slices; returns out as a tensor.
    fn on_cache_memory(
        &self,
        q: &Tensor,
        kv: &PagedKvCache,
        layer: usize,
        f: impl FnOnce(KvLayer<'_>, CacheGeometry, &[f32], &mut [f32]),
    ) -> Result<Tensor> {
        let (n, h, hd) = q.dims3()?;
        let q = q.contiguous()?;
        let qd = CpuF32::new(&q, "q")?;
        let mut out = vec![0f32; n * h * hd];
        kv.with_layer(layer, |cache| f(cache, kv.geometry(), qd.slice(), &mut out))?;
        Ok(Tensor::from_vec(out, (n, h * hd), q.device())?)
    }

    /// q: (n, H, hd) of tokens at cache indices [start, start+n) of one sequence, whose K/V
    /// (including these n) are cached. Causal through `mask` (n, start+n), needed when n > 1.
    /// Returns (n, H*hd).
    fn attend(
        &self,
        q: &Tensor,
        kv: &PagedKvCache,
        layer: usize,
        table: &[u32],
        start: usize,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (n, h, hd) = q.dims3()?;
        let nkv = self.num_kv_heads;
        let g = h / nkv;
        let total = start + n;
        // Head i uses kv head i / g: (n, H, hd) -> (KV, g*n, hd), rows ordered (g, n).
        let q = q
            .reshape((n, nkv, g, hd))?
            .permute((1, 2, 0, 3))?
            .contiguous()?
            .reshape((nkv, g * n, hd))?;
        let blocks = kv.read(layer, table, total)?;
        // Scores per block, (KV, g*n, c_b), side by side: (KV, g*n, total).
        let mut scores = Vec::with_capacity(blocks.len());
        for (kb, _) in &blocks {
            scores.push(q.matmul(&kb.t()?)?);
        }
        let scores = if scores.len() == 1 {
            scores.remove(0)
        } else {
            Tensor::cat(&scores, 2)?
        };
        let mut scores = (scores * self.scale)?;
        if n > 1 {
            let mask = mask
                .ok_or_else(|| ModelError::invalid("a multi-token chunk needs its causal mask"))?;
            scores = scores
                .reshape((nkv, g, n, total))?
                .broadcast_add(mask)?
                .reshape((nkv, g * n, total))?;
        }
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        // Sum over blocks of probs[..., block cols] @ V_block: (KV, g*n, hd).
        let mut out: Option<Tensor> = None;
        let mut off = 0;
        for (_, vb) in &blocks {
            let c = vb.dim(1)?;
            let part = probs.narrow(D::Minus1, off, c)?.matmul(vb)?;
            out = Some(match out {
                None => part,
                Some(acc) => (acc + part)?,
            });
            off += c;
        }
        let out =
            out.ok_or_else(|| ModelError::KvCache("attention over an empty context".into()))?;
        // (KV, g, n, hd) -> (n, KV, g, hd) -> (n, H*hd)
        Ok(out
            .reshape((nkv, g, n, hd))?
            .permute((2, 0, 1, 3))?
            .reshape((n, h * hd))?)
    }
}

/// (n, start+n) additive mask: query i (cache index start+i) sees keys j <= start+i.
pub(crate) fn causal_mask(start: usize, n: usize, device: &candle_core::Device) -> Result<Tensor> {
    let total = start + n;
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| {
            (0..total).map(move |j| {
                if j <= start + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(mask, (n, total), device)?)
}
