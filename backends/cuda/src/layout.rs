//! The host arrays the decode kernel reads, built from a step's rows: every block table padded
//! to one width, the context each row attends to, and the cache slot each new token is written
//! at (`block * block_len + offset`, as the KV cache's layout in `vlm_model::text::kv_cache`).
//! A padding row attends to nothing (context 0) and writes slot `r % block_len` of the dummy
//! block, as the generic path does.
use vlm_compute::{ComputeError, Result};

/// One decode step's rows, flattened for the kernels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeLayout {
    /// (rows, max_blocks) block ids; the tail of a short table is the dummy block (never read:
    /// positions past a row's context are not visited).
    pub tables: Vec<u32>,
    pub max_blocks: usize,
    /// Tokens each row attends to (its cached context plus the new token); 0 = padding.
    pub ctx_lens: Vec<u32>,
    /// Cache slot of each row's new token.
    pub slots: Vec<u32>,
    /// The longest context.
    pub max_ctx: usize,
}

/// Lays out decode rows (`(context_len, block table)`, `None` = padding) for a cache of
/// `block_len`-token blocks whose dummy block is `dummy`.
pub fn decode_layout(
    rows: &[Option<(usize, &[u32])>],
    block_len: usize,
    dummy: u32,
) -> Result<DecodeLayout> {
    let max_blocks = rows
        .iter()
        .flatten()
        .map(|(ctx, _)| (ctx + 1).div_ceil(block_len))
        .max()
        .unwrap_or(1)
        .max(1);
    let mut tables = vec![dummy; rows.len() * max_blocks];
    let mut ctx_lens = Vec::with_capacity(rows.len());
    let mut slots = Vec::with_capacity(rows.len());
    for (r, row) in rows.iter().enumerate() {
        match row {
            Some((ctx, table)) => {
                let need = (ctx + 1).div_ceil(block_len);
                if table.len() < need {
                    return Err(ComputeError::KvCache(format!(
                        "decode row {r}: {} tokens need {need} blocks, the table has {}",
                        ctx + 1,
                        table.len()
                    )));
                }
                tables[r * max_blocks..r * max_blocks + need].copy_from_slice(&table[..need]);
                ctx_lens.push(to_u32(ctx + 1)?);
                slots.push(slot(table, *ctx, block_len)?);
            }
            None => {
                ctx_lens.push(0);
                slots.push(to_u32(dummy as usize * block_len + r % block_len)?);
            }
        }
    }
    let max_ctx = ctx_lens.iter().map(|&c| c as usize).max().unwrap_or(0);
    Ok(DecodeLayout {
        tables,
        max_blocks,
        ctx_lens,
        slots,
        max_ctx,
    })
}

/// Slots of tokens [start, start + n) of the sequence whose blocks are `table` (a prefill
/// chunk's writes).
pub fn chunk_slots(table: &[u32], start: usize, n: usize, block_len: usize) -> Result<Vec<u32>> {
    (start..start + n)
        .map(|t| slot(table, t, block_len))
        .collect()
}

fn slot(table: &[u32], t: usize, block_len: usize) -> Result<u32> {
    let block = *table.get(t / block_len).ok_or_else(|| {
        ComputeError::KvCache(format!(
            "token {t} is past the block table ({} blocks of {block_len})",
            table.len()
        ))
    })?;
    to_u32(block as usize * block_len + t % block_len)
}

fn to_u32(v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| {
        ComputeError::KvCache(format!(
            "cache slot {v} is over u32 (the kernels index slots in 32 bits)"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_padded_to_one_width() {
        let a = [3u32, 7];
        let b = [5u32];
        let rows = [Some((5, &a[..])), None, Some((0, &b[..]))];
        let l = decode_layout(&rows, 4, 9).unwrap();
        assert_eq!(l.max_blocks, 2);
        assert_eq!(l.tables, vec![3, 7, 9, 9, 5, 9]);
        assert_eq!(l.ctx_lens, vec![6, 0, 1]);
        // Row 0 writes token 5: block 7, offset 1. Padding row 1: dummy block 9, slot 1.
        assert_eq!(l.slots, vec![7 * 4 + 1, 9 * 4 + 1, 5 * 4]);
        assert_eq!(l.max_ctx, 6);
    }

    #[test]
    fn a_short_table_is_refused() {
        let a = [3u32];
        assert!(decode_layout(&[Some((4, &a[..]))], 4, 9).is_err());
        assert!(chunk_slots(&a, 2, 3, 4).is_err());
        assert_eq!(chunk_slots(&[3, 8], 2, 4, 4).unwrap(), vec![14, 15, 32, 33]);
    }

    #[test]
    fn all_padding() {
        let l = decode_layout(&[None, None], 16, 2).unwrap();
        assert_eq!((l.max_blocks, l.max_ctx), (1, 0));
        assert_eq!(l.slots, vec![32, 33]);
    }
}
