//! Video files -> RGB frames through FFmpeg's libraries (libavformat, libavcodec, libswscale,
//! by the `ffmpeg-next` binding), from bytes in memory.
//!
//! - [`read_video_info`] reads the header: frame size (as displayed, after rotation), frame
//!   count, duration, rate, codec. Nothing is decoded; for a container whose header has no
//!   frame count (Matroska/WebM, fragmented MP4) the packets are counted (demuxed, not
//!   decoded). It refuses what [`decode_video_frames`] would refuse from the header, so it can
//!   gate admission.
//! - [`decode_video_frames`] decodes the requested frames (presentation order), sequentially
//!   from the start and stopping at the last one needed; only the requested pictures are
//!   converted to RGB.
//!
//! **Untrusted bytes.** The container is identified by FFmpeg's probe of the bytes (a MIME
//! type is not consulted) and must be one of a few demuxers (MP4/MOV, Matroska/WebM, AVI); the
//! codec one of H.264, HEVC, VP8, VP9, AV1 and MPEG-4 Part 2. No URL or file is ever opened
//! (the I/O reads the buffer; no protocol is allowed for references). The frame size is
//! checked against the caller's limit before decoding and by libavcodec (`max_pixels`) for
//! every picture; demuxing and decoding stop after [`DecodeLimits::max_packets`] packets or
//! [`DecodeLimits::max_time`]. FFmpeg's log is silenced (errors come back as values).
//!
//! **Colour**: swscale, as PyAV's `to_ndarray(format="rgb24")` converts (the reference's
//! video loaders): the matrix and range the frame signals, BT.601 limited range when it
//! signals none. **Rotation**: the display matrix (phones' portrait clips) is applied to the
//! RGB frames by quarter turns, as the ffmpeg CLI's autorotate does.
mod avio;
mod error;
mod frames;
mod rgb;
mod stream;

pub use error::VideoError;

use image::RgbImage;
use std::sync::Once;
use std::time::{Duration, Instant};

/// What a video's header says about its video stream.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoInfo {
    /// The frame size as decoded frames come out: after the display rotation.
    pub width: u32,
    pub height: u32,
    /// Frames in the stream: the container's count, or its packets where it states none.
    pub frames: u32,
    /// The stream's average frame rate, else `frames / duration_s`; `None` when neither is
    /// known.
    pub fps: Option<f64>,
    /// FFmpeg's codec name and the profile, e.g. `h264 (High 10)`.
    pub codec: String,
    pub duration_s: f64,
    /// FFmpeg's demuxer, e.g. `matroska,webm`.
    pub container: String,
    /// Clockwise degrees the frames are turned by (the display matrix): 0, 90, 180 or 270.
    pub rotation: u32,
}

/// Bounds on the work one video may cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Width * height of a frame.
    pub max_frame_pixels: u64,
    /// Packets demuxed (all streams), counting and decoding alike.
    pub max_packets: u64,
    /// Wall time of one call.
    pub max_time: Duration,
    /// Decoder threads (FFmpeg's frame and slice threads); 0 lets FFmpeg take one per core.
    pub threads: usize,
}

impl DecodeLimits {
    pub fn new(max_frame_pixels: u64) -> Self {
        DecodeLimits {
            max_frame_pixels,
            max_packets: 1_000_000,
            max_time: Duration::from_secs(120),
            threads: 1,
        }
    }
}

/// The requested frames and their presentation times (seconds from the stream's start, from
/// the timestamps, not the index).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecodedVideo {
    pub frames: Vec<RgbImage>,
    pub times_s: Vec<f64>,
}

/// The packet and time budget of one call.
pub(crate) struct Budget {
    max_packets: u64,
    deadline: Instant,
    max_time: Duration,
}

impl Budget {
    fn new(l: &DecodeLimits) -> Self {
        Budget {
            max_packets: l.max_packets,
            deadline: Instant::now() + l.max_time,
            max_time: l.max_time,
        }
    }

    fn check(&self, packets: u64) -> Result<(), VideoError> {
        if packets > self.max_packets {
            return Err(VideoError::DecodeBudget {
                what: "too many packets",
                limit: format!("{} packets", self.max_packets),
            });
        }
        if Instant::now() > self.deadline {
            return Err(VideoError::DecodeBudget {
                what: "out of time",
                limit: format!("{:?}", self.max_time),
            });
        }
        Ok(())
    }
}

