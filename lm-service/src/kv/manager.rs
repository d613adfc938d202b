//! Per-sequence KV policy: each sequence holds a block table long enough for its tokens.
//! `allocate` answers yes (the new blocks) or no (nothing changes); the scheduler decides what
//! to do about a no. With prefix caching, a sequence's table starts with the cached blocks of
//! its longest known prefix ([`KvManager::allocate_prefix`]), and its own full blocks are
//! registered for later sequences once computed ([`KvManager::register`]).
use super::block_pool::{BlockKey, BlockPool};
use std::collections::HashMap;

/// A sequence's id inside the LM service.
pub type SeqId = u64;

/// Blocks newly given to a sequence by one `allocate` call. Opaque to the scheduler beyond
/// their count.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Blocks(pub Vec<u32>);

impl Blocks {
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[derive(Debug, Clone)]
pub struct KvManager {
    pool: BlockPool,
    block_len: u32,
    tables: HashMap<SeqId, Vec<u32>>,
}

impl KvManager {
    pub fn new(num_blocks: u32, block_len: u32) -> Self {
        assert!(block_len > 0, "block_len must be positive");
        KvManager {
            pool: BlockPool::new(num_blocks),
            block_len,
            tables: HashMap::new(),
        }
    }

    pub fn block_len(&self) -> u32 {
        self.block_len
    }
    pub fn total_blocks(&self) -> u32 {
        self.pool.total()
    }
    pub fn free_blocks(&self) -> u32 {
        self.pool.free_count()
    }
    pub fn used_blocks(&self) -> u32 {
        self.pool.used_count()
    }
    /// Free blocks that hold a cached prefix (reused on a hit, evicted when needed).
    pub fn cached_free_blocks(&self) -> u32 {
        self.pool.cached_free_count()
    }
    /// Blocks holding cached content, held or free.
    pub fn cached_blocks(&self) -> u32 {
        self.pool.cached_count()
    }
    pub fn dummy_block(&self) -> u32 {
        self.pool.dummy()
    }

    /// Blocks needed for `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_len as usize)
    }

    /// Tokens the whole pool can hold.
    pub fn capacity_tokens(&self) -> u64 {
        self.pool.total() as u64 * self.block_len as u64
    }

    /// Starts `seq`'s (empty) table with the cached blocks of the longest prefix of `keys`
    /// (`keys[i]` = the key of block i); returns how many it took (0 on a miss). Nothing is
    /// computed for those blocks: the sequence's computed tokens start after them.
    pub fn allocate_prefix(&mut self, seq: SeqId, keys: &[BlockKey]) -> usize {
        debug_assert!(self.table(seq).is_empty(), "a prefix starts an empty table");
        let mut hit = Vec::new();
        for k in keys {
            match self.pool.lookup(k) {
                Some(b) => {
                    self.pool.acquire(b);
                    hit.push(b);
                }
                None => break,
            }
        }
        let n = hit.len();
        if n > 0 {
            self.tables.entry(seq).or_default().extend(hit);
        }
        n
    }

    /// Swaps block `index` of `seq`'s table, taken but not computed yet, for the cached block
    /// holding `key` when there is one (another sequence computed that content since `seq` was
    /// admitted: identical prompts arriving together). Whether it did; `seq`'s own block goes
    /// back to the pool.
    pub fn adopt_cached(&mut self, seq: SeqId, index: usize, key: &BlockKey) -> bool {
        let Some(b) = self.pool.lookup(key) else {
            return false;
        };
        let Some(slot) = self.tables.get_mut(&seq).and_then(|t| t.get_mut(index)) else {
            return false;
        };
        if *slot == b {
            return false;
        }
        self.pool.acquire(b);
        let own = std::mem::replace(slot, b);
        self.pool.release([own]);
        true
    }

    /// Records that block `index` of `seq`'s table is full, computed, and holds `key`.
    pub fn register(&mut self, seq: SeqId, index: usize, key: BlockKey) {
        if let Some(&b) = self.tables.get(&seq).and_then(|t| t.get(index)) {
            self.pool.register(b, key);
        }
    }

    /// Grows `seq`'s table to cover `tokens` tokens. `Some(new blocks)` (possibly empty) on
    /// success, `None` when the pool lacks them (nothing is taken then).
    pub fn allocate(&mut self, seq: SeqId, tokens: usize) -> Option<Blocks> {
        let have = self.tables.get(&seq).map_or(0, Vec::len);
        let need = self.blocks_for(tokens).saturating_sub(have);
        let new = self.pool.take(need)?;
        self.tables.entry(seq).or_default().extend_from_slice(&new);
        Some(Blocks(new))
    }

    /// Whether `allocate(seq, tokens)` would succeed now.
    pub fn can_allocate(&self, seq: SeqId, tokens: usize) -> bool {
        let have = self.tables.get(&seq).map_or(0, Vec::len);
        self.blocks_for(tokens).saturating_sub(have) <= self.pool.free_count() as usize
    }

    /// Returns all of `seq`'s blocks to the pool; the number freed.
    pub fn free(&mut self, seq: SeqId) -> usize {
        match self.tables.remove(&seq) {
            Some(t) => {
                let n = t.len();
                self.pool.release(t);
                n
            }
            None => 0,
        }
    }

    /// `seq`'s block table (empty when it holds none).
    pub fn table(&self, seq: SeqId) -> &[u32] {
        self.tables.get(&seq).map_or(&[], Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_grows_and_refuses_without_side_effects() {
        let mut m = KvManager::new(5, 4);
        assert_eq!(m.allocate(1, 5).unwrap().len(), 2); // 5 tokens -> 2 blocks
        assert_eq!(m.allocate(1, 8).unwrap().len(), 0); // still 2 blocks
        assert_eq!(m.allocate(1, 9).unwrap().len(), 1);
        assert_eq!(m.table(1).len(), 3);
        assert!(m.allocate(2, 12).is_none(), "needs 3, 2 free");
        assert_eq!(m.free_blocks(), 2);
        assert!(m.table(2).is_empty());
        assert!(m.can_allocate(2, 8));
        assert_eq!(m.allocate(2, 8).unwrap().len(), 2);
        assert_eq!(m.free_blocks(), 0);
        assert_eq!(m.free(1), 3);
        assert_eq!(m.free(1), 0);
        assert_eq!(m.free_blocks(), 3);
        let dummy = m.dummy_block();
        assert!(m.table(2).iter().all(|&b| b != dummy));
    }

    #[test]
    fn a_prefix_hit_shares_blocks_and_a_miss_takes_nothing() {
        let key = |n: u8| [n; 16];
        let mut m = KvManager::new(6, 4);
        m.allocate(1, 12).unwrap(); // 3 blocks
        m.register(1, 0, key(1));
        m.register(1, 1, key(2));
        // Sequence 2 shares the first two blocks, stops at the first miss.
        assert_eq!(m.allocate_prefix(2, &[key(1), key(2), key(3)]), 2);
        assert_eq!(m.table(2), &m.table(1)[..2]);
        assert_eq!(m.allocate(2, 10).unwrap().len(), 1);
        assert_eq!(m.free_blocks(), 2);
        // A miss on the first block takes nothing.
        assert_eq!(m.allocate_prefix(3, &[key(9), key(1)]), 0);
        assert!(m.table(3).is_empty());
        // Both leave: the registered blocks stay cached (and free).
        m.free(1);
        m.free(2);
        assert_eq!((m.free_blocks(), m.cached_free_blocks()), (6, 2));
        assert_eq!(m.allocate_prefix(4, &[key(1), key(2)]), 2);
        assert_eq!(m.cached_free_blocks(), 0);
    }
}
