//! Generated ids -> text deltas: incremental detokenization that never splits a UTF-8
//! character, and stop strings (generation ends before the first occurrence of any of them;
//! text that might be the start of a stop string is held back until it is known not to be).
use crate::error::GatewayError;
use vlm_tokenizer::{ChatTokenizer, IncrementalDecoder};

/// Stop-string matching over a stream of text pieces.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds `text`; returns what may be shown now and whether a stop string was found (then
    /// the returned text is everything before it, and later input is ignored).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.held.push_str(text);
        if let Some(pos) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            self.stopped = true;
            let out = self.held[..pos].to_string();
            self.held.clear();
            return (out, true);
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let keep = self.held_back_len();
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// The stream ended without a stop string: everything held is shown.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    fn held_back_len(&self) -> usize {
        let h = &self.held;
        let mut best = 0;
        for (start, _) in h.char_indices() {
            let suffix = &h[start..];
            if self
                .stops
                .iter()
                .any(|s| s.len() > suffix.len() && s.starts_with(suffix))
            {
                best = h.len() - start;
                break;
            }
        }
        best
    }
}

/// What one batch of tokens turned into.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TextDelta {
    pub text: String,
    /// A stop string was found: the stream ends here.
    pub stopped: bool,
}

/// Detokenizer + stop strings for one request.
pub struct TextStream {
    decoder: IncrementalDecoder,
    stops: StopMatcher,
    /// Stop strings are not looked for in the text of the first `min_tokens - 1` tokens
    /// (vLLM's stop checker skips sequences shorter than `min_tokens`).
    min_tokens: u32,
    seen: u32,
}

impl TextStream {
    /// Special tokens (`<|im_end|>`, ...) are left out of the text, not out of the ids.
    pub fn new(tokenizer: &ChatTokenizer, stops: Vec<String>, min_tokens: u32) -> Self {
        TextStream {
            decoder: tokenizer.incremental_decoder(true),
            stops: StopMatcher::new(stops),
            min_tokens,
            seen: 0,
        }
    }

    pub fn push(&mut self, ids: &[u32]) -> Result<TextDelta, GatewayError> {
        let mut out = String::new();
        for &id in ids {
            let piece = self
                .decoder
                .push(id)
                .map_err(|e| GatewayError::Internal(format!("detokenize: {e}")))?;
            self.seen += 1;
            if self.seen < self.min_tokens {
                out.extend(piece);
                continue;
            }
            if let Some(p) = piece {
                let (shown, stopped) = self.stops.push(&p);
                out.push_str(&shown);
                if stopped {
                    return Ok(TextDelta {
                        text: out,
                        stopped: true,
                    });
                }
            }
        }
        Ok(TextDelta {
            text: out,
            stopped: false,
        })
    }

    /// End of generation: flushes the decoder and the held-back text.
    pub fn finish(&mut self) -> Result<TextDelta, GatewayError> {
        if self.stops.stopped() {
            return Ok(TextDelta {
                text: String::new(),
                stopped: true,
            });
        }
        let mut out = String::new();
        if let Some(p) = self
            .decoder
            .finish()
            .map_err(|e| GatewayError::Internal(format!("detokenize: {e}")))?
        {
            let (shown, stopped) = self.stops.push(&p);
            out.push_str(&shown);
            if stopped {
                return Ok(TextDelta {
                    text: out,
                    stopped: true,
                });
            }
        }
        out.push_str(&self.stops.finish());
        Ok(TextDelta {
            text: out,
            stopped: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (s, stopped) = m.push(p);
            out.push_str(&s);
            if stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stops_before_the_stop_string_even_across_pieces() {
        assert_eq!(
            run(&["END"], &["hello E", "N", "D more"]),
            ("hello ".into(), true)
        );
        assert_eq!(run(&["\n\n"], &["a\n", "\nb"]), ("a".into(), true));
        assert_eq!(run(&["xy", "b"], &["abc"]), ("a".into(), true));
    }

    #[test]
    fn holds_back_only_possible_prefixes() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("hi E"), ("hi ".into(), false));
        assert_eq!(m.push("X"), ("EX".into(), false));
        assert_eq!(run(&["END"], &["hi E"]), ("hi E".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn multibyte_text_is_never_split() {
        assert_eq!(run(&["é!"], &["caf", "é", "!x"]), ("caf".into(), true));
        assert_eq!(run(&["日本"], &["日", "日本"]), ("日".into(), true));
        let mut m = StopMatcher::new(vec!["éa".into()]);
        assert_eq!(m.push("xé"), ("x".into(), false));
        assert_eq!(m.finish(), "é");
    }

    #[test]
    fn text_stream_decodes_like_decode_all() {
        let dir = crate::validation::tests::tiny_dir();
        let tok = ChatTokenizer::from_dir(&dir).unwrap();
        let ids = tok.encode("héllo wörld, 日本語 text").unwrap();
        let mut ts = TextStream::new(&tok, vec![], 0);
        let mut out = String::new();
        for id in &ids {
            out.push_str(&ts.push(&[*id]).unwrap().text);
        }
        out.push_str(&ts.finish().unwrap().text);
        assert_eq!(out, tok.decode_skip_special(&ids).unwrap());

        let mut ts = TextStream::new(&tok, vec!["wörld".into()], 0);
        let d = ts.push(&ids).unwrap();
        assert!(d.stopped);
        assert_eq!(d.text, "héllo ");
    }

    #[test]
    fn stop_strings_wait_for_min_tokens() {
        let dir = crate::validation::tests::tiny_dir();
        let tok = ChatTokenizer::from_dir(&dir).unwrap();
        let ids = tok.encode("ab ab ab").unwrap();
        let text = |min_tokens| {
            let mut ts = TextStream::new(&tok, vec!["ab".into()], min_tokens);
            let mut out = String::new();
            for id in &ids {
                let d = ts.push(&[*id]).unwrap();
                out.push_str(&d.text);
                if d.stopped {
                    return (out, true);
                }
            }
            out.push_str(&ts.finish().unwrap().text);
            (out, false)
        };
        assert_eq!(text(0), (String::new(), true));
        // Past the first tokens, the next "ab" stops it.
        let (out, stopped) = text(2);
        assert!(stopped && out.starts_with("ab"), "{out:?}");
        assert!(out.len() < "ab ab ab".len(), "{out:?}");
        // Never armed: all of it.
        assert_eq!(text(100), ("ab ab ab".to_string(), false));
    }
}
