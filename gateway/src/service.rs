//! The tonic `vlm.v1.Gateway` service: an adapter that decodes the proto, calls
//! [`Core::start`], and maps deltas and errors back.
use crate::error::GatewayError;
use crate::generate::{Core, Delta, Tally};
use crate::logprobs::ShownLogprob;
use crate::validation::{ChatRequest, InputMessage, InputPart, InputSampling};
use futures::Stream;
use prost::Message;
use std::pin::Pin;
use tonic::{Request, Response, Status};
use vlm_proto::v1 as pb;
use vlm_service_kit::generation::Finish;

pub struct GatewayService {
    core: Core,
}

impl GatewayService {
    pub fn new(core: Core) -> Self {
        GatewayService { core }
    }
}

/// A `VideoPart` in domain terms: exactly one of `data` / `frames`, fps and num_frames
/// exclusive.
fn video_input(v: pb::VideoPart, param: &str) -> Result<crate::video::VideoInput, GatewayError> {
    use crate::video::VideoSource;
    use vlm_config::video::Sampling;
    let source = match (v.data.is_empty(), v.frames.is_empty()) {
        (false, true) => VideoSource::File(v.data.into()),
        (true, false) => VideoSource::Frames(v.frames.into_iter().map(Into::into).collect()),
        (false, false) => {
            return Err(GatewayError::validation(format!(
                "{param}: set data (a video file) or frames, not both"
            )))
        }
        (true, true) => {
            return Err(GatewayError::validation(format!(
                "{param}: set data (a video file) or frames (image files)"
            )))
        }
    };
    if !crate::video::video_file_mime(&v.mime_type) {
        return Err(GatewayError::validation(format!(
            "{param}.mime_type {:?}: a video file's type is one of {} (the bytes decide the \
             container)",
            v.mime_type,
            crate::video::VIDEO_FILE_MIME.join(", ")
        )));
    }
    let positive = |x: f64, what: &str| {
        if x.is_finite() && x >= 0.0 {
            Ok(x)
        } else {
            Err(GatewayError::param(
                &format!("{param}.{what}"),
                format!("{param}.{what} is {x}; it must be a positive number or 0 (unset)"),
            ))
        }
    };
    let fps = positive(v.fps, "fps")?;
    let frames_fps = positive(v.frames_fps, "frames_fps")?;
    let sampling = match (fps > 0.0, v.num_frames > 0) {
        (true, true) => {
            return Err(GatewayError::param(
                &format!("{param}.fps"),
                format!("{param}.fps and {param}.num_frames are exclusive; set one"),
            ))
        }
        (true, false) => Sampling::Fps(fps),
        (false, true) => Sampling::NumFrames(v.num_frames),
        (false, false) => Sampling::Default,
    };
    Ok(crate::video::VideoInput {
        source,
        frames_fps: (frames_fps > 0.0).then_some(frames_fps),
        sampling,
        max_pixels: (v.max_pixels > 0).then_some(v.max_pixels),
    })
}

/// Proto -> domain request; a content part with neither text nor image set is refused (it
/// is a client bug, not an empty string).
pub fn chat_request(req: pb::GenerateRequest) -> Result<ChatRequest, GatewayError> {
    let body_bytes = req.encoded_len();
    let mut messages = Vec::with_capacity(req.messages.len());
    for (mi, m) in req.messages.into_iter().enumerate() {
        let mut content = Vec::with_capacity(m.content.len());
        for (pi, p) in m.content.into_iter().enumerate() {
            content.push(match p.part {
                Some(pb::content_part::Part::Text(t)) => InputPart::Text(t),
                Some(pb::content_part::Part::Image(i)) => InputPart::Image {
                    data: i.data.into(),
                    mime_type: i.mime_type,
                    budget: vlm_config::PixelBudget {
                        min_pixels: (i.min_pixels > 0).then_some(i.min_pixels),
                        max_pixels: (i.max_pixels > 0).then_some(i.max_pixels),
                    },
                },
                Some(pb::content_part::Part::Video(v)) => InputPart::Video(video_input(
                    v,
                    &format!("messages[{mi}].content[{pi}].video"),
                )?),
                None => {
                    return Err(GatewayError::validation(format!(
                        "messages[{mi}].content[{pi}] sets neither text, image nor video"
                    )))
                }
            });
        }
        messages.push(InputMessage {
            role: m.role,
            content,
            tool_calls: Vec::new(),
        });
    }
    Ok(ChatRequest {
        messages,
        sampling: InputSampling::from_wire(req.sampling.unwrap_or_default()),
        tools: Vec::new(),
        prompt: None,
        model: req.model,
        body_bytes,
    })
}

fn response(request_id: &str, d: Delta) -> pb::GenerateResponse {
    pb::GenerateResponse {
        request_id: request_id.to_string(),
        text: d.text,
        token_ids: d.token_ids,
        finish_reason: Finish::to_wire(d.finish),
        usage: Some(d.usage.into()),
        logprobs: d.logprobs.iter().map(ShownLogprob::to_wire).collect(),
        index: d.index,
    }
}

#[tonic::async_trait]
impl pb::gateway_server::Gateway for GatewayService {
    type GenerateStream =
        Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send + 'static>>;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let span = tracing::info_span!("Gateway/Generate");
        vlm_service_kit::telemetry::extract(request.metadata(), &span);
        let tally = Tally::start();
        // A large request (images, a long prompt): the heap it freed goes back to the system
        // once it is refused or its stream ends, as after a large HTTP body.
        let trim = vlm_service_kit::memory::TrimOnDrop::for_bytes(prost::Message::encoded_len(
            request.get_ref(),
        ) as u64);
        let chat = match chat_request(request.into_inner()) {
            Ok(c) => c,
            Err(e) => return Err(tally.refuse(e).into()),
        };
        let gen = self.core.start(chat, span, tally).await?;
        let id = gen.request_id;
        let mut rx = gen.rx;
        let out = async_stream::stream! {
            let _trim = trim;
            while let Some(item) = rx.recv().await {
                yield item.map(|d| response(&id, d)).map_err(Status::from);
            }
        };
        Ok(Response::new(Box::pin(out)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vlm_service_kit::generation::Usage;

    #[test]
    fn responses_carry_the_usage_with_cached_tokens() {
        let d = Delta {
            text: "ok".into(),
            index: 0,
            token_ids: vec![3, 4],
            logprobs: Vec::new(),
            end: true,
            finish: Some(Finish::Length),
            usage: Usage {
                prompt_tokens: 70,
                image_tokens: 16,
                completion_tokens: 2,
                cached_tokens: 64,
                video_tokens: 0,
            },
        };
        let r = response("req-1", d);
        assert_eq!(r.request_id, "req-1");
        assert_eq!(r.finish_reason, pb::FinishReason::Length as i32);
        assert_eq!(
            r.usage,
            Some(pb::Usage {
                prompt_tokens: 70,
                image_tokens: 16,
                completion_tokens: 2,
                cached_tokens: 64,
                video_tokens: 0,
            })
        );
    }
}
