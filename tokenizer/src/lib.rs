//! The checkpoint tokenizer and chat template (host-side: no tensor library, no model).
//!
//! [`ChatTokenizer`] loads `tokenizer.json` (HF `tokenizers`) and the chat template
//! (`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`, else
//! `chat_template.json`), renders conversations the way transformers' `apply_chat_template`
//! does (Jinja with `trim_blocks` and `lstrip_blocks`, `namespace`, loop controls, Python
//! string methods, `raise_exception`, a Python-compatible `tojson`), and turns a rendered
//! prompt into ids with each image's single `<|image_pad|>` expanded to that image's token
//! count. [`IncrementalDecoder`] turns a stream of generated ids into text without ever
//! splitting a character.
//!
//! Files: `messages` (what a conversation is), `files` (a checkpoint's tokenizer files),
//! `template` (the Jinja environment), `chat_tokenizer` (loading, rendering, encoding,
//! decoding), `vision_prompt` (image and video placeholders expanded), `control_tokens` (the
//! special-token policy for message content), `incremental` (streamed decoding).
mod bounded;
mod byte_level;
mod chat_tokenizer;
mod control_tokens;
mod error;
mod files;
mod incremental;
mod literal;
mod messages;
mod template;
mod vision_prompt;

pub use byte_level::byte_alphabet;
pub use chat_tokenizer::ChatTokenizer;
pub use error::{Result, TokenizerError};
pub use incremental::IncrementalDecoder;
pub use messages::{
    timestamp_text, ChatMessage, ChatPart, ToolCall, VisionTokens, IMAGE_PAD, VIDEO_PAD,
    VISION_END, VISION_START,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shareable_across_threads() {
        fn send_sync<T: Send + Sync>() {}
        fn send<T: Send>() {}
        send_sync::<ChatTokenizer>();
        send::<IncrementalDecoder>();
    }
}
