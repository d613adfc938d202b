//! What one attention call of a step is over: the rows' cache positions. Handed to
//! [`crate::Kernels::attention`].
use super::kv_cache::PagedKvCache;
use candle_core::Tensor;

/// One attention call of a step: this step's q (n, heads, head_dim), k and v (n, kv_heads,
/// head_dim) of `layer`, and where their rows sit in the cache.
pub struct AttnCall<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub kv: &'a PagedKvCache,
    pub layer: usize,
    pub rows: &'a AttnRows<'a>,
    /// `1 / sqrt(head_dim)`.
    pub scale: f32,
}

/// Where the rows of one attention call come from and go to.
pub enum AttnRows<'a> {
    /// n consecutive tokens of one sequence at cache indices [start, start+n); `mask` is
    /// [`causal_mask`]`(start, n)` when n > 1 (built once per step, shared by the layers).
    Chunk {
        start: usize,
        table: &'a [u32],
        mask: Option<&'a Tensor>,
    },
    /// One token per row: (context_len, block table), written at cache index context_len and
    /// attending to context_len + 1 tokens; `None` rows are padding (their K/V go to slot r of
    /// the dummy block, their output is zero).
    Decode(&'a [Option<(usize, &'a [u32])>]),
}

/// (n, start+n) additive mask: query i (cache index start+i) sees keys j <= start+i.
pub fn causal_mask(start: usize, n: usize, device: &candle_core::Device) -> crate::Result<Tensor> {
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

/// Rows `rows` of x (n, d), in that order: a view when they are consecutive (one chunk's last
/// row and the decode rows after it), else a gather.
pub(crate) fn take_rows(x: &Tensor, rows: &[usize]) -> crate::Result<Tensor> {
    let first = rows.first().copied().unwrap_or(0);
    if rows.iter().enumerate().all(|(i, &r)| r == first + i) {
        return Ok(x.narrow(0, first, rows.len())?);
    }
    let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
    let idx = Tensor::new(idx.as_slice(), x.device())?;
    Ok(x.index_select(&idx, 0)?)
}
