//! The chat completion body ([`ChatCompletionRequest`]) to a domain [`ChatRequest`]: messages,
//! image and video parts, tool calls, sampling. http image URLs are checked here and fetched
//! later ([`ParsedChat::fetch_images`]), after the request's shape is known to pass.
use super::images::{detail_budget, fetch_part, image_source, with_budget, ImageSource};
use super::params::check_unread;
use super::sampling::SamplingFields;
use crate::error::GatewayError;
use crate::fetch::{ImageFetcher, Target};
use crate::response_format::StructuredFields;
use crate::tool_calls::{self, Tools};
use crate::validation::{ChatRequest, InputMessage, InputPart};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Map, Value};
use vlm_config::PixelBudget;
use vlm_tokenizer::ToolCall;

/// The request body: the fields this server reads, and in `extra` the rest, which
/// [`check_unread`] refuses unless they ask for nothing (see `params`).
#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    #[serde(default)]
    pub model: String,
    pub messages: Vec<OaMessage>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    /// Tool calling (see `tool_calls`).
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// vLLM's per-request processor options: `min_pixels` / `max_pixels` of every image.
    pub mm_processor_kwargs: Option<Map<String, Value>>,
    /// Sampling, stop conditions, structured output, streaming.
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(flatten)]
    pub structured: StructuredFields,
    /// Declared last: it gets only what the fields above leave.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