/// The largest single allocation FFmpeg may make: a 4096x4096 frame's planes are 25-50 MB.
pub const MAX_FFMPEG_ALLOC: usize = 256 << 20;

/// FFmpeg's global state, once: its log off (its messages would go to stderr; errors come
/// back as values here), its allocations bounded.
fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        let _ = ffmpeg_next::init();
        ffmpeg_next::util::log::set_level(ffmpeg_next::util::log::Level::Quiet);
        // No single allocation of FFmpeg's over MAX_FFMPEG_ALLOC. A 1 KB MP4 declaring 194
        // days of samples made the MOV demuxer index them: 4.3 GB and 13 s (cargo fuzz).
        // SAFETY: sets a global bound read by av_malloc; called once, before any FFmpeg use.
        unsafe { ffmpeg_next::ffi::av_max_alloc(MAX_FFMPEG_ALLOC) };
    });
}

fn open_selected<'a>(
    bytes: &'a [u8],
    budget: &Budget,
) -> Result<(avio::MemoryInput<'a>, stream::Selected), VideoError> {
    let mut input = avio::open(bytes)?;
    let sel = stream::select(&mut input, budget)?;
    if sel.counted {
        input = avio::open(bytes)?;
    }
    Ok((input, sel))
}

/// Header only (plus a demux-only packet count where the container states no frame count).
pub fn read_video_info(bytes: &[u8]) -> Result<VideoInfo, VideoError> {
    let budget = Budget::new(&DecodeLimits::new(u64::MAX));
    Ok(open_selected(bytes, &budget)?.1.info)
}

/// [`decode_video`] with the default packet and time bounds; the frames only.
pub fn decode_video_frames(
    bytes: &[u8],
    indices: &[u32],
    max_decode_pixels: u64,
) -> Result<Vec<RgbImage>, VideoError> {
    Ok(decode_video(bytes, indices, &DecodeLimits::new(max_decode_pixels))?.frames)
}

/// Decodes the frames at `indices` (presentation order, 0-based, any order, repeats allowed)
/// into RGB images, one per index in the order of `indices`. Refuses before decoding when
/// width*height is over the limit or an index is beyond the stream's frame count.
pub fn decode_video(
    bytes: &[u8],
    indices: &[u32],
    limits: &DecodeLimits,
) -> Result<DecodedVideo, VideoError> {
    let budget = Budget::new(limits);
    let (mut input, sel) = open_checked(bytes, indices, limits, &budget)?;
    frames::decode(&mut input, &sel, indices, limits, None, &budget)
}

/// [`decode_video`] with each frame resized to `size` (width, height; [`crate::resize_bicubic`],
/// the processor's resize) as soon as it is converted: the source-size frames are held one at
/// a time. Each is still checked against the header's size first.
pub fn decode_video_resized(
    bytes: &[u8],
    indices: &[u32],
    limits: &DecodeLimits,
    size: (u32, u32),
) -> Result<DecodedVideo, VideoError> {
    let budget = Budget::new(limits);
    let (mut input, sel) = open_checked(bytes, indices, limits, &budget)?;
    frames::decode(&mut input, &sel, indices, limits, Some(size), &budget)
}

/// Opens the stream and refuses from its header what decoding would refuse: a frame over the
/// pixel limit, an index beyond the stream's frames.
fn open_checked<'a>(
    bytes: &'a [u8],
    indices: &[u32],
    limits: &DecodeLimits,
    budget: &Budget,
) -> Result<(avio::MemoryInput<'a>, stream::Selected), VideoError> {
    let (input, sel) = open_selected(bytes, budget)?;
    let (w, h) = (sel.info.width, sel.info.height);
    let pixels = w as u64 * h as u64;
    if pixels > limits.max_frame_pixels {
        return Err(VideoError::TooManyPixels {
            width: w,
            height: h,
            pixels,
            limit: limits.max_frame_pixels,
        });
    }
    if let Some(&index) = indices.iter().max() {
        if index >= sel.info.frames {
            return Err(VideoError::IndexBeyond {
                index,
                frames: sel.info.frames,
            });
        }
    }
    Ok((input, sel))
}
