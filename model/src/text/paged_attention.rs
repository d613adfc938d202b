//! Attention over the paged KV cache in candle's own ops: the form every backend can fall back
//! on (any device, any dtype the cache holds). Per block of the sequence, scores side by side,
//! softmax in f32, the weighted sum of V block by block (reference: `eager_attention_forward`
//! of `Qwen3VLTextAttention`, with `repeat_kv` as a reshape).
use super::kv_cache::PagedKvCache;
use super::step::{AttnCall, AttnRows};
use crate::error::{ModelError, Result};
use candle_core::{DType, Tensor, D};

/// [`crate::Kernels::attention`] in candle ops: writes k, v (n, kv_heads, hd) of the layer into
/// the cache, then attends q (n, heads, hd) over it. Returns (n, heads*hd).
pub fn attention(call: &AttnCall) -> Result<Tensor> {
    let AttnCall {
        q,
        k,
        v,
        kv,
        layer,
        rows,
        scale,
    } = *call;
    let (n, h, hd) = q.dims3()?;
    match rows {
        AttnRows::Chunk { start, table, mask } => {
            kv.write(layer, table, *start, k, v)?;
            attend(q, kv, layer, table, *start, *mask, scale)
        }
        AttnRows::Decode(rows) => {
            let mut outs = Vec::with_capacity(n);
            for (r, row) in rows.iter().enumerate() {
                let (kr, vr) = (k.get(r)?, v.get(r)?);
                match row {
                    Some((ctx, table)) => {
                        kv.write(layer, table, *ctx, &kr.unsqueeze(0)?, &vr.unsqueeze(0)?)?;
                        outs.push(attend(
                            &q.narrow(0, r, 1)?,
                            kv,
                            layer,
                            table,
                            *ctx,
                            None,
                            scale,
                        )?);
                    }
                    None => {
                        let slot = r % kv.block_len();
                        kv.write_slot(layer, kv.dummy_block(), slot, &kr, &vr)?;
                        outs.push(Tensor::zeros((1, h * hd), DType::F32, q.device())?);
                    }
                }
            }
            Ok(Tensor::cat(&outs, 0)?)
        }
    }
}

/// q: (n, H, hd) of tokens at cache indices [start, start+n) of one sequence, whose K/V
/// (including these n) are cached. Causal through `mask` (n, start+n), needed when n > 1.
/// Returns (n, H*hd).
pub fn attend(
    q: &Tensor,
    kv: &PagedKvCache,
    layer: usize,
    table: &[u32],
    start: usize,
    mask: Option<&Tensor>,
    scale: f32,
) -> Result<Tensor> {
    let (n, h, hd) = q.dims3()?;
    let nkv = kv.kv_heads();
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
    let mut scores = (scores * scale as f64)?;
    if n > 1 {
        let mask =
            mask.ok_or_else(|| ModelError::invalid("a multi-token chunk needs its causal mask"))?;
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
    let out = out.ok_or_else(|| ModelError::kv_cache("attention over an empty context"))?;
    // (KV, g, n, hd) -> (n, KV, g, hd) -> (n, H*hd)
    Ok(out
        .reshape((nkv, g, n, hd))?
        .permute((2, 0, 1, 3))?
        .reshape((n, h * hd))?)
}
