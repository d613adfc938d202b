//! The pool of KV block ids: `0..total` usable blocks and one dummy block (`total`) that padded
//! decode rows write to. Ids and reference counts only (no tensors).
//!
//! Prefix caching: a full block whose K/V a sequence has computed can be registered under its
//! content key ([`BlockKey`], see [`super::prefix`]). A later sequence with the same prefix
//! [`acquires`](BlockPool::acquire) it instead of computing it again, so a block may be held by
//! several sequences at once (reference-counted). A cached block nobody holds stays cached and
//! counts as free: it is evicted, least recently released first, only when [`BlockPool::take`]
//! runs out of never-cached free blocks.
use std::collections::{BTreeMap, HashMap};

/// A block's content key: what decides its K/V (see [`super::prefix`]).
pub type BlockKey = [u8; 16];

#[derive(Debug, Clone)]
pub struct BlockPool {
    total: u32,
    /// Free blocks holding no cached content; `pop` takes from the end.
    free: Vec<u32>,
    /// Sequences holding each block.
    refs: Vec<u32>,
    /// The key a block is cached under, if any.
    key: Vec<Option<BlockKey>>,
    /// Key -> the block holding that content.
    cached: HashMap<BlockKey, u32>,
    /// Cached blocks no sequence holds, by release tick (oldest first): the eviction order.
    evictable: BTreeMap<u64, u32>,
    /// The tick each evictable block was released at (its entry in `evictable`).
    released_at: Vec<u64>,
    tick: u64,
}

impl BlockPool {
    /// A pool of `total` usable blocks, all free.
    pub fn new(total: u32) -> Self {
        let n = total as usize;
        BlockPool {
            total,
            free: (0..total).rev().collect(),
            refs: vec![0; n],
            key: vec![None; n],
            cached: HashMap::new(),
            evictable: BTreeMap::new(),
            released_at: vec![0; n],
            tick: 0,
        }
    }

    pub fn total(&self) -> u32 {
        self.total
    }
    /// Blocks a [`take`](Self::take) can hand out: never-cached free ones and cached ones no
    /// sequence holds.
    pub fn free_count(&self) -> u32 {
        (self.free.len() + self.evictable.len()) as u32
    }
    /// Blocks held by at least one sequence.
    pub fn used_count(&self) -> u32 {
        self.total - self.free_count()
    }
    /// Blocks holding cached content (held or not).
    pub fn cached_count(&self) -> u32 {
        self.cached.len() as u32
    }
    /// Free blocks holding cached content.
    pub fn cached_free_count(&self) -> u32 {
        self.evictable.len() as u32
    }

    /// The id padded rows write to; never handed out.
    pub fn dummy(&self) -> u32 {
        self.total
    }

