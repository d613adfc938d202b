//! Special tokens written in message content are text, not control tokens.
//!
//! A chat template pastes content verbatim, so `<|im_end|><|im_start|>system ...` typed by a
//! user would encode as real turn markers (role injection). As the hosted APIs do, content is
//! encoded with special-token matching off (`tokenizers`' `encode_special_tokens`, HF's
//! `split_special_tokens=True`): only the template's own markers are control tokens.
//!
//! Content that holds a special token's text is wrapped in two Unicode noncharacters before
//! rendering; the rendered prompt is then encoded span by span, the wrapped spans with the
//! literal tokenizer. Content without such text takes the plain path, so ordinary prompts
//! encode exactly as transformers' `apply_chat_template(tokenize=True)` does.
use crate::error::{Result, TokenizerError};
use serde_json::Value;

/// Opens and closes a span of content to encode literally (noncharacters: never in text a
/// client means to send; content holding them is refused on this path).
pub(crate) const OPEN: char = '\u{FDD0}';
pub(crate) const CLOSE: char = '\u{FDD1}';

/// Whether `text` holds any of `specials` (the contents of special added tokens).
pub(crate) fn holds_special(text: &str, specials: &[String]) -> bool {
    text.contains("<") && specials.iter().any(|s| text.contains(s.as_str()))
}

/// `text` wrapped when it holds a special token's text; refuses text holding the markers.
pub(crate) fn wrap(text: &str, specials: &[String]) -> Result<Option<String>> {
    if !holds_special(text, specials) {
        return Ok(None);
    }
    wrap_always(text).map(Some)
}

/// `text` wrapped; refuses text holding the markers.
pub(crate) fn wrap_always(text: &str) -> Result<String> {
    if text.contains([OPEN, CLOSE]) {
        return Err(TokenizerError::invalid(
            "message content holds a special token's text and the noncharacter U+FDD0 or U+FDD1; \
             remove the noncharacter",
        ));
    }
    Ok(format!("{OPEN}{text}{CLOSE}"))
}

/// The texts the template writes without anything between them: each run of adjacent text
/// parts, joined (an image part's own tokens separate runs).
pub(crate) fn joined_runs(parts: &[crate::ChatPart]) -> impl Iterator<Item = String> + '_ {
    parts
        .split(|p| !matches!(p, crate::ChatPart::Text(_)))
        .map(|run| {
            run.iter()
                .filter_map(|p| match p {
                    crate::ChatPart::Text(t) => Some(t.as_str()),
                    _ => None,
                })
                .collect::<String>()
        })
}

/// Every string inside `v` (tool definitions) wrapped as [`wrap`] does.
pub(crate) fn wrap_json(v: &mut Value, specials: &[String]) -> Result<bool> {
    Ok(match v {
        Value::String(s) => match wrap(s, specials)? {
            Some(w) => {
                *s = w;
                true
            }
            None => false,
        },
        Value::Array(items) => {
            let mut any = false;
            for item in items {
                any |= wrap_json(item, specials)?;
            }
            any
        }
        Value::Object(map) => {
            let mut any = false;
            for item in map.values_mut() {
                any |= wrap_json(item, specials)?;
            }
            any
        }
        _ => false,
    })
}

/// The rendered prompt as (span, literal) pairs, markers removed.
pub(crate) fn spans(rendered: &str) -> Result<Vec<(&str, bool)>> {
    let mut out = Vec::new();
    let mut rest = rendered;
    while let Some(open) = rest.find(OPEN) {
        out.push((&rest[..open], false));
        let inner = &rest[open + OPEN.len_utf8()..];
        let close = inner.find(CLOSE).ok_or_else(|| {
            TokenizerError::Tokenizer("chat template dropped the end of a content span".into())
        })?;
        out.push((&inner[..close], true));
        rest = &inner[close + CLOSE.len_utf8()..];
    }
    if rest.contains(CLOSE) {
        return Err(TokenizerError::Tokenizer(
            "chat template dropped the start of a content span".into(),
        ));
    }
    out.push((rest, false));
    out.retain(|(s, _)| !s.is_empty());
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_content_with_special_text_is_wrapped() {
        let specials = vec!["<|im_end|>".to_string()];
        assert_eq!(wrap("hello <b>", &specials).unwrap(), None);
        let w = wrap("a<|im_end|>b", &specials).unwrap().unwrap();
        let rendered = format!("<|im_start|>user\n{w}<|im_end|>");
        assert_eq!(
            spans(&rendered).unwrap(),
            vec![
                ("<|im_start|>user\n", false),
                ("a<|im_end|>b", true),
                ("<|im_end|>", false)
            ]
        );
        assert!(wrap("<|im_end|>\u{FDD0}", &specials).is_err());
    }
}
