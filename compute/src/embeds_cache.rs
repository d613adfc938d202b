//! A store of image embeddings bounded in bytes (embeddings plus every deepstack level), for the
//! services' embedding caches: the LM's by content hash and grid, the vision service's by the
//! SHA-256 of its input. Values share their bytes, so a hit costs no copy. Callers count their
//! own metrics.
//!
//! quick_cache's single-shard cache (CLOCK-PRO: new entries start cold, an entry read since it
//! came in is kept over one that was not), weighted by bytes: a burst of images seen once does
//! not flush the ones that keep coming back, which a plain LRU would.
use crate::embeds::ImageEmbeds;
use quick_cache::unsync::Cache;
use quick_cache::Weighter;
use std::hash::Hash;

/// An entry's weight: its bytes.
#[derive(Debug, Clone, Copy)]
struct ByBytes;

impl<K> Weighter<K, ImageEmbeds> for ByBytes {
    fn weight(&self, _key: &K, value: &ImageEmbeds) -> u64 {
        // Never 0: quick_cache never evicts weightless entries.
        value.byte_len().max(1) as u64
    }
}

/// Bytes per entry assumed when sizing the table up front (a hint only: the weight bound is
/// what limits the cache).
const TYPICAL_ENTRY_BYTES: usize = 1 << 20;

pub struct EmbedsCache<K> {
    capacity: usize,
    cache: Cache<K, ImageEmbeds, ByBytes>,
    hits: u64,
    misses: u64,
}

impl<K: Hash + Eq> std::fmt::Debug for EmbedsCache<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbedsCache")
            .field("capacity", &self.capacity)
            .field("bytes", &self.cache.weight())
            .field("entries", &self.cache.len())
            .finish()
    }
}

impl<K: Hash + Eq + Clone> EmbedsCache<K> {
    pub fn new(capacity_bytes: usize) -> Self {
        let items = (capacity_bytes / TYPICAL_ENTRY_BYTES).clamp(4, 1 << 16);
        EmbedsCache {
            capacity: capacity_bytes,
            cache: Cache::with_weighter(items, capacity_bytes as u64, ByBytes),
            hits: 0,
            misses: 0,
        }
    }

    /// The value of `key`, now marked as read; counts a hit or a miss.
    pub fn get(&mut self, key: &K) -> Option<ImageEmbeds> {
        match self.cache.get(key) {
            Some(value) => {
                self.hits += 1;
                Some(value.clone())
            }
            None => {
                self.misses += 1;
                None
            }
        }
    }

    /// Keeps `value` under `key`, evicting entries to stay within the capacity; a value larger
    /// than the whole capacity is not kept (and evicts nothing).
    pub fn insert(&mut self, key: K, value: ImageEmbeds) {
        if value.byte_len() > self.capacity {
            return;
        }
        self.cache.insert(key, value);
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn len(&self) -> usize {
        self.cache.len()
    }
    pub fn is_empty(&self) -> bool {
        self.cache.len() == 0
    }
    pub fn bytes(&self) -> usize {
        self.cache.weight() as usize
    }
    pub fn hits(&self) -> u64 {
        self.hits
    }
    pub fn misses(&self) -> u64 {
        self.misses
    }
}
