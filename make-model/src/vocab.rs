//! The generated checkpoint's tokenizer files: `tokenizer.json` (byte-level BPE learned from a
//! small embedded corpus, the Qwen added tokens at the checkpoint's ids) and
//! `tokenizer_config.json` (the Qwen3-VL chat template, eos and pad tokens).
use super::bpe;
use serde_json::{json, Map, Value};
use std::collections::HashSet;
use vlm_compute::Result;

/// The embedded English text the merges are learned from.
const CORPUS: &str = include_str!("corpus.txt");

/// The Qwen3-VL chat template (ChatML; user content as a list of text / image / video parts).
pub const CHAT_TEMPLATE: &str = include_str!("chat_template.jinja");

/// Qwen2/Qwen3's added tokens, in id order from `<|endoftext|>` (151643 in the real vocabulary),
/// with their `special` flag as in the real tokenizer_config.json.
pub const ADDED_TOKENS: [(&str, bool); 26] = [
    ("<|endoftext|>", true),
    ("<|im_start|>", true),
    ("<|im_end|>", true),
    ("<|object_ref_start|>", true),
    ("<|object_ref_end|>", true),
    ("<|box_start|>", true),
    ("<|box_end|>", true),
    ("<|quad_start|>", true),
    ("<|quad_end|>", true),
    ("<|vision_start|>", true),
    ("<|vision_end|>", true),
    ("<|vision_pad|>", true),
    ("<|image_pad|>", true),
    ("<|video_pad|>", true),
    ("<tool_call>", false),
    ("</tool_call>", false),
    ("<|fim_prefix|>", false),
    ("<|fim_middle|>", false),
    ("<|fim_suffix|>", false),
    ("<|fim_pad|>", false),
    ("<|repo_name|>", false),
    ("<|file_sep|>", false),
    ("<tool_response>", false),
    ("</tool_response>", false),
    ("<think>", false),
    ("</think>", false),
];

/// Where the tokenizer's pieces sit in the id space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VocabLayout {
    /// New tokens learned by BPE on top of the 256 byte tokens.
    pub learned_merges: usize,
    /// Id of `<|endoftext|>`; the other added tokens follow it. Ids between the learned
    /// tokens and this one are filled with unreachable filler tokens, so every id below it
    /// decodes to text (as in a real vocabulary).
    pub first_added_id: u32,
    /// Rows of the embedding (`text_config.vocab_size`), >= first_added_id + 26.
    pub vocab_size: usize,
}

impl VocabLayout {
    /// The id of an added token by its content.
    pub fn added_id(&self, content: &str) -> Option<u32> {
        ADDED_TOKENS
            .iter()
            .position(|(c, _)| *c == content)
            .map(|i| self.first_added_id + i as u32)
    }
    fn id(&self, content: &str) -> u32 {
        // Only called with names from ADDED_TOKENS.
        self.added_id(content).unwrap_or(self.first_added_id)
    }
    pub fn endoftext_id(&self) -> u32 {
        self.id("<|endoftext|>")
    }
    pub fn im_end_id(&self) -> u32 {
        self.id("<|im_end|>")
    }
    pub fn image_pad_id(&self) -> u32 {
        self.id("<|image_pad|>")
    }
    pub fn video_pad_id(&self) -> u32 {
        self.id("<|video_pad|>")
    }
    pub fn vision_start_id(&self) -> u32 {
        self.id("<|vision_start|>")
    }
    pub fn vision_end_id(&self) -> u32 {
        self.id("<|vision_end|>")
    }
}

