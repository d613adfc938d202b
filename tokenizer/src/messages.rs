//! What a conversation is: messages, their text, image and video parts, tool calls.
use serde_json::{json, Value};

pub const IMAGE_PAD: &str = "<|image_pad|>";
pub const VIDEO_PAD: &str = "<|video_pad|>";
pub const VISION_START: &str = "<|vision_start|>";
pub const VISION_END: &str = "<|vision_end|>";

/// One part of a message's content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatPart {
    Text(String),
    /// An image; the template renders `<|vision_start|><|image_pad|><|vision_end|>`.
    Image,
    /// A video; the template renders `<|vision_start|><|video_pad|><|vision_end|>`, whose pad
    /// the encoder expands into the video's temporal groups ([`VisionTokens::Video`]).
    Video,
}

/// The prompt text before a video temporal group at `seconds` (`replace_video_token`'s
/// `f"<{t:.1f} seconds>"`; Python and Rust both round the exact binary value, ties to even).
pub fn timestamp_text(seconds: f64) -> String {
    format!("<{seconds:.1} seconds>")
}

/// What one image or video placeholder of a prompt expands to, in prompt order.
#[derive(Debug, Clone, PartialEq)]
pub enum VisionTokens {
    /// An image: this many `<|image_pad|>`.
    Image(usize),
    /// A video: per temporal group, `<{t:.1f} seconds>` (as text) + `<|vision_start|>` +
    /// `tokens_per_group` x `<|video_pad|>` + `<|vision_end|>`
    /// (`Qwen3VLProcessor.replace_video_token`), one group per timestamp.
    Video {
        tokens_per_group: usize,
        timestamps: Vec<f64>,
    },
}

/// One conversation turn. Rendered as `{"role": ..., "content": [{"type": "text", "text":
/// ...} | {"type": "image"}, ...]}`, the list form the Qwen3-VL template expects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: Vec<ChatPart>,
    /// An assistant turn's tool calls, rendered by the template as `<tool_call>` blocks.
    pub tool_calls: Vec<ToolCall>,
}

/// One function call of an assistant turn: the function's name and its arguments as JSON
/// text (as OpenAI carries them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: Vec<ChatPart>) -> Self {
        ChatMessage {
            role: role.into(),
            content,
            tool_calls: Vec::new(),
        }
    }
    pub fn system(text: impl Into<String>) -> Self {
        Self::new("system", vec![ChatPart::Text(text.into())])
    }
    pub fn user(content: Vec<ChatPart>) -> Self {
        Self::new("user", content)
    }
    pub fn user_text(text: impl Into<String>) -> Self {
        Self::new("user", vec![ChatPart::Text(text.into())])
    }
    pub fn assistant(text: impl Into<String>) -> Self {
        Self::new("assistant", vec![ChatPart::Text(text.into())])
    }
    pub fn image_count(&self) -> usize {
        self.content
            .iter()
            .filter(|p| matches!(p, ChatPart::Image))
            .count()
    }
    pub fn video_count(&self) -> usize {
        self.content
            .iter()
            .filter(|p| matches!(p, ChatPart::Video))
            .count()
    }
    /// The text this message's content and tool calls carry.
    fn texts(&self) -> impl Iterator<Item = &str> {
        let parts = self.content.iter().filter_map(|p| match p {
            ChatPart::Text(t) => Some(t.as_str()),
            ChatPart::Image | ChatPart::Video => None,
        });
        let calls = self
            .tool_calls
            .iter()
            .flat_map(|c| [c.name.as_str(), c.arguments.as_str()]);
        parts.chain(calls)
    }
    pub(crate) fn text_bytes(&self) -> usize {
        self.texts().map(str::len).sum()
    }
    pub(crate) fn to_json(&self) -> Value {
        let parts: Vec<Value> = self
            .content
            .iter()
            .map(|p| match p {
                ChatPart::Text(t) => json!({"type": "text", "text": t}),
                ChatPart::Image => json!({"type": "image"}),
                ChatPart::Video => json!({"type": "video"}),
            })
            .collect();
        let mut m = json!({"role": self.role, "content": parts});
        if !self.tool_calls.is_empty() {
            m["tool_calls"] = self
                .tool_calls
                .iter()
                .map(|c| json!({"type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
                .collect();
        }
        m
    }
}

#[cfg(test)]
mod video_tests {
    use super::timestamp_text;

    #[test]
    fn timestamps_print_as_python_does() {
        // Python: f"{0.25:.1f}" == "0.2", f"{0.35:.1f}" == "0.3" (0.35 is below it in binary),
        // f"{0.75:.1f}" == "0.8", f"{0.45:.1f}" == "0.5".
        assert_eq!(timestamp_text(0.25), "<0.2 seconds>");
        assert_eq!(timestamp_text(0.35), "<0.3 seconds>");
        assert_eq!(timestamp_text(0.75), "<0.8 seconds>");
        assert_eq!(timestamp_text(0.45), "<0.5 seconds>");
        assert_eq!(timestamp_text(1.0), "<1.0 seconds>");
    }
}
