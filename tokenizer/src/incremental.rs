//! Streamed decoding: generated ids to text without ever splitting a character.
use crate::chat_tokenizer::ChatTokenizer;
use crate::error::{tok_err, Result};

/// Streams generated ids into text. `push` returns only complete UTF-8 text: bytes of a
/// character split over several byte-level tokens are held until the character is whole
/// (invalid bytes become U+FFFD, as in [`ChatTokenizer::decode`]). The concatenation of
/// everything `push` and `finish` return equals decoding all ids at once.
pub struct IncrementalDecoder {
    tok: ChatTokenizer,
    skip_special: bool,
    /// Byte-level path: bytes not yet returned (at most an incomplete character).
    pending: Vec<u8>,
    /// Fallback path (non byte-level decoders): `tokenizers`' stream state.
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

impl IncrementalDecoder {
    pub fn new(tok: ChatTokenizer, skip_special: bool) -> Self {
        IncrementalDecoder {
            tok,
            skip_special,
            pending: Vec::new(),
            ids: Vec::new(),
            prefix: String::new(),
            prefix_index: 0,
        }
    }

    /// Adds one id; returns the text it completes, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        let inner = &self.tok.inner;
        let Some(table) = &inner.byte_decoder else {
            return tokenizers::tokenizer::step_decode_stream(
                &inner.tokenizer,
                vec![id],
                self.skip_special,
                &mut self.ids,
                &mut self.prefix,
                &mut self.prefix_index,
            )
            .map_err(|e| tok_err("decode", e));
        };
        if let Some(bytes) = inner.token_bytes(id, self.skip_special, table) {
            self.pending.extend_from_slice(&bytes);
        }
        let text = take_complete(&mut self.pending, false);
        Ok((!text.is_empty()).then_some(text))
    }

    /// Ends the stream: returns what is still held (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self) -> Result<Option<String>> {
        if self.tok.inner.byte_decoder.is_none() {
            let all = self
                .tok
                .inner
                .tokenizer
                .decode(&self.ids, self.skip_special)
                .map_err(|e| tok_err("decode", e))?;
            let rest = all.get(self.prefix.len()..).unwrap_or("").to_string();
            self.ids.clear();
            self.prefix.clear();
            self.prefix_index = 0;
            return Ok((!rest.is_empty()).then_some(rest));
        }
        let text = take_complete(&mut self.pending, true);
        Ok((!text.is_empty()).then_some(text))
    }
}

/// Removes and returns the longest decodable prefix of `pending`, exactly as
/// `String::from_utf8_lossy` would decode it; an incomplete trailing character stays unless
/// `last`.
pub(crate) fn take_complete(pending: &mut Vec<u8>, last: bool) -> String {
    let mut out = String::new();
    let mut start = 0;
    while start < pending.len() {
        match std::str::from_utf8(&pending[start..]) {
            Ok(s) => {
                out.push_str(s);
                start = pending.len();
            }
            Err(e) => {
                let valid = e.valid_up_to();
                out.push_str(
                    std::str::from_utf8(&pending[start..start + valid]).unwrap_or_default(),
                );
                start += valid;
                match e.error_len() {
                    Some(n) => {
                        out.push('\u{FFFD}');
                        start += n;
                    }
                    None => {
                        if last {
                            out.push('\u{FFFD}');
                            start = pending.len();
                        }
                        break;
                    }
                }
            }
        }
    }
    pending.drain(..start);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_complete_matches_lossy_decoding() {
        let samples: [&[u8]; 5] = [
            "héllo 🦀 世界".as_bytes(),
            &[0xF0, 0x9F, 0xA6],
            &[0x80, b'a', 0xE4, 0xB8],
            &[0xFF, 0xC3, 0xA9, 0xC3],
            &[0xE4, 0x41, 0xF0, 0x9F, 0x98, 0x80],
        ];
        for s in samples {
            let mut pending = Vec::new();
            let mut out = String::new();
            for &b in s {
                pending.push(b);
                out.push_str(&take_complete(&mut pending, false));
            }
            out.push_str(&take_complete(&mut pending, true));
            assert_eq!(out, String::from_utf8_lossy(s), "{s:?}");
        }
    }
}
