//! Why a video cannot be read. Always about the caller's bytes or limits: services answer it
//! as INVALID_ARGUMENT / 400.
use crate::error::PreprocessError;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VideoError {
    #[error("video data is empty")]
    Empty,
    #[error(
        "unrecognised video format: the bytes are not a container FFmpeg knows; {}",
        SUPPORTED_CONTAINERS
    )]
    UnknownContainer,
    #[error("unsupported video container '{name}'; {}", SUPPORTED_CONTAINERS)]
    UnsupportedContainer { name: String },
    #[error("the {container} file has no video stream")]
    NoVideoStream { container: String },
    #[error("unsupported video codec '{name}'; {}", SUPPORTED_CODECS)]
    UnsupportedCodec { name: String },
    #[error("no decoder for the video codec '{name}' in this FFmpeg build")]
    NoDecoder { name: String },
    #[error(
        "video is {width}x{height} = {pixels} pixels a frame, over the decode limit of {limit} pixels"
    )]
    TooManyPixels {
        width: u32,
        height: u32,
        pixels: u64,
        limit: u64,
    },
    #[error("frame index {index} is beyond the video's {frames} frames")]
    IndexBeyond { index: u32, frames: u32 },
    #[error("decoding stopped: {what}, over the limit of {limit}")]
    DecodeBudget { what: &'static str, limit: String },
    /// Corrupt or truncated data, with FFmpeg's reason.
    #[error("corrupt or truncated video: {0}")]
    Corrupt(String),
}

pub(crate) const SUPPORTED_CONTAINERS: &str =
    "supported containers: MP4/MOV (incl. fragmented), Matroska/WebM, AVI";
pub(crate) const SUPPORTED_CODECS: &str =
    "supported codecs: H.264, HEVC/H.265, VP8, VP9, AV1, MPEG-4 Part 2";

impl VideoError {
    pub(crate) fn corrupt(what: impl std::fmt::Display, e: impl std::fmt::Display) -> Self {
        let e = e.to_string();
        // FFmpeg's ENOMEM here is its allocation bound (`MAX_FFMPEG_ALLOC`) refusing what a
        // header declared, not the machine running out.
        if e == "Cannot allocate memory" {
            return VideoError::Corrupt(format!(
                "{what}: it declares more than FFmpeg may allocate at once ({} MiB)",
                super::MAX_FFMPEG_ALLOC >> 20
            ));
        }
        VideoError::Corrupt(format!("{what}: {e}"))
    }
}

impl From<VideoError> for PreprocessError {
    fn from(e: VideoError) -> Self {
        PreprocessError::invalid(e.to_string())
    }
}
