//! Image embeddings by content hash and grid (the same bytes at two resolutions, OpenAI's
//! `detail`, are two entries): an LRU bounded in bytes. Values share their bytes, so a hit
//! costs no copy.
use std::collections::HashMap;
use vlm_compute::ImageEmbeds;

/// Bytes an entry takes: embeddings plus every deepstack level.
pub fn embeds_bytes(e: &ImageEmbeds) -> usize {
    e.byte_len()
}

#[derive(Debug)]
struct Entry {
    value: ImageEmbeds,
    bytes: usize,
    last_used: u64,
}

/// LRU cache of image embeddings keyed by the image's content hash and grid.
#[derive(Debug)]
pub struct EmbedCache {
    capacity: usize,
    used: usize,
    tick: u64,
    map: HashMap<(Vec<u8>, [usize; 3]), Entry>,
    hits: u64,
    misses: u64,
}

impl EmbedCache {
    pub fn new(capacity_bytes: usize) -> Self {
        EmbedCache {
            capacity: capacity_bytes,
            used: 0,
            tick: 0,
            map: HashMap::new(),
            hits: 0,
            misses: 0,
        }
    }

    /// The embeddings of `hash` when held with the same grid; counts a hit or a miss.
    pub fn get(&mut self, hash: &[u8], grid: [usize; 3]) -> Option<ImageEmbeds> {
        self.tick += 1;
        let tick = self.tick;
        match self.map.get_mut(&(hash.to_vec(), grid)) {
            Some(e) if !hash.is_empty() => {
                e.last_used = tick;
                self.hits += 1;
                metrics::counter!("vlm_lm_embedding_cache_hits_total").increment(1);
                Some(e.value.clone())
            }
            _ => {
                self.misses += 1;
                metrics::counter!("vlm_lm_embedding_cache_misses_total").increment(1);
                None
            }
        }
    }

    /// Stores `value` under `hash`, evicting least recently used entries to stay under the
    /// capacity. An entry larger than the whole cache (or an empty hash) is not stored.
    pub fn insert(&mut self, hash: &[u8], value: ImageEmbeds) {
        if hash.is_empty() {
            return;
        }
        let bytes = embeds_bytes(&value);
        if bytes > self.capacity {
            return;
        }
        let key = (hash.to_vec(), value.grid_thw);
        if let Some(old) = self.map.remove(&key) {
            self.used -= old.bytes;
        }
        while self.used + bytes > self.capacity {
            let Some(oldest) = self
                .map
                .iter()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            if let Some(e) = self.map.remove(&oldest) {
                self.used -= e.bytes;
            }
        }
        self.tick += 1;
        self.used += bytes;
        self.map.insert(
            key,
            Entry {
                value,
                bytes,
                last_used: self.tick,
            },
        );
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
    pub fn bytes(&self) -> usize {
        self.used
    }
    pub fn hits(&self) -> u64 {
        self.hits
    }
    pub fn misses(&self) -> u64 {
        self.misses
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
    fn evicts_least_recently_used_within_the_byte_bound() {
        // Each entry of 1 row: 2 tensors x 4 f32 = 32 bytes. Room for 3.
        let mut c = EmbedCache::new(100);
        c.insert(b"a", embeds(1));
        c.insert(b"b", embeds(1));
        c.insert(b"c", embeds(1));
        assert!(c.get(b"a", [1, 2, 2]).is_some()); // a is now the most recent
        c.insert(b"d", embeds(1)); // evicts b
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
