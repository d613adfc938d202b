//! Video parts of the OpenAI chat API: vLLM's `{"type": "video_url", "video_url": {"url":
//! "data:video/mp4;base64,..."}}`, and pre-sampled frames as qwen-vl-utils writes them,
//! `{"type": "video", "video": ["data:image/jpeg;base64,...", ...], "fps": 2}`; sampling options
//! from `mm_processor_kwargs` (`fps`, `num_frames`, as vLLM takes them).
use crate::error::GatewayError;
use crate::openai::decode_data_url;
use crate::video::{VideoInput, VideoSource};
use serde_json::{Map, Value};
use vlm_config::video::Sampling;

/// The video options of `mm_processor_kwargs`, taken out of `rest` (the map the caller checks
/// for unread keys).
pub fn take_video_kwargs(rest: &mut Map<String, Value>) -> Result<Sampling, GatewayError> {
    let num = |k: &str, v: Value| {
        v.as_f64()
            .filter(|f| *f > 0.0 && f.is_finite())
            .ok_or_else(|| {
                GatewayError::param(
                    &format!("mm_processor_kwargs.{k}"),
                    format!("mm_processor_kwargs.{k} must be a positive number"),
                )
            })
    };
    let fps = match rest.remove("fps") {
        None | Some(Value::Null) => None,
        Some(v) => Some(num("fps", v)?),
    };
    let frames = match rest.remove("num_frames") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let n = num("num_frames", v)?;
            if n.fract() != 0.0 || n > u32::MAX as f64 {
                return Err(GatewayError::param(
                    "mm_processor_kwargs.num_frames",
                    "mm_processor_kwargs.num_frames must be a whole number of frames",
                ));
            }
            Some(n as u32)
        }
    };
    match (fps, frames) {
        (Some(_), Some(_)) => Err(GatewayError::param(
            "mm_processor_kwargs.fps",
            "mm_processor_kwargs: fps and num_frames are exclusive; give one",
        )),
        (Some(f), None) => Ok(Sampling::Fps(f)),
        (None, Some(n)) => Ok(Sampling::NumFrames(n)),
        (None, None) => Ok(Sampling::Default),
    }
}

/// A `video_url` part: an MP4 in a data: URL.
pub fn video_url_part(
    url: &str,
    sampling: Sampling,
    param: &str,
) -> Result<VideoInput, GatewayError> {
    if !url.starts_with("data:") {
        return Err(GatewayError::validation(format!(
            "{param} must be a data: URL (data:video/mp4;base64,...); remote videos are not fetched"
        )));
    }
    let (mime, data) = decode_data_url(url, param, "data:video/mp4;base64,...")?;
    let mime = mime.to_ascii_lowercase();
    if !mime.is_empty() && mime != "video/mp4" {
        return Err(GatewayError::validation(format!(
            "{param}: unsupported video type {mime:?}; video/mp4 (H.264) is supported, or a \
             list of frames as a \"video\" part"
        )));
    }
    Ok(VideoInput {
        source: VideoSource::Mp4(data),
        frames_fps: None,
        sampling,
        max_pixels: None,
    })
}

/// A `video` part: a list of frame images (data: URLs), taken at `fps` frames per second.
pub fn frames_part(
    frames: &[Value],
    fps: Option<f64>,
    sampling: Sampling,
    param: &str,
) -> Result<VideoInput, GatewayError> {
    let mut files = Vec::with_capacity(frames.len());
    for (k, f) in frames.iter().enumerate() {
        let what = format!("{param}.video[{k}]");
        let url = f.as_str().ok_or_else(|| {
            GatewayError::validation(format!("{what} must be a data: URL string of an image"))
        })?;
        files.push(decode_data_url(url, &what, "data:image/jpeg;base64,...")?.1);
    }
    if let Some(f) = fps.filter(|f| !(*f > 0.0 && f.is_finite())) {
        return Err(GatewayError::param(
            &format!("{param}.fps"),
            format!("{param}.fps is {f}; it must be a positive number of frames per second"),
        ));
    }
    Ok(VideoInput {
        source: VideoSource::Frames(files),
        frames_fps: fps,
        sampling,
        max_pixels: None,
    })
}
