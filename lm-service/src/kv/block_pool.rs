//! The pool of KV block ids: `0..total` usable blocks and one dummy block (`total`) that padded
//! decode rows write to. Ids only; the free list hands out the lowest ids last freed first.

/// Free list over block ids `0..total`.
#[derive(Debug, Clone)]
pub struct BlockPool {
    total: u32,
    /// Free ids; `pop` takes from the end.
    free: Vec<u32>,
}

impl BlockPool {
    /// A pool of `total` usable blocks, all free.
    pub fn new(total: u32) -> Self {
        BlockPool {
            total,
            free: (0..total).rev().collect(),
        }
    }

    pub fn total(&self) -> u32 {
        self.total
    }
    pub fn free_count(&self) -> u32 {
        self.free.len() as u32
    }
    pub fn used_count(&self) -> u32 {
        self.total - self.free_count()
    }

    /// The id padded rows write to; never handed out.
    pub fn dummy(&self) -> u32 {
        self.total
    }

    /// `n` blocks, or `None` (and nothing taken) when fewer are free.
    pub fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let at = self.free.len() - n;
        Some(self.free.split_off(at).into_iter().rev().collect())
    }

    /// Returns blocks to the pool. Ids out of range or already free are a caller bug; they are
    /// ignored in release builds.
    pub fn give_back(&mut self, blocks: impl IntoIterator<Item = u32>) {
        for b in blocks {
            debug_assert!(
                b < self.total,
                "block {b} is not in a pool of {}",
                self.total
            );
            debug_assert!(!self.free.contains(&b), "block {b} freed twice");
            if b < self.total {
                self.free.push(b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_and_gives_back() {
        let mut p = BlockPool::new(4);
        assert_eq!(p.dummy(), 4);
        assert_eq!(p.take(3), Some(vec![0, 1, 2]));
        assert_eq!(p.free_count(), 1);
        assert_eq!(p.take(2), None, "all-or-nothing");
        assert_eq!(p.free_count(), 1);
        p.give_back([1, 0]);
        assert_eq!(p.used_count(), 1);
        let got = p.take(3).unwrap();
        assert_eq!(got.len(), 3);
        assert!(!got.contains(&2) && !got.contains(&4));
        assert_eq!(p.take(0), Some(vec![]));
    }
}
