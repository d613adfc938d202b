//! Videos: planned from their header before admission (frames sampled, resize, groups,
//! tokens, bucket: `vlm_config::video`), decoded after it (only the sampled frames), resized
//! like the reference processor and paired into the temporal groups the ViT encodes one at a
//! time.
//!
//! The gateway decodes (not the vision service) because the prompt needs the frame count and
//! timestamps anyway, as vLLM's and SGLang's front ends do; each temporal group then travels
//! as two resized frames (`ResizedPixels.second_frame`), so the vision service's buckets, queue
//! and streaming and the LM's embedding cache treat it as one image-sized unit.
use crate::error::GatewayError;
use bytes::Bytes;
use sha2::{Digest, Sha256};
use vlm_config::video::{Sampling, VideoGeometry, VideoProcessorConfig};
use vlm_config::VisualConfig;
use vlm_preprocess::worker::{MediaDecoding, WorkerError};
pub use vlm_preprocess::RgbImage;

/// MIME types a video file may come with. The decoder identifies the container by its bytes;
/// this only refuses a type that names something else (an image, audio, text).
pub const VIDEO_FILE_MIME: &[&str] = &[
    "video/mp4",
    "video/quicktime",
    "video/x-m4v",
    "video/webm",
    "video/x-matroska",
    "video/avi",
    "video/x-msvideo",
    "application/octet-stream",
];

/// Whether `mime` (any case, parameters after ';' ignored) is one a video file may come with;
/// an empty type is accepted too.
pub fn video_file_mime(mime: &str) -> bool {
    let m = mime.split(';').next().unwrap_or("").trim();
    m.is_empty() || VIDEO_FILE_MIME.iter().any(|t| t.eq_ignore_ascii_case(m))
}

/// One temporal group: its two resized frames (the odd last frame twice).
pub type Group = (RgbImage, RgbImage);

/// Where a video's frames come from.
#[derive(Debug, Clone, PartialEq)]
pub enum VideoSource {
    /// A video file: MP4/MOV, Matroska/WebM or AVI, told apart by its bytes (FFmpeg's probe).
    File(Bytes),
    /// Image files (PNG, JPEG), all the same size, in order.
    Frames(Vec<Bytes>),
}

/// A video part as the edges decode it.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoInput {
    pub source: VideoSource,
    /// The rate `Frames` were taken at; a file's comes from its header.
    pub frames_fps: Option<f64>,
    /// `Default`: the processor's fps for a file, every frame for `Frames`.
    pub sampling: Sampling,
    /// The request's pixel budget for all sampled frames; bounded by the server's.
    pub max_pixels: Option<u64>,
}

/// The server's ceilings on videos, enforced before any frame is decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoLimits {
    /// Videos per request (`--max-videos`); 0 refuses videos.
    pub max_videos: usize,
    /// Frames sampled from one video (`--max-video-frames`), whatever fps or num_frames asks.
    pub max_frames: u32,
    /// Frames of a video file decoded to reach the sampled ones (`--max-video-source-frames`): the
    /// decode work one video may cost.
    pub max_source_frames: u32,
    /// Pixels of all sampled frames of one video after the resize: the processor's budget,
    /// also the ceiling of a request's `max_pixels`.
    pub max_pixels: u64,
    /// Width * height of one source frame.
    pub max_frame_pixels: u64,
    /// Decoder threads of one video (`--video-decode-threads`).
    pub decode_threads: usize,
    /// Where FFmpeg parses video files and AVIF images (`--media-decoding`).
    pub decoding: MediaDecoding,
}

/// The ceilings' defaults (the gateway's flags use them too).
pub const DEFAULT_MAX_VIDEOS: usize = 2;
pub const DEFAULT_MAX_VIDEO_FRAMES: u32 = 128;
/// 10 minutes at 30 fps.
pub const DEFAULT_MAX_VIDEO_SOURCE_FRAMES: u32 = 18_000;
/// Two: a 1080p minute sampled at 2 fps decoded in 3.7 s instead of 7.7-9.7 on two Zen 5 cores
/// (`scripts/bench-video-loader.py`; vLLM's OpenCV loader threads too), while several
/// requests' decodes at once still share the cores.
pub const DEFAULT_VIDEO_DECODE_THREADS: usize = 2;

