//! A least-recently-used store of image embeddings bounded in bytes (embeddings plus every
//! deepstack level), for the services' embedding caches: the LM's by content hash and grid,
//! the vision service's by the SHA-256 of its input. Values share their bytes, so a hit costs no
//! copy. Callers count their own metrics.
use crate::embeds::ImageEmbeds;
use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

#[derive(Debug)]
pub struct EmbedsLru<K> {
    capacity: usize,
    used: usize,
    tick: u64,
    /// key -> (value, last use)
    map: HashMap<K, (ImageEmbeds, u64)>,
    /// last use -> key, oldest first
    order: BTreeMap<u64, K>,
    hits: u64,
    misses: u64,
}

impl<K: Hash + Eq + Clone> EmbedsLru<K> {
    pub fn new(capacity_bytes: usize) -> Self {
        EmbedsLru {
            capacity: capacity_bytes,
            used: 0,
            tick: 0,
            map: HashMap::new(),
            order: BTreeMap::new(),
            hits: 0,
            misses: 0,
        }
    }

    /// The value of `key`, now the most recently used; counts a hit or a miss.
    pub fn get(&mut self, key: &K) -> Option<ImageEmbeds> {
        self.tick += 1;
        let tick = self.tick;
        match self.map.get_mut(key) {
            Some((value, last)) => {
                let old = std::mem::replace(last, tick);
                let value = value.clone();
                self.order.remove(&old);
                self.order.insert(tick, key.clone());
                self.hits += 1;
                Some(value)
            }
            None => {
                self.misses += 1;
                None
            }
        }
    }

    /// Keeps `value` under `key`, evicting the least recently used entries to stay within the
    /// capacity; a value larger than the whole capacity is not kept.
    pub fn insert(&mut self, key: K, value: ImageEmbeds) {
        let bytes = value.byte_len();
        if bytes > self.capacity {
            return;
        }
        if let Some((old, last)) = self.map.remove(&key) {
            self.order.remove(&last);
            self.used -= old.byte_len();
        }
        while self.used + bytes > self.capacity {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            if let Some((gone, _)) = self.map.remove(&oldest) {
                self.used -= gone.byte_len();
            }
        }
        self.tick += 1;
        self.order.insert(self.tick, key.clone());
        self.map.insert(key, (value, self.tick));
        self.used += bytes;
    }

    pub fn capacity(&self) -> usize {
        self.capacity
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