pub struct OaMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<OaContent>,
    /// An assistant turn's calls: `[{id, type: "function", function: {name, arguments}}]`.
    pub tool_calls: Option<Vec<Value>>,
    /// A tool result's call id (the Qwen template does not show it; accepted as OpenAI sends it).
    pub tool_call_id: Option<String>,
    /// `name`, ...: refused unless null (see `params`).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum OaContent {
    Text(String),
    Parts(Vec<OaPart>),
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OaPart {
    Text {
        text: String,
    },
    ImageUrl {
        image_url: OaImageUrl,
    },
    /// vLLM's video part: an MP4 in a data: URL.
    VideoUrl {
        video_url: OaImageUrl,
    },
    /// Pre-sampled frames (qwen-vl-utils' form): image data: URLs, taken at `fps`.
    Video {
        video: Vec<Value>,
        fps: Option<f64>,
        /// qwen-vl-utils' other per-video keys (`nframes`, `max_pixels`, ...): refused.
        #[serde(flatten)]
        extra: Map<String, Value>,
    },
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum OaImageUrl {
    Object {
        url: String,
        /// Only `auto` (the processor's own resolution rules) is served.
        detail: Option<String>,
    },
    Plain(String),
}

impl OaImageUrl {
    fn url(&self) -> &str {
        match self {
            OaImageUrl::Object { url, .. } | OaImageUrl::Plain(url) => url,
        }
    }

    fn detail(&self) -> Option<&str> {
        match self {
            OaImageUrl::Object { detail, .. } => detail.as_deref(),
            OaImageUrl::Plain(_) => None,
        }
    }
}

/// vLLM's `mm_processor_kwargs`: `min_pixels` and `max_pixels` for every image of the request,
/// `fps` or `num_frames` for every video.
fn mm_processor_kwargs(
    kw: Option<&Map<String, Value>>,
) -> Result<(PixelBudget, vlm_config::video::Sampling), GatewayError> {
    let Some(kw) = kw else {
        return Ok(Default::default());
    };
    let mut rest = kw.clone();
    let sampling = super::video::take_video_kwargs(&mut rest)?;
    let mut take = |k: &str| -> Result<Option<u64>, GatewayError> {
        match rest.remove(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().filter(|&n| n > 0).map(Some).ok_or_else(|| {
                GatewayError::param(
                    &format!("mm_processor_kwargs.{k}"),
                    format!("mm_processor_kwargs.{k} must be a positive pixel count"),
                )
            }),
        }
    };
    let b = PixelBudget {
        min_pixels: take("min_pixels")?,
        max_pixels: take("max_pixels")?,
    };
    check_unread(&rest, "mm_processor_kwargs.")?;
    Ok((b, sampling))
}

/// A parsed request whose http image URLs are not fetched yet: their parts hold empty images.
/// Check its shape (image count, roles, sampling) before [`fetch_images`](Self::fetch_images),
/// so a request that will be refused costs no network.
#[derive(Debug)]
pub struct ParsedChat {
    pub chat: ChatRequest,
    /// The tools the answer may call (`None`: plain text).
    pub tools: Option<Tools>,
    /// (message index, part index, URL) of each image still to fetch.
    pub remote: Vec<(usize, usize, Target)>,
}

impl ParsedChat {
    /// Fetches every remote image at once; the first failure refuses the request.
    pub async fn fetch_images(self, fetcher: &ImageFetcher) -> Result<ChatRequest, GatewayError> {
        let ParsedChat {
            mut chat, remote, ..
        } = self;
        let parts =
            futures::future::try_join_all(remote.iter().map(|(_, _, t)| fetch_part(fetcher, t)))
                .await?;
        for ((m, p, _), part) in remote.into_iter().zip(parts) {
            let slot = &mut chat.messages[m].content[p];
            let budget = match slot {
                InputPart::Image { budget, .. } => *budget,
                InputPart::Text(_) | InputPart::Video(_) => PixelBudget::default(),
            };
            *slot = with_budget(part, budget);
        }
        Ok(chat)
    }
}

/// OpenAI body -> domain request, image URLs fetched.
pub async fn to_chat_request(
    body: ChatCompletionRequest,
    body_bytes: usize,
    fetcher: &ImageFetcher,
) -> Result<ChatRequest, GatewayError> {
    parse_chat_request(body, body_bytes, fetcher)?
        .fetch_images(fetcher)
        .await
}

/// OpenAI body -> domain request, http image URLs checked but not fetched.
pub fn parse_chat_request(
    body: ChatCompletionRequest,
    body_bytes: usize,
    fetcher: &ImageFetcher,
) -> Result<ParsedChat, GatewayError> {
    check_unread(&body.extra, "")?;
    let (pixels, video_sampling) = mm_processor_kwargs(body.mm_processor_kwargs.as_ref())?;
    let mut messages = Vec::with_capacity(body.messages.len());
    let mut remote = Vec::new();
    for (mi, m) in body.messages.into_iter().enumerate() {
        check_unread(&m.extra, &format!("messages[{mi}]."))?;
        let content = match m.content {
            None => Vec::new(),
            Some(OaContent::Text(t)) => vec![InputPart::Text(t)],
            Some(OaContent::Parts(parts)) => {
                let mut content = Vec::with_capacity(parts.len());
                for (pi, p) in parts.into_iter().enumerate() {
                    content.push(match p {
                        OaPart::Text { text } => InputPart::Text(text),
                        OaPart::VideoUrl { video_url } => {
                            if video_url.detail().is_some() {
                                let param =
                                    format!("messages[{mi}].content[{pi}].video_url.detail");
                                return Err(GatewayError::param(
                                    &param,
                                    format!("{param}: detail is for images; a video's budget is mm_processor_kwargs"),
                                ));
                            }
                            InputPart::Video(super::video::video_url_part(
                                video_url.url(),
                                video_sampling,
                                &format!("messages[{mi}].content[{pi}].video_url"),
                            )?)
                        }
                        OaPart::Video { video, fps, extra } => {
                            check_unread(&extra, &format!("messages[{mi}].content[{pi}]."))?;
                            InputPart::Video(super::video::frames_part(
                                &video,
                                fps,
                                video_sampling,
                                &format!("messages[{mi}].content[{pi}]"),
                            )?)
                        }
                        OaPart::ImageUrl { image_url } => {
                            let param = format!("messages[{mi}].content[{pi}].image_url.detail");
                            let budget = detail_budget(image_url.detail(), pixels, &param)?;
                            match image_source(image_url.url(), fetcher)? {
                                ImageSource::Inline(part) => with_budget(part, budget),
                                ImageSource::Remote(t) => {
                                    remote.push((mi, pi, t));
                                    InputPart::Image {
                                        data: Bytes::new(),
                                        mime_type: String::new(),
                                        budget,
                                    }
                                }
                            }
                        }
                    });
                }
                content
            }
        };
        // OpenAI's "developer" role is the system prompt of newer models.
        let role = if m.role == "developer" {
            "system".to_string()
        } else {
            m.role
        };
        let mut tool_calls = Vec::new();
        for (ci, c) in m.tool_calls.into_iter().flatten().enumerate() {
            let param = format!("messages[{mi}].tool_calls[{ci}]");
            let f = c.get("function");
            let name = f.and_then(|f| f.get("name")).and_then(Value::as_str);
            let arguments = f.and_then(|f| f.get("arguments"));
            let (Some(name), Some(arguments)) = (name, arguments) else {
                return Err(GatewayError::param(
                    &param,
                    format!("{param} must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}"),
                ));
            };
            tool_calls.push(ToolCall {
                name: name.to_string(),
                arguments: match arguments {
                    Value::String(a) => a.clone(),
                    a => a.to_string(),
                },
            });
        }
        messages.push(InputMessage {
            role,
            content,
            tool_calls,
        });
    }
    let tools = tool_calls::parse(body.tools, body.tool_choice, body.parallel_tool_calls)?;
    let forced = tools
        .as_ref()
        .and_then(Tools::grammar)
        .map(|g| vlm_proto::StructuredOutput {
            kind: Some(vlm_proto::structured_output::Kind::Lark(g)),
        });
    let sampling = body.sampling.into_sampling(
        body.structured,
        0,
        (
            body.logprobs.unwrap_or(false),
            body.top_logprobs.unwrap_or(0),
        ),
        forced,
    )?;
    let chat = ChatRequest {
        messages,
        tools: tools.as_ref().map(|t| t.defs.clone()).unwrap_or_default(),
        prompt: None,
        sampling,
        model: body.model,
        body_bytes,
    };
    Ok(ParsedChat {
        chat,
        tools,
        remote,
    })
}

#[cfg(test)]
mod tests {
    use super::super::images::LOW_DETAIL_PIXELS;
    use super::*;
    use crate::fetch::FetchOptions;
    use base64::Engine;
    use serde_json::json;

    #[test]
    fn parses_openai_bodies_and_data_urls() {
        let png = base64::engine::general_purpose::STANDARD.encode([1u8, 2, 3]);
        let body: ChatCompletionRequest = serde_json::from_value(json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{png}")}},
                    {"type": "text", "text": "what?"}
                ]}
            ],
            "max_tokens": 5, "temperature": 0, "stop": "x", "stream": true
        }))
        .unwrap();
        let parsed =
            parse_chat_request(body, 100, &ImageFetcher::new(FetchOptions::deny_all())).unwrap();
        assert!(parsed.remote.is_empty());
        let r = parsed.chat;
        assert_eq!(r.messages.len(), 2);
        assert_eq!(
            r.messages[1].content[0],
            InputPart::Image {
                data: vec![1u8, 2, 3].into(),
                mime_type: "image/png".into(),
                budget: Default::default(),
            }
        );
        assert_eq!(r.sampling.max_tokens, 5);
        assert_eq!(r.sampling.temperature, 0.0);
        assert_eq!(r.sampling.stop, vec!["x".to_string()]);
    }

    #[test]
    fn detail_and_mm_processor_kwargs_set_the_pixel_budget() {
        let (req, sampling) = mm_processor_kwargs(Some(
            json!({"min_pixels": 1000, "max_pixels": 900000, "fps": 1})
                .as_object()
                .unwrap(),
        ))
        .unwrap();
        assert_eq!(sampling, vlm_config::video::Sampling::Fps(1.0));
        assert_eq!(detail_budget(Some("auto"), req, "d").unwrap(), req);
        let low = detail_budget(Some("low"), req, "d").unwrap();
        assert_eq!(
            (low.min_pixels, low.max_pixels),
            (Some(1000), Some(LOW_DETAIL_PIXELS))
        );
        let high = detail_budget(Some("high"), PixelBudget::default(), "d").unwrap();
        assert_eq!(high.max_pixels, Some(u64::MAX));
        assert_eq!(
            detail_budget(Some("ultra"), req, "p.detail")
                .unwrap_err()
                .param_name(),
            Some("p.detail")
        );
        // Fetched and inline images alike keep their part's budget.
        let body: ChatCompletionRequest = serde_json::from_value(json!({
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url":
                {"url": format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode([1u8])),
                 "detail": "low"}}]}]
        }))
        .unwrap();
        let parsed =
            parse_chat_request(body, 10, &ImageFetcher::new(FetchOptions::deny_all())).unwrap();
        let InputPart::Image { budget, .. } = &parsed.chat.messages[0].content[0] else {
            panic!("not an image");
        };
        assert_eq!(budget.max_pixels, Some(LOW_DETAIL_PIXELS));
    }

    #[test]
    fn image_urls_refused_unless_allowed() {
        let deny = ImageFetcher::new(FetchOptions::deny_all());
        let e = image_source("https://evil.example/a.png", &deny).unwrap_err();
        assert!(
            e.to_string().contains("--allow-image-host evil.example"),
            "{e}"
        );
        let ok = ImageFetcher::new(FetchOptions {
            allow_hosts: vec!["ok.example".into()],
            ..FetchOptions::deny_all()
        });
        assert!(matches!(
            image_source("http://ok.example/a.png", &ok),
            Ok(ImageSource::Remote(_))
        ));
        assert!(matches!(
            image_source("https://ok.example/a.png", &ok),
            Ok(ImageSource::Remote(_))
        ));
        let e = image_source("data:image/png,abc", &deny).unwrap_err();
        assert!(e.to_string().contains("base64"), "{e}");
        assert!(image_source("ftp://x", &deny).is_err());
    }

    #[test]
    fn remote_parts_are_placeholders_until_fetched() {
        let body: ChatCompletionRequest = serde_json::from_value(json!({
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": "http://ok.example/a.png"}
            ]}]
        }))
        .unwrap();
        let ok = ImageFetcher::new(FetchOptions {
            allow_hosts: vec!["ok.example".into()],
            ..FetchOptions::deny_all()
        });
        let p = parse_chat_request(body, 10, &ok).unwrap();
        assert_eq!(p.remote.len(), 1);
        assert_eq!((p.remote[0].0, p.remote[0].1), (0, 1));
        assert_eq!(p.remote[0].2.shown(), "http://ok.example/a.png");
    }

    #[test]
    fn video_part_options_not_served_are_refused() {
        let deny = ImageFetcher::new(FetchOptions::deny_all());
        let parse = |part: Value| {
            let body: ChatCompletionRequest =
                serde_json::from_value(json!({"messages": [{"role": "user", "content": [part]}]}))
                    .unwrap();
            parse_chat_request(body, 10, &deny).map(|_| ())
        };
        let frame = "data:image/png;base64,AAAA";
        let e = parse(json!({"type": "video", "video": [frame], "nframes": 4})).unwrap_err();
        assert!(e.to_string().contains("content[0].nframes"), "{e}");
        assert!(
            parse(json!({"type": "video", "video": [frame], "fps": 2, "nframes": null})).is_ok()
        );
        let e = parse(json!({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA", "detail": "low"}}))
            .unwrap_err();
        assert!(e.to_string().contains("video_url.detail"), "{e}");
    }
}