impl VideoLimits {
    pub fn from_processor(cfg: &VideoProcessorConfig) -> Self {
        VideoLimits {
            max_videos: DEFAULT_MAX_VIDEOS,
            max_frames: DEFAULT_MAX_VIDEO_FRAMES,
            max_source_frames: DEFAULT_MAX_VIDEO_SOURCE_FRAMES,
            max_pixels: cfg.max_pixels,
            max_frame_pixels: 4096 * 4096,
            decode_threads: DEFAULT_VIDEO_DECODE_THREADS,
            decoding: MediaDecoding::InProcess,
        }
    }
}

/// A video that passed every header check: what the prompt holds and what to decode.
#[derive(Debug, Clone)]
pub struct ValidVideo {
    pub source: VideoSource,
    pub geometry: VideoGeometry,
    /// SHA-256 of the bytes and the sampling plan (the embedding-cache identity of its groups).
    pub content_hash: [u8; 32],
    /// The ViT bucket each temporal group runs in.
    pub bucket: u32,
}

impl ValidVideo {
    pub fn tokens(&self) -> u32 {
        self.geometry.tokens() as u32
    }
    /// The cache key of temporal group `g`: the video's hash and the group index.
    pub fn group_hash(&self, g: usize) -> Vec<u8> {
        let mut h = Sha256::new();
        h.update(self.content_hash);
        h.update((g as u32).to_le_bytes());
        h.finalize().to_vec()
    }
}

fn refuse(index: usize, msg: impl std::fmt::Display) -> GatewayError {
    GatewayError::validation(format!("video {index}: {msg}"))
}

/// The file's fault (refused, crashed the decoder, over the time) is the caller's 400; a
/// worker that could not run is ours.
fn worker_error(index: usize, e: WorkerError) -> GatewayError {
    if let WorkerError::Crashed(how) = &e {
        tracing::warn!(video = index, how = %how, "the media worker died on a request's video");
    }
    match e {
        WorkerError::Worker(_) => GatewayError::Internal(format!("video {index}: {e}")),
        _ => refuse(index, e),
    }
}

fn strip(e: &vlm_preprocess::PreprocessError) -> String {
    let s = e.to_string();
    s.strip_prefix("invalid input: ").unwrap_or(&s).to_string()
}

/// Reads the header (a video file's, each frame file's image header), samples, plans the
/// resize and the bucket, and checks every ceiling. Nothing is decoded.
pub fn plan_video(
    index: usize,
    v: VideoInput,
    processor: &VideoProcessorConfig,
    visual: &VisualConfig,
    limits: &VideoLimits,
) -> Result<ValidVideo, GatewayError> {
    let (width, height, total, fps) = match &v.source {
        VideoSource::File(data) => {
            let info = vlm_preprocess::worker::probe(&limits.decoding, data)
                .map_err(|e| worker_error(index, e))?;
            if v.frames_fps.is_some() {
                return Err(refuse(
                    index,
                    "frames_fps is for videos given as frames; a video file's rate is read from the file",
                ));
            }
            (info.width, info.height, info.frames, info.fps)
        }
        VideoSource::Frames(frames) => {
            let Some(first) = frames.first() else {
                return Err(refuse(index, "the video has no frames"));
            };
            let size = |k: usize, f: &Bytes| {
                vlm_preprocess::worker::read_image_size(&limits.decoding, f)
                    .map_err(|e| refuse(index, format!("frame {k}: {}", strip(&e))))
            };
            let (w, h) = size(0, first)?;
            for (k, f) in frames.iter().enumerate().skip(1) {
                let s = size(k, f)?;
                if s != (w, h) {
                    return Err(refuse(
                        index,
                        format!(
                            "frame {k} is {}x{} but frame 0 is {w}x{h}; all frames of a video have one size",
                            s.0, s.1
                        ),
                    ));
                }
            }
            let total = u32::try_from(frames.len()).unwrap_or(u32::MAX);
            (w, h, total, v.frames_fps)
        }
    };
    let frame_pixels = width as u64 * height as u64;
    if frame_pixels > limits.max_frame_pixels {
        return Err(refuse(
            index,
            format!(
                "frames are {width}x{height} = {frame_pixels} pixels, over the limit of {} pixels per frame",
                limits.max_frame_pixels
            ),
        ));
    }
    let sampling = match (&v.source, v.sampling) {
        // Frames given as such are all used unless the request asks for sampling.
        (VideoSource::Frames(_), Sampling::Default) => {
            if total > limits.max_frames {
                return Err(refuse(
                    index,
                    format!(
                        "{total} frames given, over the limit of {} frames per video \
                         (--max-video-frames); ask for fps or num_frames to sample fewer",
                        limits.max_frames
                    ),
                ));
            }
            Sampling::NumFrames(total)
        }
        (_, s) => s,
    };
    if let Sampling::NumFrames(n) = sampling {
        if n > limits.max_frames {
            return Err(refuse(
                index,
                format!(
                    "num_frames {n} is over the limit of {} frames per video (--max-video-frames)",
                    limits.max_frames
                ),
            ));
        }
    }
    if let Some(mp) = v.max_pixels {
        if mp > limits.max_pixels {
            return Err(refuse(
                index,
                format!(
                    "max_pixels {mp} is over the server's limit of {} pixels per video",
                    limits.max_pixels
                ),
            ));
        }
    }
    // The server's frame ceiling bounds fps sampling too (the peers' fps/max_frames DoS).
    let cfg = VideoProcessorConfig {
        max_frames: processor.max_frames.min(limits.max_frames),
        max_pixels: v
            .max_pixels
            .unwrap_or(processor.max_pixels)
            .min(limits.max_pixels),
        ..processor.clone()
    };
    // fps sampling is clamped to the ceiling by `cfg.max_frames`; num_frames was checked.
    let geometry = VideoGeometry::plan(width, height, total, fps, sampling, &cfg)
        .map_err(|e| refuse(index, e))?;
    if matches!(v.source, VideoSource::File(_)) {
        let needed = geometry.indices.last().map_or(0, |i| i + 1);
        if needed > limits.max_source_frames {
            return Err(refuse(
                index,
                format!(
                    "reaching frame {} means decoding {needed} frames, over the limit of {} \
                     (--max-video-source-frames); ask for a shorter clip",
                    needed - 1,
                    limits.max_source_frames
                ),
            ));
        }
    }
    let patches = geometry.group_patches();
    let bucket = visual.bucket_for(patches).map_err(|_| {
        refuse(
            index,
            format!(
                "frames resize to {}x{} = {patches} patches per temporal group, over the largest \
                 ViT bucket of {} patches; lower max_pixels or num_frames",
                geometry.resized_width,
                geometry.resized_height,
                visual.largest_bucket()
            ),
        )
    })?;
    let content_hash = video_hash(&v.source, &geometry);
    Ok(ValidVideo {
        source: v.source,
        geometry,
        content_hash,
        bucket,
    })
}