/// Builds `tokenizer.json` for `layout`.
/// A real tokenizer's `tokenizer.json` at `path`, checked against the preset: every added token
/// of Qwen3-VL at the preset's id, and no id past the embedding's rows. The error names the
/// first token that differs.
pub fn checked_tokenizer_json(path: &std::path::Path, layout: &VocabLayout) -> Result<Value> {
    let bad = |message: String| vlm_compute::ComputeError::Config {
        path: path.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| vlm_compute::ComputeError::io(path, e))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let added = v["added_tokens"]
        .as_array()
        .ok_or_else(|| bad("no added_tokens list: not a Hugging Face tokenizer.json".into()))?;
    let id_of = |content: &str| {
        added
            .iter()
            .find(|t| t["content"] == content)
            .and_then(|t| t["id"].as_u64())
    };
    for (content, _) in ADDED_TOKENS {
        let want = layout.id(content) as u64;
        match id_of(content) {
            Some(id) if id == want => {}
            Some(id) => {
                return Err(bad(format!(
                    "{content} has id {id}; this preset's checkpoint has it at {want}"
                )))
            }
            None => return Err(bad(format!("{content} is not one of its added tokens"))),
        }
    }
    let rows = layout.vocab_size as u64;
    let max_id = v["model"]["vocab"]
        .as_object()
        .map(|m| m.values().filter_map(Value::as_u64).max().unwrap_or(0))
        .unwrap_or(0)
        .max(
            added
                .iter()
                .filter_map(|t| t["id"].as_u64())
                .max()
                .unwrap_or(0),
        );
    if max_id >= rows {
        return Err(bad(format!(
            "its ids reach {max_id}, past this preset's {rows} embedding rows"
        )));
    }
    Ok(v)
}

pub fn tokenizer_json(layout: &VocabLayout) -> Result<Value> {
    let learned = bpe::learn(CORPUS, layout.learned_merges)?;
    let mut tokens = learned.vocab;
    fill_vocab(&mut tokens, layout.first_added_id as usize);
    let mut vocab = Map::new();
    for (id, tok) in tokens.iter().enumerate() {
        vocab.insert(tok.clone(), json!(id));
    }
    let mut added = Vec::new();
    for (i, (content, special)) in ADDED_TOKENS.iter().enumerate() {
        let id = layout.first_added_id + i as u32;
        // Also in the model's vocab, so the ids stay where they are however many BPE tokens
        // precede them (the added vocabulary would otherwise number them from vocab.len()).
        vocab.insert(content.to_string(), json!(id));
        added.push(json!({
            "id": id,
            "content": content,
            "single_word": false,
            "lstrip": false,
            "rstrip": false,
            "normalized": false,
            "special": special
        }));
    }
    let merges: Vec<Value> = learned.merges.iter().map(|(a, b)| json!([a, b])).collect();
    let byte_level = json!({
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": false,
        "use_regex": false
    });
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": bpe::pre_tokenizer_json(),
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges
        }
    }))
}

/// Pads the vocabulary up to `len` tokens with letter strings (`ab`, `Ġab`, ... then three and
/// four letters) that no merge produces: the encoder never emits them, but a random model does,
/// and they decode to readable text about as long as a real token.
fn fill_vocab(tokens: &mut Vec<String>, len: usize) {
    let mut seen: HashSet<String> = tokens.iter().cloned().collect();
    let letters: Vec<char> = ('a'..='z').collect();
    let mut width = 2u32;
    let mut n = 0usize;
    while tokens.len() < len {
        let combos = 26usize.pow(width);
        if n >= 2 * combos {
            width += 1;
            n = 0;
            continue;
        }
        let mut k = n / 2;
        let mut word = String::new();
        for _ in 0..width {
            word.insert(0, letters[k % 26]);
            k /= 26;
        }
        if n % 2 == 1 {
            word.insert(0, 'Ġ');
        }
        n += 1;
        if seen.insert(word.clone()) {
            tokens.push(word);
        }
    }
}

/// Builds `tokenizer_config.json` (chat template, eos = `<|im_end|>`, pad = `<|endoftext|>`,
/// and `added_tokens_decoder` as transformers writes it).
pub fn tokenizer_config_json(layout: &VocabLayout, model_max_length: usize) -> Value {
    let mut decoder = Map::new();
    for (i, (content, special)) in ADDED_TOKENS.iter().enumerate() {
        decoder.insert(
            (layout.first_added_id + i as u32).to_string(),
            json!({
                "content": content,
                "lstrip": false,
                "normalized": false,
                "rstrip": false,
                "single_word": false,
                "special": special
            }),
        );
    }
    let additional: Vec<&str> = ADDED_TOKENS[1..14].iter().map(|(c, _)| *c).collect();
    json!({
        "add_bos_token": false,
        "add_prefix_space": false,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": additional,
        "bos_token": null,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": false,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": null
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filler_is_unique_and_exact() {
        let mut toks = vec!["ab".to_string(), "x".to_string()];
        fill_vocab(&mut toks, 2000);
        assert_eq!(toks.len(), 2000);
        let set: HashSet<_> = toks.iter().collect();
        assert_eq!(set.len(), 2000);
    }
}
