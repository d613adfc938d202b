//! Video parts of the OpenAI chat API: vLLM's `{"type": "video_url", "video_url": {"url":
//! "data:video/mp4;base64,..."}}`, and pre-sampled frames as qwen-vl-utils writes them,
//! `{"type": "video", "video": ["data:image/jpeg;base64,...", ...], "fps": 2}`; sampling options
//! from `mm_processor_kwargs` (`fps`, `num_frames`, as vLLM takes them).
use crate::error::GatewayError;
use crate::video::{VideoInput, VideoSource};
use base64::Engine;
use bytes::Bytes;
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

/// The bytes of a base64 `data:` URL and its MIME type; `what` names the field in errors.
fn data_url(url: &str, what: &str, example: &str) -> Result<(String, Bytes), GatewayError> {
    let rest = url.strip_prefix("data:").ok_or_else(|| {
        GatewayError::validation(format!(
            "{what} must be a data: URL ({example}); remote videos are not fetched"
        ))
    })?;
    let (meta, data) = rest.split_once(',').ok_or_else(|| {
        GatewayError::validation(format!("{what} data: URL has no ',' before the data"))
    })?;
    if !meta.split(';').any(|p| p == "base64") {
        return Err(GatewayError::validation(format!(
            "{what} data: URL must be base64 ({example})"
        )));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| {
            GatewayError::validation(format!("{what} data: URL is not valid base64: {e}"))
        })?;
    let mime = meta.split(';').next().unwrap_or("").to_ascii_lowercase();
    Ok((mime, bytes.into()))
}

/// A `video_url` part: an MP4 in a data: URL.
pub fn video_url_part(
    url: &str,
    sampling: Sampling,
    param: &str,
) -> Result<VideoInput, GatewayError> {
    let (mime, data) = data_url(url, param, "data:video/mp4;base64,...")?;
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
        files.push(data_url(url, &what, "data:image/jpeg;base64,...")?.1);
    }
    if let Some(f) = fps.filter(|f| !(*f > 0.0 && f.is_finite())) {
        return Err(GatewayError::param(
            &format!("{param}.fps"),
            format!("{param}.fps is {f}; it must be a positive number of frames per second"),
        ));
    }
    // Frames given as such are all used unless the request asks for sampling.
    let sampling = match sampling {
        Sampling::Default => Sampling::NumFrames(files.len() as u32),
        s => s,
    };
    Ok(VideoInput {
        source: VideoSource::Frames(files),
        frames_fps: fps,
        sampling,
        max_pixels: None,
    })
}
