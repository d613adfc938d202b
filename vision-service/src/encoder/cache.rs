//! The embedding cache: what an image (or a video's temporal group) encoded to, kept by the
//! SHA-256 of everything its embeddings depend on: the input's bytes and how the service turns
//! them into patch rows (the resize target of an image file; the frames themselves for resized
//! pixels, so a video sampled at another fps or size is another key). The caller's
//! `content_hash` is only echoed, never trusted as a key. Bounded by bytes (an entry read since
//! it came in outlives one that was not: [`EmbedsCache`]); a hit skips the decode, the resize
//! and the ViT. Size 0 turns it off.
use sha2::{Digest, Sha256};
use std::sync::Mutex;
use vlm_compute::{EmbedsCache, ImageEmbeds};

pub type Key = [u8; 32];

/// The key of a set of byte fields, each length-prefixed so that no two splits of the same
/// bytes collide.
pub fn key(fields: &[&[u8]]) -> Key {
    let mut h = Sha256::new();
    for f in fields {
        h.update((f.len() as u64).to_le_bytes());
        h.update(f);
    }
    h.finalize().into()
}

/// What the cache holds now (`Vision.Info`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub entries: u64,
    pub hits: u64,
    pub misses: u64,
}

/// [`EmbedsCache`] shared by the compute threads, with this service's metrics.
#[derive(Debug)]
pub struct EmbedCache {
    lru: Mutex<EmbedsCache<Key>>,
}

impl EmbedCache {
    pub fn new(capacity_bytes: u64) -> EmbedCache {
        EmbedCache {
            lru: Mutex::new(EmbedsCache::new(capacity_bytes as usize)),
        }
    }

    pub fn enabled(&self) -> bool {
        self.lock().capacity() > 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, EmbedsCache<Key>> {
        self.lru.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cached embeddings of `key`; counts a hit or a miss (nothing when off).
    pub fn get(&self, key: &Key) -> Option<ImageEmbeds> {
        let mut lru = self.lock();
        if lru.capacity() == 0 {
            return None;
        }
        let found = lru.get(key);
        let result = if found.is_some() { "hit" } else { "miss" };
        metrics::counter!("vlm_vision_embed_cache_total", "result" => result).increment(1);
        found
    }

    /// Keeps `value` under `key` (entries not read since they came in go first; one larger
    /// than the whole cache is not kept).
    pub fn put(&self, key: Key, value: ImageEmbeds) {
        let mut lru = self.lock();
        lru.insert(key, value);
        metrics::gauge!("vlm_vision_embed_cache_bytes").set(lru.bytes() as f64);
    }

    pub fn stats(&self) -> CacheStats {
        let lru = self.lock();
        CacheStats {
            capacity_bytes: lru.capacity() as u64,
            used_bytes: lru.bytes() as u64,
            entries: lru.len() as u64,
            hits: lru.hits(),
            misses: lru.misses(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vlm_compute::HostTensor;

    fn embeds(rows: usize) -> ImageEmbeds {
        let t = HostTensor::from_f32(&vec![1.0; rows * 4], vec![rows, 4]).unwrap();
        ImageEmbeds {
            embeds: t,
            deepstack: vec![],
            grid_thw: [1, 2, 2 * rows],
        }
    }

    #[test]
    fn an_entry_read_outlives_one_not_read_and_the_bytes_stay_bounded() {
        // Each entry is rows * 16 bytes; room for 48.
        let c = EmbedCache::new(48);
        let (a, b, d) = (key(&[b"a"]), key(&[b"b"]), key(&[b"d"]));
        c.put(a, embeds(1));
        c.put(b, embeds(1));
        assert!(c.get(&a).is_some()); // a was read, b was not
        c.put(d, embeds(2)); // 16 + 16 + 32 > 48: b goes
        assert!(c.get(&b).is_none());
        assert!(c.get(&a).is_some() && c.get(&d).is_some());
        let s = c.stats();
        assert_eq!((s.used_bytes, s.entries, s.hits, s.misses), (48, 2, 3, 1));
        // Larger than the cache: not kept, nothing evicted.
        c.put(key(&[b"big"]), embeds(4));
        assert_eq!(c.stats().entries, 2);
    }

    #[test]
    fn fields_are_length_prefixed_and_size_zero_is_off() {
        assert_ne!(key(&[b"ab", b"c"]), key(&[b"a", b"bc"]));
        let off = EmbedCache::new(0);
        off.put(key(&[b"a"]), embeds(1));
        assert!(off.get(&key(&[b"a"])).is_none());
        assert_eq!(off.stats(), CacheStats::default());
    }
}