    /// `n` blocks for one sequence, or `None` (and nothing taken) when fewer are free.
    /// Never-cached free blocks go first, then the least recently released cached ones, whose
    /// content is forgotten.
    pub fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free_count() as usize {
            return None;
        }
        let plain = n.min(self.free.len());
        let at = self.free.len() - plain;
        let mut out: Vec<u32> = self.free.split_off(at).into_iter().rev().collect();
        while out.len() < n {
            let (_, b) = self.evictable.pop_first()?;
            if let Some(k) = self.key[b as usize].take() {
                self.cached.remove(&k);
            }
            out.push(b);
        }
        for &b in &out {
            self.refs[b as usize] = 1;
        }
        Some(out)
    }

    /// The cached block holding `key`, if any (its holders are not changed).
    pub fn lookup(&self, key: &BlockKey) -> Option<u32> {
        self.cached.get(key).copied()
    }

    /// One more sequence holds cached block `b` (taking it out of the eviction order if nobody
    /// held it).
    pub fn acquire(&mut self, b: u32) {
        let i = b as usize;
        if self.refs[i] == 0 {
            self.evictable.remove(&self.released_at[i]);
        }
        self.refs[i] += 1;
    }

    /// Records that block `b` (held, full, its K/V computed) holds the content `key`. A block
    /// already cached, or a key another block already holds, leaves things as they are.
    pub fn register(&mut self, b: u32, key: BlockKey) {
        let i = b as usize;
        if self.key[i].is_some() || self.cached.contains_key(&key) {
            return;
        }
        self.key[i] = Some(key);
        self.cached.insert(key, b);
    }

    /// Each of `blocks` is held by one sequence fewer; a block nobody holds any more becomes
    /// free (cached ones stay cached, newest in the eviction order). Ids out of range or not
    /// held are a caller bug; they are ignored in release builds.
    pub fn release(&mut self, blocks: impl IntoIterator<Item = u32>) {
        for b in blocks {
            let i = b as usize;
            debug_assert!(
                b < self.total,
                "block {b} is not in a pool of {}",
                self.total
            );
            debug_assert!(
                self.refs.get(i).is_some_and(|&r| r > 0),
                "block {b} freed twice"
            );
            if b >= self.total || self.refs[i] == 0 {
                continue;
            }
            self.refs[i] -= 1;
            if self.refs[i] > 0 {
                continue;
            }
            if self.key[i].is_some() {
                self.released_at[i] = self.tick;
                self.evictable.insert(self.tick, b);
                self.tick += 1;
            } else {
                self.free.push(b);
            }
        }
    }

    /// Sequences holding block `b`.
    pub fn holders(&self, b: u32) -> u32 {
        self.refs.get(b as usize).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> BlockKey {
        [n; 16]
    }

    #[test]
    fn takes_and_releases() {
        let mut p = BlockPool::new(4);
        assert_eq!(p.dummy(), 4);
        assert_eq!(p.take(3), Some(vec![0, 1, 2]));
        assert_eq!(p.free_count(), 1);
        assert_eq!(p.take(2), None, "all-or-nothing");
        assert_eq!(p.free_count(), 1);
        p.release([1, 0]);
        assert_eq!(p.used_count(), 1);
        let got = p.take(3).unwrap();
        assert_eq!(got.len(), 3);
        assert!(!got.contains(&2) && !got.contains(&4));
        assert_eq!(p.take(0), Some(vec![]));
    }

    #[test]
    fn cached_blocks_are_shared_kept_and_evicted_least_recently_released_first() {
        let mut p = BlockPool::new(4);
        let a = p.take(2).unwrap(); // [0, 1]
        p.register(a[0], key(1));
        p.register(a[1], key(2));
        // Another sequence shares block 0.
        assert_eq!(p.lookup(&key(1)), Some(0));
        p.acquire(0);
        assert_eq!(p.holders(0), 2);
        assert_eq!(p.free_count(), 2);
        // The first sequence leaves: block 1 stays cached and free, block 0 stays held.
        p.release(a.clone());
        assert_eq!((p.holders(0), p.holders(1)), (1, 0));
        assert_eq!(
            (p.free_count(), p.cached_free_count(), p.cached_count()),
            (3, 1, 2)
        );
        // The sharer leaves too: both cached and free, block 1 released first.
        p.release([0]);
        assert_eq!((p.free_count(), p.cached_free_count()), (4, 2));
        // A hit takes a cached block out of the eviction order.
        p.acquire(1);
        assert_eq!(p.free_count(), 3);
        p.release([1]); // now released after block 0
                        // Plain free blocks go first, then the oldest released cached block (0).
        assert_eq!(p.take(2).unwrap(), vec![2, 3]);
        assert_eq!(p.take(1).unwrap(), vec![0]);
        assert_eq!(p.lookup(&key(1)), None, "evicted content is forgotten");
        assert_eq!(p.lookup(&key(2)), Some(1));
        assert_eq!(p.take(1).unwrap(), vec![1]);
        assert_eq!(p.cached_count(), 0);
        assert_eq!(p.take(1), None);
    }

    #[test]
    fn a_key_is_held_by_one_block() {
        let mut p = BlockPool::new(3);
        let b = p.take(2).unwrap();
        p.register(b[0], key(7));
        p.register(b[1], key(7)); // same content computed twice: the first stays the cached one
        p.register(b[0], key(8)); // a cached block keeps its key
        assert_eq!(p.lookup(&key(7)), Some(b[0]));
        assert_eq!(p.lookup(&key(8)), None);
        p.release(b);
        assert_eq!((p.free_count(), p.cached_free_count()), (3, 1));
    }
}
