//! The embedding cache: what an image (or a video's temporal group) encoded to, kept by the
//! SHA-256 of everything its embeddings depend on: the input's bytes and how the service turns
//! them into patch rows (the resize target of an image file; the frames themselves for resized
//! pixels, so a video sampled at another fps or size is another key). The caller's
//! `content_hash` is only echoed, never trusted as a key. Bounded by bytes, least recently used
//! out first; a hit skips the decode, the resize and the ViT. Size 0 turns it off.
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use vlm_compute::ImageEmbeds;

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

/// One cached result: the embeddings and the bucket they ran in.
#[derive(Debug, Clone)]
pub struct Cached {
    pub embeds: ImageEmbeds,
    pub bucket: usize,
}

#[derive(Debug, Default)]
struct State {
    entries: HashMap<Key, (Cached, u64)>,
    /// Last use -> key, oldest first.
    order: BTreeMap<u64, Key>,
    bytes: u64,
    tick: u64,
    hits: u64,
    misses: u64,
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

#[derive(Debug)]
pub struct EmbedCache {
    capacity: u64,
    state: Mutex<State>,
}

impl EmbedCache {
    pub fn new(capacity_bytes: u64) -> EmbedCache {
        EmbedCache {
            capacity: capacity_bytes,
            state: Mutex::default(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cached result of `key`, now the most recently used; counts a hit or a miss.
    pub fn get(&self, key: &Key) -> Option<Cached> {
        if !self.enabled() {
            return None;
        }
        let mut s = self.lock();
        s.tick += 1;
        let tick = s.tick;
        let found = match s.entries.get_mut(key) {
            Some((c, last)) => {
                let old = std::mem::replace(last, tick);
                Some((c.clone(), old))
            }
            None => None,
        };
        match found {
            Some((c, old)) => {
                s.order.remove(&old);
                s.order.insert(tick, *key);
                s.hits += 1;
                metrics::counter!("vlm_vision_embed_cache_total", "result" => "hit").increment(1);
                Some(c)
            }
            None => {
                s.misses += 1;
                metrics::counter!("vlm_vision_embed_cache_total", "result" => "miss").increment(1);
                None
            }
        }
    }

    /// Keeps `value` under `key`, dropping the least recently used entries to make room; a
    /// value larger than the whole cache is not kept.
    pub fn put(&self, key: Key, value: Cached) {
        let size = value.embeds.byte_len() as u64;
        if !self.enabled() || size > self.capacity {
            return;
        }
        let mut s = self.lock();
        if let Some((old, last)) = s.entries.remove(&key) {
            s.order.remove(&last);
            s.bytes -= old.embeds.byte_len() as u64;
        }
        while s.bytes + size > self.capacity {
            let Some((_, oldest)) = s.order.pop_first() else {
                break;
            };
            if let Some((gone, _)) = s.entries.remove(&oldest) {
                s.bytes -= gone.embeds.byte_len() as u64;
            }
        }
        s.tick += 1;
        let tick = s.tick;
        s.order.insert(tick, key);
        s.entries.insert(key, (value, tick));
        s.bytes += size;
        metrics::gauge!("vlm_vision_embed_cache_bytes").set(s.bytes as f64);
    }

    pub fn stats(&self) -> CacheStats {
        let s = self.lock();
        CacheStats {
            capacity_bytes: self.capacity,
            used_bytes: s.bytes,
            entries: s.entries.len() as u64,
            hits: s.hits,
            misses: s.misses,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vlm_compute::HostTensor;

    fn embeds(rows: usize) -> Cached {
        let t = HostTensor::from_f32(&vec![1.0; rows * 4], vec![rows, 4]).unwrap();
        Cached {
            embeds: ImageEmbeds {
                embeds: t,
                deepstack: vec![],
                grid_thw: [1, 2, 2 * rows],
            },
            bucket: 8,
        }
    }

    #[test]
    fn least_recently_used_goes_first_and_the_bytes_stay_bounded() {
        // Each entry is rows * 16 bytes; room for 48.
        let c = EmbedCache::new(48);
        let (a, b, d) = (key(&[b"a"]), key(&[b"b"]), key(&[b"d"]));
        c.put(a, embeds(1));
        c.put(b, embeds(1));
        assert!(c.get(&a).is_some()); // a is now newer than b
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
