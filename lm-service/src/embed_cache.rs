//! Image embeddings by content hash and grid (the same bytes at two resolutions, OpenAI's
//! `detail`, are two entries): [`vlm_compute::EmbedsCache`] with this service's metrics. Values
//! share their bytes, so a hit costs no copy.
use vlm_compute::{EmbedsCache, ImageEmbeds};

/// Image embeddings keyed by the image's content hash and grid, bounded in bytes.
#[derive(Debug)]
pub struct EmbedCache {
    lru: EmbedsCache<(Vec<u8>, [usize; 3])>,
}

impl EmbedCache {
    pub fn new(capacity_bytes: usize) -> Self {
        EmbedCache {
            lru: EmbedsCache::new(capacity_bytes),
        }
    }

    /// The embeddings of `hash` when held with the same grid; counts a hit or a miss (an empty
    /// hash is always a miss).
    pub fn get(&mut self, hash: &[u8], grid: [usize; 3]) -> Option<ImageEmbeds> {
        // An empty hash is never stored, so it is a miss.
        let found = self.lru.get(&(hash.to_vec(), grid));
        match found {
            Some(_) => metrics::counter!("vlm_lm_embedding_cache_hits_total").increment(1),
            None => metrics::counter!("vlm_lm_embedding_cache_misses_total").increment(1),
        }
        found
    }

    /// Stores `value` under `hash`, evicting entries (those not read since they came in first)
    /// to stay under the capacity. An entry larger than the whole cache (or an empty hash) is not stored.
    pub fn insert(&mut self, hash: &[u8], value: ImageEmbeds) {
        if !hash.is_empty() {
            self.lru.insert((hash.to_vec(), value.grid_thw), value);
        }
    }

    pub fn len(&self) -> usize {
        self.lru.len()
    }
    pub fn is_empty(&self) -> bool {
        self.lru.is_empty()
    }
    pub fn bytes(&self) -> usize {
        self.lru.bytes()
    }
    pub fn hits(&self) -> u64 {
        self.lru.hits()
    }
    pub fn misses(&self) -> u64 {
        self.lru.misses()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vlm_compute::HostTensor;

    fn embeds(rows: usize) -> ImageEmbeds {
        let z = HostTensor::from_f32(&vec![0.0; rows * 4], vec![rows, 4]).unwrap();
        ImageEmbeds {
            embeds: z.clone(),
            deepstack: vec![z],
            grid_thw: [1, 2, 2 * rows],
        }
    }

    #[test]
    fn evicts_entries_not_read_first_within_the_byte_bound() {
        // Each entry of 1 row: 2 tensors x 4 f32 = 32 bytes. Room for 3.
        let mut c = EmbedCache::new(100);
        c.insert(b"a", embeds(1));
        c.insert(b"b", embeds(1));
        c.insert(b"c", embeds(1));
        assert!(c.get(b"a", [1, 2, 2]).is_some()); // a was read, b and c were not
        c.insert(b"d", embeds(1)); // evicts b, the oldest not read
        assert!(c.get(b"b", [1, 2, 2]).is_none());
        assert!(c.get(b"a", [1, 2, 2]).is_some());
        assert!(c.get(b"c", [1, 2, 2]).is_some());
        assert_eq!(c.len(), 3);
        assert!(c.bytes() <= 100);
        assert_eq!((c.hits(), c.misses()), (3, 1));
        // A grid mismatch is a miss; the same bytes at another grid are another entry.
        assert!(c.get(b"a", [1, 4, 4]).is_none());
        // Too large for the cache: not stored.
        c.insert(b"big", embeds(10));
        assert!(c.get(b"big", [1, 2, 20]).is_none());
        let mut c = EmbedCache::new(1000);
        c.insert(b"a", embeds(1));
        c.insert(b"a", embeds(2));
        assert_eq!(c.len(), 2);
        assert!(c.get(b"a", [1, 2, 2]).is_some() && c.get(b"a", [1, 2, 4]).is_some());
    }
}
