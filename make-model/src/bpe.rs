//! Byte-level BPE in the GPT-2 / Qwen2 style: the 256-symbol byte alphabet, the Qwen2
//! pre-tokenizer, and a small deterministic merge trainer.
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
use vlm_compute::{ComputeError, Result};
pub use vlm_tokenizer::byte_alphabet;

/// Qwen2's pre-tokenizer split pattern (contractions, letter runs with one leading non-letter,
/// single digits, punctuation runs, newlines, spaces). Accepted by the fancy-regex backend.
pub const QWEN2_SPLIT_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `symbol[b]` is the byte-level symbol of byte `b`.
#[cfg(test)]
fn byte_to_symbol() -> [char; 256] {
    let mut table = ['\0'; 256];
    for (b, c) in byte_alphabet() {
        table[b as usize] = c;
    }
    table
}

/// The `pre_tokenizer` object of tokenizer.json: Qwen2's regex split, then ByteLevel without
/// its own regex.
pub fn pre_tokenizer_json() -> Value {
    json!({
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": QWEN2_SPLIT_PATTERN},
                "behavior": "Isolated",
                "invert": false
            },
            {
                "type": "ByteLevel",
                "add_prefix_space": false,
                "trim_offsets": false,
                "use_regex": false
            }
        ]
    })
}

/// Learned merges: the vocabulary (byte alphabet first, then one token per new merge result,
/// in the order learned) and the merge list (pairs of symbols strings, in rank order).
#[derive(Debug, Clone)]
pub struct LearnedBpe {
    pub vocab: Vec<String>,
    pub merges: Vec<(String, String)>,
}

/// Learns merges on `corpus` until the vocabulary holds `256 + new_tokens` tokens. The most
/// frequent adjacent pair wins; ties go to the pair whose (left id, right id) is smallest, so the
/// result depends on the corpus only. Words are the pre-tokenizer's pieces, as in real BPE.
pub fn learn(corpus: &str, new_tokens: usize) -> Result<LearnedBpe> {
    let words = pre_tokenized_words(corpus)?;
    let mut vocab: Vec<String> = byte_alphabet()
        .into_iter()
        .map(|(_, c)| c.to_string())
        .collect();
    let mut index: HashMap<String, u32> = vocab
        .iter()
        .enumerate()
        .map(|(i, s)| (s.clone(), i as u32))
        .collect();
    // Each distinct word as a sequence of token ids, with its count.
    let mut seqs: Vec<(Vec<u32>, u64)> = words
        .into_iter()
        .map(|(w, n)| (w.chars().map(|c| index[&c.to_string()]).collect(), n))
        .collect();
    let mut merges = Vec::new();
    let target = 256 + new_tokens;
    while vocab.len() < target {
        let mut counts: HashMap<(u32, u32), u64> = HashMap::new();
        for (seq, n) in &seqs {
            for pair in seq.windows(2) {
                *counts.entry((pair[0], pair[1])).or_default() += n;
            }
        }
        let Some((&(a, b), _)) = counts
            .iter()
            .max_by(|(pa, ca), (pb, cb)| ca.cmp(cb).then_with(|| pb.cmp(pa)))
        else {
            return Err(ComputeError::Tokenizer(format!(
                "the tokenizer corpus supports only {} new tokens, {new_tokens} requested",
                vocab.len() - 256
            )));
        };
        let merged = format!("{}{}", vocab[a as usize], vocab[b as usize]);
        let id = match index.get(&merged) {
            Some(&id) => id,
            None => {
                let id = vocab.len() as u32;
                index.insert(merged.clone(), id);
                vocab.push(merged);
                id
            }
        };
        merges.push((vocab[a as usize].clone(), vocab[b as usize].clone()));
        for (seq, _) in &mut seqs {
            apply_merge(seq, a, b, id);
        }
    }
    Ok(LearnedBpe { vocab, merges })
}

fn apply_merge(seq: &mut Vec<u32>, a: u32, b: u32, id: u32) {
    let mut out = Vec::with_capacity(seq.len());
    let mut i = 0;
    while i < seq.len() {
        if i + 1 < seq.len() && seq[i] == a && seq[i + 1] == b {
            out.push(id);
            i += 2;
        } else {
            out.push(seq[i]);
            i += 1;
        }
    }
    *seq = out;
}

/// Splits text with the real pre-tokenizer (Qwen2 regex + ByteLevel) and counts the pieces,
/// each a string of byte-level symbols.
fn pre_tokenized_words(text: &str) -> Result<BTreeMap<String, u64>> {
    let pt: PreTokenizerWrapper = serde_json::from_value(pre_tokenizer_json())
        .map_err(|e| ComputeError::Tokenizer(format!("pre-tokenizer: {e}")))?;
    let mut pts = PreTokenizedString::from(text);
    pt.pre_tokenize(&mut pts)
        .map_err(|e| ComputeError::Tokenizer(format!("pre-tokenize corpus: {e}")))?;
    let mut words = BTreeMap::new();
    for (piece, _, _) in pts.get_splits(OffsetReferential::Original, OffsetType::Byte) {
        *words.entry(piece.to_string()).or_insert(0u64) += 1;
    }
    Ok(words)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_is_a_bijection_in_gpt2_order() {
        let a = byte_alphabet();
        assert_eq!(a.len(), 256);
        assert_eq!(a[0], (b'!', '!'));
        let mut bytes: Vec<u8> = a.iter().map(|p| p.0).collect();
        bytes.sort();
        bytes.dedup();
        assert_eq!(bytes.len(), 256);
        let table = byte_to_symbol();
        assert_eq!(table[b' ' as usize], 'Ġ');
        assert_eq!(table[b'\n' as usize], 'Ċ');
        assert_eq!(table[0], 'Ā');
    }

    #[test]
    fn learning_is_deterministic_and_exact() {
        let text = "the cat and the hat and the bat sat on the mat";
        let a = learn(text, 12).unwrap();
        let b = learn(text, 12).unwrap();
        assert_eq!(a.merges, b.merges);
        assert_eq!(a.vocab.len(), 256 + 12);
        assert!(a.vocab.contains(&"Ġthe".to_string()) || a.vocab.contains(&"Ġt".to_string()));
        assert!(learn("ab", 5).is_err());
    }
}