/// SHA-256 of the video's bytes and of what was taken from them (indices, size, fps).
fn video_hash(source: &VideoSource, g: &VideoGeometry) -> [u8; 32] {
    let mut h = Sha256::new();
    match source {
        VideoSource::File(d) => {
            h.update(b"mp4");
            h.update(d);
        }
        VideoSource::Frames(fs) => {
            h.update(b"frames");
            for f in fs {
                h.update((f.len() as u64).to_le_bytes());
                h.update(f);
            }
        }
    }
    for i in &g.indices {
        h.update(i.to_le_bytes());
    }
    h.update(g.resized_width.to_le_bytes());
    h.update(g.resized_height.to_le_bytes());
    h.update(g.source_fps.to_le_bytes());
    h.finalize().into()
}

/// The sampled frames decoded and resized, paired into temporal groups (an odd last frame
/// repeated, as `Qwen3VLVideoProcessor.patchify` pads). Each frame is resized as soon as it
/// is decoded, so a request holds its source frames one at a time (a 1080p minute sampled at
/// 2 fps is 120 x 6 MB of RGB otherwise). CPU work: run it off the async threads.
pub fn decode_groups(
    index: usize,
    v: &ValidVideo,
    limits: &VideoLimits,
) -> Result<Vec<Group>, GatewayError> {
    let max_frame_pixels = limits.max_frame_pixels;
    let g = &v.geometry;
    let (rw, rh) = (g.resized_width, g.resized_height);
    let frames: Vec<RgbImage> = match &v.source {
        VideoSource::File(data) => {
            let decode = vlm_preprocess::DecodeLimits {
                threads: limits.decode_threads,
                ..vlm_preprocess::DecodeLimits::new(max_frame_pixels)
            };
            // It checks each frame against the header's size before resizing it.
            vlm_preprocess::worker::decode(&limits.decoding, data, &g.indices, &decode, (rw, rh))
                .map_err(|e| worker_error(index, e))?
                .frames
        }
        VideoSource::Frames(files) => {
            let mut out: Vec<RgbImage> = Vec::with_capacity(g.indices.len());
            for (k, &i) in g.indices.iter().enumerate() {
                // Repeated indices (num_frames above the frames given) decode once.
                if k > 0 && g.indices[k - 1] == i {
                    let prev = out[k - 1].clone();
                    out.push(prev);
                    continue;
                }
                let img = vlm_preprocess::worker::decode_image(
                    &limits.decoding,
                    &files[i as usize],
                    max_frame_pixels,
                )
                .map_err(|e| refuse(index, format!("frame {i}: {}", strip(&e))))?;
                if img.dimensions() != (g.width, g.height) {
                    return Err(refuse(
                        index,
                        format!(
                            "frame {i} decodes to {}x{}, its header says {}x{}",
                            img.width(),
                            img.height(),
                            g.width,
                            g.height
                        ),
                    ));
                }
                let img = vlm_preprocess::resize_bicubic(&img, rw, rh)
                    .map_err(|e| refuse(index, strip(&e)))?;
                out.push(img);
            }
            out
        }
    };
    if frames.len() != g.indices.len() {
        return Err(refuse(
            index,
            format!(
                "{} frames decoded, {} sampled",
                frames.len(),
                g.indices.len()
            ),
        ));
    }
    // Already at the resized size: this pairs them (Pillow's resize to the same size copies).
    vlm_preprocess::temporal_groups(&frames, rw, rh).map_err(|e| refuse(index, strip(&e)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32, shade: u8) -> Bytes {
        let img = RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, shade]));
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Png).unwrap();
        Bytes::from(out.into_inner())
    }

    fn visual() -> VisualConfig {
        vlm_config::DeployConfig::default_config().visual
    }

    fn frames(n: usize) -> VideoInput {
        VideoInput {
            source: VideoSource::Frames(
                (0..n)
                    .map(|k| png(96, 64, (k as u8).wrapping_mul(20)))
                    .collect(),
            ),
            frames_fps: Some(4.0),
            sampling: Sampling::NumFrames(n as u32),
            max_pixels: None,
        }
    }

    #[test]
    fn frames_plan_and_decode_into_groups() {
        let p = VideoProcessorConfig::default();
        let l = VideoLimits::from_processor(&p);
        let v = plan_video(0, frames(5), &p, &visual(), &l).unwrap();
        assert_eq!(v.geometry.groups(), 3);
        assert_eq!(v.geometry.indices, [0, 1, 2, 3, 4]);
        let groups = decode_groups(0, &v, &l).unwrap();
        assert_eq!(groups.len(), 3);
        // The odd last frame is repeated.
        assert_eq!(groups[2].0, groups[2].1);
        assert_ne!(groups[0].0, groups[0].1);
        assert_eq!(
            groups[0].0.dimensions(),
            (v.geometry.resized_width, v.geometry.resized_height)
        );
        assert_ne!(v.group_hash(0), v.group_hash(1));
    }

    #[test]
    fn ceilings_are_enforced_before_decoding() {
        let p = VideoProcessorConfig::default();
        let mut l = VideoLimits::from_processor(&p);
        l.max_frames = 4;
        let m = plan_video(0, frames(5), &p, &visual(), &l)
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("num_frames 5") && m.contains("limit of 4"),
            "{m}"
        );
        // Frames given without sampling options are all used: over the ceiling is refused.
        let mut f = frames(5);
        f.sampling = Sampling::Default;
        let m = plan_video(0, f, &p, &visual(), &l).unwrap_err().to_string();
        assert!(
            m.contains("5 frames given") && m.contains("limit of 4"),
            "{m}"
        );
        let mut f = frames(3);
        f.sampling = Sampling::Default;
        let v = plan_video(0, f, &p, &visual(), &l).unwrap();
        assert_eq!(v.geometry.indices, [0, 1, 2]);
        // fps sampling is capped by the same ceiling instead of refused.
        let mut f = frames(40);
        f.sampling = Sampling::Fps(4.0);
        let v = plan_video(0, f, &p, &visual(), &l).unwrap();
        assert_eq!(v.geometry.indices.len(), 4);
        // Frames of different sizes.
        let mut f = frames(3);
        if let VideoSource::Frames(fs) = &mut f.source {
            fs[1] = png(64, 64, 0);
        }
        let m = plan_video(0, f, &p, &visual(), &l).unwrap_err().to_string();
        assert!(m.contains("frame 1 is 64x64"), "{m}");
        // A request budget above the server's.
        let mut f = frames(3);
        f.max_pixels = Some(l.max_pixels + 1);
        let m = plan_video(0, f, &p, &visual(), &l).unwrap_err().to_string();
        assert!(m.contains("max_pixels"), "{m}");
        // One frame cannot fill a temporal patch.
        let m = plan_video(0, frames(1), &p, &visual(), &l)
            .unwrap_err()
            .to_string();
        assert!(m.contains("at least 2"), "{m}");
    }
}
