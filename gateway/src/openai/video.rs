//! Video parts of the OpenAI chat API: vLLM's `{"type": "video_url", "video_url": {"url":
//! "data:video/mp4;base64,..."}}` (any container the decoder reads: the MIME type is only a
//! hint, the bytes decide), vLLM's pre-sampled JPEG frames
//! `data:video/jpeg;base64,<frame>,<frame>,...` (its `encode_video_base64`), and pre-sampled
//! frames as qwen-vl-utils writes them,
//! `{"type": "video", "video": ["data:image/jpeg;base64,...", ...], "fps": 2}`; sampling options
//! from `mm_processor_kwargs` (`fps`, `num_frames`, as vLLM takes them).
use super::images::decode_data_url;
use crate::error::GatewayError;
use crate::video::{video_file_mime, VideoInput, VideoSource, VIDEO_FILE_MIME};
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
            "mm_processor_kwargs.fps and mm_processor_kwargs.num_frames are exclusive; give one",
        )),
        (Some(f), None) => Ok(Sampling::Fps(f)),
        (None, Some(n)) => Ok(Sampling::NumFrames(n)),
        (None, None) => Ok(Sampling::Default),
    }
}

/// A `video_url` part: a video file in a data: URL, or vLLM's `data:video/jpeg;base64,` with
/// comma-separated base64 JPEG frames.
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
    if let Some(frames) = jpeg_frames(url, param)? {
        return Ok(VideoInput {
            source: VideoSource::Frames(frames),
            frames_fps: None,
            sampling,
            max_pixels: None,
        });
    }
    let (mime, data) = decode_data_url(url, param, "data:video/mp4;base64,...")?;
    if !video_file_mime(&mime) {
        return Err(GatewayError::validation(format!(
            "{param}: unsupported video type {mime:?}; a video file ({}), \
             data:video/jpeg;base64,<frame>,<frame>,... or a list of frames as a \"video\" part",
            VIDEO_FILE_MIME.join(", ")
        )));
    }
    Ok(VideoInput {
        source: VideoSource::File(data),
        frames_fps: None,
        sampling,
        max_pixels: None,
    })
}

/// vLLM's `data:video/jpeg;base64,<frame>,<frame>,...`: each comma-separated part one base64
/// JPEG. `None` for another MIME type.
fn jpeg_frames(url: &str, param: &str) -> Result<Option<Vec<bytes::Bytes>>, GatewayError> {
    use base64::Engine;
    let rest = &url["data:".len()..];
    let Some((meta, data)) = rest.split_once(',') else {
        return Ok(None);
    };
    let mut parts = meta.split(';');
    if !parts
        .next()
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("video/jpeg"))
    {
        return Ok(None);
    }
    if !parts.any(|p| p == "base64") {
        return Err(GatewayError::validation(format!(
            "{param} data:video/jpeg URL must be base64 (data:video/jpeg;base64,<frame>,<frame>,...)"
        )));
    }
    data.split(',')
        .enumerate()
        .map(|(k, f)| {
            base64::engine::general_purpose::STANDARD
                .decode(f.trim())
                .map(Into::into)
                .map_err(|e| {
                    GatewayError::validation(format!(
                        "{param}: frame {k} of the data:video/jpeg URL is not valid base64: {e}"
                    ))
                })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
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

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;

    fn b64(b: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(b)
    }

    #[test]
    fn video_files_under_any_video_mime_type() {
        for mime in [
            "video/mp4",
            "video/quicktime",
            "video/x-m4v",
            "video/webm",
            "VIDEO/WEBM",
            "application/octet-stream",
            "",
        ] {
            let url = format!("data:{mime};base64,{}", b64(b"\0\0\0\x18ftypqt  "));
            let v = video_url_part(&url, Sampling::Default, "p").unwrap();
            assert!(matches!(v.source, VideoSource::File(_)), "{mime}");
        }
        let url = format!("data:image/png;base64,{}", b64(b"x"));
        let e = video_url_part(&url, Sampling::Default, "p").unwrap_err();
        assert!(
            e.to_string()
                .contains("unsupported video type \"image/png\""),
            "{e}"
        );
    }

    #[test]
    fn vllm_jpeg_frames_form() {
        let (a, b) = (b"\xff\xd8frame-a".as_slice(), b"\xff\xd8frame-b".as_slice());
        let url = format!("data:video/jpeg;base64,{},{}", b64(a), b64(b));
        let v = video_url_part(&url, Sampling::Default, "p").unwrap();
        let VideoSource::Frames(frames) = v.source else {
            panic!("not frames");
        };
        assert_eq!(frames, vec![a.to_vec(), b.to_vec()]);
        assert_eq!(v.frames_fps, None);
        let e =
            video_url_part("data:video/jpeg;base64,AAAA,%%%", Sampling::Default, "p").unwrap_err();
        assert!(
            e.to_string().contains("frame 1 of the data:video/jpeg URL"),
            "{e}"
        );
        let e = video_url_part("data:video/jpeg,AAAA", Sampling::Default, "p").unwrap_err();
        assert!(e.to_string().contains("must be base64"), "{e}");
    }
}
