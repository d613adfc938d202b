//! Prompts with images and videos: each placeholder expanded to its part's tokens.
use crate::chat_tokenizer::ChatTokenizer;
use crate::error::{Result, TokenizerError};
use crate::messages::*;
use crate::{bounded, literal};
use serde_json::Value;

impl ChatTokenizer {
    /// [`Self::encode_prompt_within`] for prompts with images and videos: `vision[k]` is the
    /// k-th image or video part of the messages, in order.
    pub fn encode_prompt_vision(
        &self,
        messages: &[ChatMessage],
        tools: &[Value],
        vision: &[VisionTokens],
        limit: usize,
    ) -> Result<Vec<u32>> {
        let expansions = self.vision_expansions(messages, vision)?;
        // Tokens the expansion adds: each placeholder is already one token of the text.
        let image_tokens: usize = expansions.iter().map(|e| e.len().saturating_sub(1)).sum();
        let room = limit.saturating_sub(image_tokens);
        let text_bytes: usize = messages.iter().map(ChatMessage::text_bytes).sum();
        self.check_bytes(text_bytes, room)
            .map_err(|e| e.plus(image_tokens))?;
        let i = &self.inner;
        let (messages, tools, wrapped) = self.wrap_content(messages, tools)?;
        let text = self.render_with_tools(&messages, &tools, true)?;
        let mut ids = Vec::new();
        if wrapped {
            for (span, literal) in literal::spans(&text)? {
                let tok = if literal {
                    self.literal()
                } else {
                    &i.tokenizer
                };
                bounded::encode_within(tok, span, room, i.chunkable, &mut ids)
                    .map_err(|e| e.plus(image_tokens))?;
            }
        } else {
            bounded::encode_within(&i.tokenizer, &text, room, i.chunkable, &mut ids)
                .map_err(|e| e.plus(image_tokens))?;
        }
        self.expand_vision_pads(&ids, &expansions)
    }

    /// The ids each vision placeholder becomes, checked against the messages' parts.
    pub(crate) fn vision_expansions(
        &self,
        messages: &[ChatMessage],
        vision: &[VisionTokens],
    ) -> Result<Vec<Vec<u32>>> {
        let parts: Vec<&ChatPart> = messages
            .iter()
            .flat_map(|m| &m.content)
            .filter(|p| !matches!(p, ChatPart::Text(_)))
            .collect();
        let (images, videos) = (
            parts
                .iter()
                .filter(|p| matches!(p, ChatPart::Image))
                .count(),
            parts
                .iter()
                .filter(|p| matches!(p, ChatPart::Video))
                .count(),
        );
        let given = |want_video: bool| {
            vision
                .iter()
                .filter(|v| matches!(v, VisionTokens::Video { .. }) == want_video)
                .count()
        };
        if images != given(false) || videos != given(true) {
            return Err(TokenizerError::invalid(format!(
                "the messages hold {images} images and {videos} videos but {} image and {} \
                 video token counts were given",
                given(false),
                given(true)
            )));
        }
        let i = &self.inner;
        let mut out = Vec::with_capacity(vision.len());
        for (k, (part, v)) in parts.iter().zip(vision).enumerate() {
            match (part, v) {
                (ChatPart::Image, VisionTokens::Image(0)) => {
                    return Err(TokenizerError::invalid(format!(
                        "image {k} has 0 tokens; every image has at least 1"
                    )))
                }
                (ChatPart::Image, VisionTokens::Image(n)) => out.push(vec![i.image_pad_id; *n]),
                (
                    ChatPart::Video,
                    VisionTokens::Video {
                        tokens_per_group,
                        timestamps,
                    },
                ) => {
                    let pad = i.video_pad_id.ok_or_else(|| {
                        TokenizerError::invalid(format!(
                            "this tokenizer has no {VIDEO_PAD} token: videos cannot be served"
                        ))
                    })?;
                    if *tokens_per_group == 0 || timestamps.is_empty() {
                        return Err(TokenizerError::invalid(format!(
                            "video part {k} has {} groups of {tokens_per_group} tokens; a video \
                             has at least one group of at least 1 token",
                            timestamps.len()
                        )));
                    }
                    let mut ids = Vec::new();
                    for &t in timestamps {
                        let text = timestamp_text(t);
                        ids.extend(self.encode(&text)?);
                        ids.push(i.vision_start_id);
                        ids.extend(std::iter::repeat_n(pad, *tokens_per_group));
                        ids.push(i.vision_end_id);
                    }
                    out.push(ids);
                }
                _ => {
                    return Err(TokenizerError::invalid(format!(
                        "vision part {k} of the messages and its token count disagree on image \
                         or video"
                    )))
                }
            }
        }
        Ok(out)
    }

    /// Replaces the k-th image or video placeholder of `ids` (`<|image_pad|>` /
    /// `<|video_pad|>`, in prompt order) with `expansions[k]`.
    pub(crate) fn expand_vision_pads(
        &self,
        ids: &[u32],
        expansions: &[Vec<u32>],
    ) -> Result<Vec<u32>> {
        let i = &self.inner;
        let is_pad = |t: u32| t == i.image_pad_id || Some(t) == i.video_pad_id;
        let found = ids.iter().filter(|&&t| is_pad(t)).count();
        if found != expansions.len() {
            return Err(TokenizerError::invalid(format!(
                "the prompt holds {found} {IMAGE_PAD}/{VIDEO_PAD} placeholders but {} images and \
                 videos were given (text must not contain the placeholder itself)",
                expansions.len()
            )));
        }
        let mut out =
            Vec::with_capacity(ids.len() + expansions.iter().map(Vec::len).sum::<usize>());
        let mut next = expansions.iter();
        for &t in ids {
            if is_pad(t) {
                let e = next.next().map(Vec::as_slice).unwrap_or(&[]);
                // The template's pad and the expansion agree on the kind.
                let kind_ok = e.is_empty()
                    || (t == i.image_pad_id) == (e.iter().any(|&x| x == i.image_pad_id));
                if !kind_ok {
                    return Err(TokenizerError::invalid(
                        "the template placed an image placeholder where a video was expected, or \
                         the reverse",
                    ));
                }
                out.extend_from_slice(e);
            } else {
                out.push(t);
            }
        }
        Ok(out)
    }
}
