//! Encoding long text in pieces, with a token limit checked as it goes.
//!
//! `tokenizers` builds an [`tokenizers::Encoding`] per call (ids, tokens as strings, offsets,
//! masks: ~100 bytes a token), so encoding a 30 MB prompt whole costs gigabytes before any
//! length check can run. Here text over [`CHUNK_BYTES`] is cut at points where the Qwen2
//! pre-tokenizer (`Split` on its regex, then `ByteLevel`, NFC before) always splits, each
//! piece is encoded alone and only its ids are kept, and the work stops once the limit is
//! passed. The ids equal encoding the whole text at once (`tests/bounded.rs` checks this on
//! random text).
use crate::error::{Result, TokenizerError};
use tokenizers::Tokenizer;

/// Text at most this long is encoded in one call.
pub(crate) const CHUNK_BYTES: usize = 64 * 1024;

/// `text`'s ids through `tok`, refusing once they pass `limit` (then `TooLong` reports how
/// many were counted so far: a lower bound). `chunkable` is false when the tokenizer's added
/// tokens could straddle a cut (see [`cuts_are_safe`]); then the text is encoded whole.
pub(crate) fn encode_within(
    tok: &Tokenizer,
    text: &str,
    limit: usize,
    chunkable: bool,
    out: &mut Vec<u32>,
) -> Result<()> {
    encode_in_pieces(tok, text, limit, chunkable.then_some(CHUNK_BYTES), out)
}

/// [`encode_within`] with pieces of at least `piece_bytes` (`None`: whole).
fn encode_in_pieces(
    tok: &Tokenizer,
    text: &str,
    limit: usize,
    piece_bytes: Option<usize>,
    out: &mut Vec<u32>,
) -> Result<()> {
    let pieces: Box<dyn Iterator<Item = &str>> = if let Some(min) = piece_bytes {
        Box::new(Pieces { rest: text, min })
    } else {
        Box::new(std::iter::once(text))
    };
    for piece in pieces {
        let enc = tok
            .encode(piece, false)
            .map_err(|e| TokenizerError::Tokenizer(format!("encode: {e}")))?;
        out.extend_from_slice(enc.get_ids());
        if out.len() > limit {
            return Err(TokenizerError::TooLong {
                at_least: out.len(),
                limit,
            });
        }
    }
    Ok(())
}

/// Cuts are safe when no added token holds a space or a newline (a cut could fall inside it)
/// and none strips the whitespace around it.
pub(crate) fn cuts_are_safe(tok: &Tokenizer) -> bool {
    tok.get_added_tokens_decoder()
        .values()
        .all(|t| !t.lstrip && !t.rstrip && !t.single_word && !t.content.contains([' ', '\n']))
}

/// Splits text into pieces of at least `min` bytes (the last may be shorter) at safe cuts.
struct Pieces<'a> {
    rest: &'a str,
    min: usize,
}

impl<'a> Iterator for Pieces<'a> {
    type Item = &'a str;
    fn next(&mut self) -> Option<&'a str> {
        if self.rest.is_empty() {
            return None;
        }
        let cut = next_cut(self.rest, self.min).unwrap_or(self.rest.len());
        let (piece, rest) = self.rest.split_at(cut);
        self.rest = rest;
        Some(piece)
    }
}

/// The first byte index at or after `from` where the pre-tokenizer's regex
/// (`'s|..|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`)
/// always ends a match: before a space that follows a non-space (no alternative takes a
/// trailing space after a non-space character), or after a newline followed by a non-space
/// (no alternative holds a newline followed by a non-space). Both sides are starters for NFC.
fn next_cut(text: &str, from: usize) -> Option<usize> {
    let bytes = text.as_bytes();
    let mut i = from.max(1);
    while i < bytes.len() {
        if text.is_char_boundary(i) {
            let prev = text[..i].chars().next_back()?;
            let next = text[i..].chars().next()?;
            if (next == ' ' && !prev.is_whitespace()) || (prev == '\n' && !next.is_whitespace()) {
                return Some(i);
            }
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use vlm_make_model::{make_model, MakeOptions, Preset};

    #[test]
    fn cuts_fall_before_a_space_after_a_word_or_after_a_newline() {
        assert_eq!(next_cut("abc def", 1), Some(3));
        assert_eq!(next_cut("ab\n\ncd", 1), Some(4));
        // Whitespace runs are never cut inside, nor after punctuation's trailing newlines.
        assert_eq!(next_cut("a  \n b", 2), None);
        assert_eq!(next_cut("日本 語", 1), Some("日本".len()));
        assert_eq!(next_cut("aaaa", 1), None);
    }

    #[test]
    fn pieces_cover_the_text_in_order() {
        let text = "word ".repeat(40_000);
        let pieces: Vec<&str> = Pieces {
            rest: &text,
            min: CHUNK_BYTES,
        }
        .collect();
        assert!(pieces.len() > 2);
        assert!(pieces[..pieces.len() - 1]
            .iter()
            .all(|p| p.len() >= CHUNK_BYTES));
        assert_eq!(pieces.concat(), text);
    }

    /// Text made of what the pre-tokenizer's regex cares about: letters, digits, spaces,
    /// newlines, tabs, punctuation, contractions, CJK, combining marks, emoji, and the text of
    /// added tokens.
    fn tricky_text() -> impl Strategy<Value = String> {
        let atoms = prop::sample::select(vec![
            "a",
            "Z",
            "word",
            "é",
            "e\u{301}",
            "日本",
            "語",
            "7",
            "42",
            " ",
            "  ",
            "\n",
            "\n\n",
            "\r\n",
            "\t",
            " \n",
            "!",
            "?!",
            ".\n",
            "'s",
            "'LL",
            "🦀",
            "👩‍👧",
            "\u{a0}",
            "-",
            "<|im_end|>",
            "<|im_start|>",
            "<tool_call>",
            "<|",
            "|>",
            "\u{3000}",
        ]);
        prop::collection::vec(atoms, 0..400).prop_map(|v| v.concat())
    }

    fn tokenizers() -> Vec<(tempfile::TempDir, Tokenizer)> {
        [Preset::Tiny, Preset::Qwen3Vl2b]
            .into_iter()
            .map(|preset| {
                let dir = tempfile::tempdir().unwrap();
                let mut opts = MakeOptions::new(preset);
                opts.weights = false;
                make_model(dir.path(), &opts).unwrap();
                let tok = Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
                assert!(cuts_are_safe(&tok));
                (dir, tok)
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Cutting anywhere the cuts allow gives the ids of encoding the text whole.
        #[test]
        fn pieces_encode_as_the_whole_text(text in tricky_text(), min in 1usize..48) {
            thread_local! {
                static TOKS: Vec<(tempfile::TempDir, Tokenizer)> = tokenizers();
            }
            TOKS.with(|toks| {
                for (_, tok) in toks {
                    let whole = tok.encode(text.as_str(), false).unwrap().get_ids().to_vec();
                    let mut ids = Vec::new();
                    encode_in_pieces(tok, &text, usize::MAX, Some(min), &mut ids).unwrap();
                    prop_assert_eq!(&ids, &whole);
                    // Stopping at a limit never reports fewer tokens than the limit.
                    if whole.len() > 3 {
                        let mut some = Vec::new();
                        let err = encode_in_pieces(tok, &text, 3, Some(min), &mut some).unwrap_err();
                        let TokenizerError::TooLong { at_least, limit } = err else { panic!() };
                        prop_assert!(at_least > 3 && at_least <= whole.len() && limit == 3);
                    }
                }
                Ok(())
            })?;
        }
    }
}
