//! Content keys of KV blocks, for prefix caching: the key of block i of a sequence chains the
//! key of block i-1, the block's token ids, and the (content hash, grid, offset) of every image
//! token it covers, so two sequences get the same key for block i exactly when everything that
//! decides its K/V is the same: all tokens up to its end, every image up to there at the same
//! resolution, and (through the salt) the model, its dtype and the block size. Full blocks
//! only. A text token's rotary position is a function of the tokens and image grids before it,
//! so it needs no place in the key.
use super::block_pool::BlockKey;
use sha2::{Digest, Sha256};
use std::ops::Range;

/// One image of a prompt: where its placeholder tokens are and what they stand for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSpan {
    /// Its token range in the prompt.
    pub tokens: Range<usize>,
    /// The image's content hash (the embedding cache's key).
    pub content_hash: Vec<u8>,
    /// Its grid in raw patches (the resolution it was encoded at).
    pub grid: [usize; 3],
}

/// The keys of a sequence's full blocks, extended as its known tokens grow.
#[derive(Debug, Clone)]
pub struct KeyChain {
    salt: BlockKey,
    block_len: usize,
    images: Vec<ImageSpan>,
    keys: Vec<BlockKey>,
}

impl KeyChain {
    /// `salt` names what every key of this replica shares (model, dtype, block size: see
    /// [`salt`]).
    pub fn new(salt: BlockKey, block_len: usize, images: Vec<ImageSpan>) -> Self {
        assert!(block_len > 0, "block_len must be positive");
        KeyChain {
            salt,
            block_len,
            images,
            keys: Vec::new(),
        }
    }

    /// Keys of every full block so far.
    pub fn keys(&self) -> &[BlockKey] {
        &self.keys
    }

    /// Extends the chain over the known tokens `prompt` then `generated`; returns how many keys
    /// were added (one per block that became full).
    pub fn extend(&mut self, prompt: &[u32], generated: &[u32]) -> usize {
        let known = prompt.len() + generated.len();
        let full = known / self.block_len;
        let before = self.keys.len();
        while self.keys.len() < full {
            let i = self.keys.len();
            let range = i * self.block_len..(i + 1) * self.block_len;
            let parent = self.keys.last().copied().unwrap_or(self.salt);
            let mut h = Sha256::new();
            h.update(parent);
            for t in range.clone() {
                let id = if t < prompt.len() {
                    prompt[t]
                } else {
                    generated[t - prompt.len()]
                };
                h.update(id.to_le_bytes());
            }
            for img in &self.images {
                let lo = img.tokens.start.max(range.start);
                let hi = img.tokens.end.min(range.end);
                if lo < hi {
                    h.update((img.content_hash.len() as u32).to_le_bytes());
                    h.update(&img.content_hash);
                    for g in img.grid {
                        h.update((g as u64).to_le_bytes());
                    }
                    // Which of the image's rows, at which rows of the block.
                    h.update(((lo - img.tokens.start) as u64).to_le_bytes());
                    h.update(((lo - range.start) as u64).to_le_bytes());
                    h.update(((hi - lo) as u64).to_le_bytes());
                }
            }
            let mut key = BlockKey::default();
            key.copy_from_slice(&h.finalize()[..16]);
            self.keys.push(key);
        }
        self.keys.len() - before
    }
}

/// The salt of a replica's keys: its model, weight dtype and block size.
pub fn salt(model_id: &str, dtype: &str, block_len: usize) -> BlockKey {
    let mut h = Sha256::new();
    h.update(b"vlm-kv-prefix-v1\0");
    h.update(model_id.as_bytes());
    h.update([0]);
    h.update(dtype.as_bytes());
    h.update([0]);
    h.update((block_len as u64).to_le_bytes());
    let mut key = BlockKey::default();
    key.copy_from_slice(&h.finalize()[..16]);
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(images: Vec<ImageSpan>) -> KeyChain {
        KeyChain::new(salt("m", "f32", 4), 4, images)
    }

    #[test]
    fn keys_cover_full_blocks_and_chain_the_prefix() {
        let mut a = chain(vec![]);
        assert_eq!(a.extend(&[1, 2, 3], &[]), 0);
        assert_eq!(a.extend(&[1, 2, 3], &[4, 5]), 1);
        assert_eq!(a.extend(&[1, 2, 3], &[4, 5, 6, 7, 8]), 1);
        let mut b = chain(vec![]);
        b.extend(&[1, 2, 3, 4, 5, 6, 7, 8, 9], &[]);
        assert_eq!(
            a.keys(),
            b.keys(),
            "prompt or generated: the same tokens, the same keys"
        );
        // A different first block changes every later key.
        let mut c = chain(vec![]);
        c.extend(&[9, 2, 3, 4, 5, 6, 7, 8], &[]);
        assert_ne!(c.keys()[0], a.keys()[0]);
        assert_ne!(c.keys()[1], a.keys()[1]);
        // Another model, dtype or block size: other keys.
        let mut d = KeyChain::new(salt("m", "bf16", 4), 4, vec![]);
        d.extend(&[1, 2, 3, 4], &[]);
        assert_ne!(d.keys()[0], a.keys()[0]);
    }

    #[test]
    fn image_tokens_are_keyed_by_content_grid_and_offset() {
        let img = |hash: u8, grid: [usize; 3]| ImageSpan {
            tokens: 1..7,
            content_hash: vec![hash; 32],
            grid,
        };
        let ids = [5, 9, 9, 9, 9, 9, 9, 6];
        let key_of = |span: ImageSpan| {
            let mut k = chain(vec![span]);
            k.extend(&ids, &[]);
            k.keys().to_vec()
        };
        let same = key_of(img(1, [1, 4, 6]));
        assert_eq!(same, key_of(img(1, [1, 4, 6])));
        // The same placeholder ids with another image, or the same image at another grid.
        assert_ne!(same[0], key_of(img(2, [1, 4, 6]))[0]);
        assert_ne!(same[0], key_of(img(1, [1, 6, 4]))[0]);
        // No image at all (the ids alone) is another key too.
        let mut plain = chain(vec![]);
        plain.extend(&ids, &[]);
        assert_ne!(same[0], plain.keys()[0]);
    }
}
