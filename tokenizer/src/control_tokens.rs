//! Special tokens written in message content: text unless the operator opts into control
//! tokens (`--control-tokens-in-content`); content holding them is encoded without
//! special-token matching.
use crate::chat_tokenizer::ChatTokenizer;
use crate::error::Result;
use crate::literal;
use crate::messages::*;
use serde_json::Value;
use tokenizers::Tokenizer;

/// Messages and tools as [`ChatTokenizer::wrap_content`] gives them, and whether any content
/// was wrapped.
pub(crate) type Wrapped<'a> = (
    std::borrow::Cow<'a, [ChatMessage]>,
    std::borrow::Cow<'a, [Value]>,
    bool,
);

/// Whether any string inside `v` satisfies `f`.
pub(crate) fn json_holds(v: &Value, f: &impl Fn(&str) -> bool) -> bool {
    match v {
        Value::String(s) => f(s),
        Value::Array(items) => items.iter().any(|i| json_holds(i, f)),
        Value::Object(map) => map.values().any(|i| json_holds(i, f)),
        _ => false,
    }
}

impl ChatTokenizer {
    /// The messages and tools with content holding special-token text wrapped for literal
    /// encoding (borrowed as they are when nothing needs it), and whether any was.
    pub(crate) fn wrap_content<'a>(
        &self,
        messages: &'a [ChatMessage],
        tools: &'a [Value],
    ) -> Result<Wrapped<'a>> {
        use std::borrow::Cow;
        let specials = &self.inner.special_texts;
        let in_text = |t: &str| literal::holds_special(t, specials);
        // The template pastes a message's adjacent text parts together, so a special token's
        // text split over two parts (`"<|im_"`, `"start|>"`) counts: every text part of such
        // a message is encoded literally.
        let holds = |m: &ChatMessage| {
            literal::joined_runs(&m.content).any(|run| in_text(&run))
                || m.tool_calls
                    .iter()
                    .any(|c| in_text(&c.name) || in_text(&c.arguments))
        };
        let needed = !self.control_tokens_in_content
            && (messages.iter().any(holds) || tools.iter().any(|t| json_holds(t, &in_text)));
        if !needed {
            return Ok((Cow::Borrowed(messages), Cow::Borrowed(tools), false));
        }
        let mut msgs = messages.to_vec();
        for m in msgs.iter_mut().filter(|m| holds(m)) {
            for part in &mut m.content {
                if let ChatPart::Text(t) = part {
                    *t = literal::wrap_always(t)?;
                }
            }
            for c in &mut m.tool_calls {
                for t in [&mut c.name, &mut c.arguments] {
                    if let Some(w) = literal::wrap(t, specials)? {
                        *t = w;
                    }
                }
            }
        }
        let mut tools = tools.to_vec();
        for t in &mut tools {
            literal::wrap_json(t, specials)?;
        }
        Ok((Cow::Owned(msgs), Cow::Owned(tools), true))
    }

    pub(crate) fn literal(&self) -> &Tokenizer {
        self.inner.literal.get_or_init(|| {
            let mut t = self.inner.tokenizer.clone();
            t.set_encode_special_tokens(true);
            t
        })
    }
}
