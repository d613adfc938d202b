//! Video geometry of the Qwen3-VL video processor: which frames are sampled, the size every
//! frame is resized to, the grid of each temporal group, its timestamp and its token count.
//!
//! Matches transformers' `models/qwen3_vl/video_processing_qwen3_vl.py`
//! (`Qwen3VLVideoProcessor.sample_frames`, `.resize` with `cap_pixels_per_frame`, the module's
//! `smart_resize`) and `processing_qwen3_vl.py` (`_calculate_timestamps`,
//! `replace_video_token`). Pure arithmetic: the gateway plans a video from its container
//! header before any frame is decoded.
use crate::geometry::{MAX_ASPECT_RATIO, MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE};

/// The reference's fps when a video's own fps is unknown (pre-sampled frames without one).
pub const FALLBACK_SOURCE_FPS: f64 = 24.0;

/// `video_preprocessor_config.json` of Qwen3-VL, with the processor's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoProcessorConfig {
    /// `size.shortest_edge`: the pixel floor of all sampled frames together.
    pub min_pixels: u64,
    /// `size.longest_edge`: the pixel budget of all sampled frames together.
    pub max_pixels: u64,
    /// Frames sampled per second of video when the request names neither fps nor num_frames.
    pub fps: f64,
    pub min_frames: u32,
    pub max_frames: u32,
    /// qwen-vl-utils' per-frame cap (transformers' default from v5.22): a frame costs at most
    /// `max_video_tokens` tokens and at most `max_pixels / frames` pixels.
    pub cap_pixels_per_frame: bool,
    pub max_video_tokens: u64,
}

impl Default for VideoProcessorConfig {
    fn default() -> Self {
        VideoProcessorConfig {
            min_pixels: 4096,
            max_pixels: 25_165_824,
            fps: 2.0,
            min_frames: 4,
            max_frames: 768,
            cap_pixels_per_frame: true,
            max_video_tokens: 768,
        }
    }
}

impl VideoProcessorConfig {
    /// The checkpoint's `video_preprocessor_config.json` values over the defaults (keys it
    /// does not set keep theirs). `text` is the file's JSON.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let mut c = VideoProcessorConfig::default();
        let num = |path: &[&str]| path.iter().try_fold(&v, |j, k| j.get(*k));
        if let Some(n) = num(&["size", "shortest_edge"]).and_then(|x| x.as_u64()) {
            c.min_pixels = n;
        }
        if let Some(n) = num(&["size", "longest_edge"]).and_then(|x| x.as_u64()) {
            c.max_pixels = n;
        }
        if let Some(n) = num(&["fps"]).and_then(|x| x.as_f64()) {
            c.fps = n;
        }
        if let Some(n) = num(&["min_frames"]).and_then(|x| x.as_u64()) {
            c.min_frames = n as u32;
        }
        if let Some(n) = num(&["max_frames"]).and_then(|x| x.as_u64()) {
            c.max_frames = n.min(u32::MAX as u64) as u32;
        }
        if let Some(b) = num(&["cap_pixels_per_frame"]).and_then(|x| x.as_bool()) {
            c.cap_pixels_per_frame = b;
        }
        if let Some(n) = num(&["max_video_tokens"]).and_then(|x| x.as_u64()) {
            c.max_video_tokens = n;
        }
        for (key, want) in [
            ("patch_size", PATCH_SIZE),
            ("merge_size", MERGE_SIZE),
            ("temporal_patch_size", TEMPORAL_PATCH_SIZE),
        ] {
            if let Some(got) = num(&[key]).and_then(|x| x.as_u64()) {
                if got != want as u64 {
                    return Err(format!("{key} is {got}; Qwen3-VL's is {want}"));
                }
            }
        }
        if !(c.fps > 0.0 && c.fps.is_finite()) || c.min_frames == 0 || c.max_frames < c.min_frames {
            return Err(format!(
                "fps {} must be positive and 1 <= min_frames {} <= max_frames {}",
                c.fps, c.min_frames, c.max_frames
            ));
        }
        Ok(c)
    }
}

/// How a request asks for frames (`fps` and `num_frames` are exclusive, as in the reference).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Sampling {
    /// The config's fps.
    #[default]
    Default,
    Fps(f64),
    NumFrames(u32),
}

/// Why a video cannot be planned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum VideoGeometryError {
    #[error("the video has no frames")]
    NoFrames,
    #[error("video frames are {width}x{height}: a zero side")]
    Empty { width: u32, height: u32 },
    #[error(
        "video frames are {width}x{height}: aspect ratio {ratio:.1}, over the limit of {MAX_ASPECT_RATIO}"
    )]
    AspectRatio { width: u32, height: u32, ratio: f64 },
    #[error("{frames} frame(s) sampled; the processor needs at least {TEMPORAL_PATCH_SIZE} (one temporal patch)")]
    TooFewFrames { frames: u32 },
    #[error("fps {0} must be a positive number")]
    BadFps(f64),
}

/// `Qwen3VLVideoProcessor.sample_frames`: `num_frames = int(total / source_fps * fps)` clamped
/// to `[min_frames, min(max_frames, total)]` (fps sampling), or the requested count; indices
/// `linspace(0, total - 1, n).round()` (ties to even, as numpy).
pub fn sample_indices(
    total: u32,
    source_fps: Option<f64>,
    sampling: Sampling,
    cfg: &VideoProcessorConfig,
) -> Result<Vec<u32>, VideoGeometryError> {
    if total == 0 {
        return Err(VideoGeometryError::NoFrames);
    }
    let n = match sampling {
        Sampling::NumFrames(n) => n,
        Sampling::Default | Sampling::Fps(_) => {
            let fps = match sampling {
                Sampling::Fps(f) => f,
                _ => cfg.fps,
            };
            if !(fps > 0.0 && fps.is_finite()) {
                return Err(VideoGeometryError::BadFps(fps));
            }
            let src = source_fps
                .filter(|f| *f > 0.0 && f.is_finite())
                .unwrap_or(FALLBACK_SOURCE_FPS);
            let n = (total as f64 / src * fps) as u64;
            n.max(cfg.min_frames as u64)
                .min(cfg.max_frames as u64)
                .min(total as u64) as u32
        }
    };
    if n == 0 {
        return Err(VideoGeometryError::NoFrames);
    }
    Ok(linspace_rounded(total - 1, n))
}

/// `np.linspace(0, stop, n).round().astype(int)`: numpy computes `i * step` and sets the last
/// value to `stop` exactly.
fn linspace_rounded(stop: u32, n: u32) -> Vec<u32> {
    if n == 1 {
        return vec![0];
    }
    let step = stop as f64 / (n - 1) as f64;
    (0..n)
        .map(|i| {
            if i == n - 1 {
                stop
            } else {
                (i as f64 * step).round_ties_even() as u32
            }
        })
        .collect()
}

/// The pixel budget of `frames` sampled frames: `size.longest_edge`, or with the per-frame
/// cap `max(min(max_video_tokens * factor^2, longest_edge // frames), int(shortest_edge *
/// 1.05)) * frames` (`Qwen3VLVideoProcessor.resize`).
pub fn budget_pixels(cfg: &VideoProcessorConfig, frames: u32) -> u64 {
    if !cfg.cap_pixels_per_frame || frames == 0 {
        return cfg.max_pixels;
    }
    let factor = (PATCH_SIZE * MERGE_SIZE) as u64;
    let frame_cap = cfg.max_video_tokens * factor * factor;
    let per_frame = frame_cap
        .min(cfg.max_pixels / frames as u64)
        .max((cfg.min_pixels as f64 * 1.05) as u64);
    per_frame.saturating_mul(frames as u64)
}

/// The video `smart_resize(num_frames, height, width, temporal_factor, factor, min_pixels,
/// max_pixels)`: sides under `factor` scaled up first, the budget counting all frames.
/// Returns (height, width).
pub fn smart_resize_video(
    frames: u32,
    height: u32,
    width: u32,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(u32, u32), VideoGeometryError> {
    let (t, f) = (TEMPORAL_PATCH_SIZE, (PATCH_SIZE * MERGE_SIZE) as f64);
    if frames < t {
        return Err(VideoGeometryError::TooFewFrames { frames });
    }
    if height == 0 || width == 0 {
        return Err(VideoGeometryError::Empty { width, height });
    }
    let (mut h, mut w) = (height as f64, width as f64);
    if h < f || w < f {
        let scale = (f / h).max(f / w);
        h = (h * scale).trunc();
        w = (w * scale).trunc();
    }
    let ratio = h.max(w) / h.min(w);
    if ratio > MAX_ASPECT_RATIO {
        return Err(VideoGeometryError::AspectRatio {
            width,
            height,
            ratio,
        });
    }
    let n = frames as f64;
    let mut hb = (h / f).round_ties_even() * f;
    let mut wb = (w / f).round_ties_even() * f;
    let tb = (n / t as f64).round_ties_even() * t as f64;
    if tb * hb * wb > max_pixels as f64 {
        let beta = (n * h * w / max_pixels as f64).sqrt();
        hb = f.max((h / beta / f).floor() * f);
        wb = f.max((w / beta / f).floor() * f);
    } else if tb * hb * wb < min_pixels as f64 {
        let beta = (min_pixels as f64 / (n * h * w)).sqrt();
        hb = (h * beta / f).ceil() * f;
        wb = (w * beta / f).ceil() * f;
    }
    Ok((hb as u32, wb as u32))
}

/// `_calculate_timestamps`: indices padded to a multiple of the temporal patch by repeating the
/// last, each `index / source_fps`, then the mean of each temporal group's first and last.
pub fn group_timestamps(indices: &[u32], source_fps: f64) -> Vec<f64> {
    let t = TEMPORAL_PATCH_SIZE as usize;
    let mut idx = indices.to_vec();
    if let Some(&last) = idx.last() {
        while !idx.len().is_multiple_of(t) {
            idx.push(last);
        }
    }
    idx.chunks(t)
        .map(|g| (g[0] as f64 / source_fps + g[t - 1] as f64 / source_fps) / 2.0)
        .collect()
}

/// A video planned from its header: which frames, at what size, and what the prompt holds.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoGeometry {
    /// Source frame size.
    pub width: u32,
    pub height: u32,
    /// Source frame indices sampled, in order (repeats possible).
    pub indices: Vec<u32>,
    /// The fps the timestamps were computed with (the source's, or the fallback 24).
    pub source_fps: f64,
    /// Every sampled frame's size after the resize.
    pub resized_width: u32,
    pub resized_height: u32,
    /// One per temporal group (two sampled frames, the last repeated when odd).
    pub timestamps: Vec<f64>,
}

impl VideoGeometry {
    /// Plans a video of `total` frames of `width`x`height` at `source_fps`.
    pub fn plan(
        width: u32,
        height: u32,
        total: u32,
        source_fps: Option<f64>,
        sampling: Sampling,
        cfg: &VideoProcessorConfig,
    ) -> Result<Self, VideoGeometryError> {
        let indices = sample_indices(total, source_fps, sampling, cfg)?;
        let n = indices.len() as u32;
        let (rh, rw) = smart_resize_video(n, height, width, cfg.min_pixels, budget_pixels(cfg, n))?;
        let src = source_fps
            .filter(|f| *f > 0.0 && f.is_finite())
            .unwrap_or(FALLBACK_SOURCE_FPS);
        let timestamps = group_timestamps(&indices, src);
        Ok(VideoGeometry {
            width,
            height,
            indices,
            source_fps: src,
            resized_width: rw,
            resized_height: rh,
            timestamps,
        })
    }

    /// Temporal groups: the ViT inputs, each laid out in the prompt like one image.
    pub fn groups(&self) -> usize {
        self.timestamps.len()
    }
    /// The grid of one temporal group in raw patches, `[1, h, w]` (get_rope_index splits a
    /// video's `[t, h, w]` into t of these).
    pub fn group_grid(&self) -> [u32; 3] {
        [
            1,
            self.resized_height / PATCH_SIZE,
            self.resized_width / PATCH_SIZE,
        ]
    }
    /// Raw patches of one group (the ViT bucket unit).
    pub fn group_patches(&self) -> u64 {
        let g = self.group_grid();
        g[1] as u64 * g[2] as u64
    }
    /// `<|video_pad|>` tokens of one group.
    pub fn group_tokens(&self) -> u64 {
        self.group_patches() / (MERGE_SIZE * MERGE_SIZE) as u64
    }
    /// `<|video_pad|>` tokens of the whole video.
    pub fn tokens(&self) -> u64 {
        self.group_tokens() * self.groups() as u64
    }
    /// Pixels of all sampled frames after the resize.
    pub fn pixels(&self) -> u64 {
        self.indices.len() as u64 * self.resized_width as u64 * self.resized_height as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fps_sampling_is_clamped_and_rounded_like_numpy() {
        let c = VideoProcessorConfig::default();
        // 30 frames at 10 fps, 2 fps wanted -> int(30/10*2) = 6 frames over [0, 29].
        let i = sample_indices(30, Some(10.0), Sampling::Default, &c).unwrap();
        assert_eq!(i, [0, 6, 12, 17, 23, 29]);
        // A short clip: at least min_frames (4), at most the frames it has.
        assert_eq!(
            sample_indices(10, Some(30.0), Sampling::Default, &c)
                .unwrap()
                .len(),
            4
        );
        assert_eq!(
            sample_indices(3, Some(30.0), Sampling::Default, &c).unwrap(),
            [0, 1, 2]
        );
        // num_frames is taken as is, even above the frames the video has (indices repeat).
        assert_eq!(
            sample_indices(3, None, Sampling::NumFrames(5), &c).unwrap(),
            [0, 0, 1, 2, 2]
        );
        // No source fps: the reference assumes 24.
        assert_eq!(
            sample_indices(48, None, Sampling::Fps(1.0), &c)
                .unwrap()
                .len(),
            4
        );
    }

    #[test]
    fn timestamps_average_each_pair_and_pad_an_odd_count() {
        let t = group_timestamps(&[0, 3, 6, 9, 11], 24.0);
        assert_eq!(t.len(), 3);
        assert!((t[0] - 1.5 / 24.0).abs() < 1e-12);
        assert!((t[2] - 11.0 / 24.0).abs() < 1e-12);
    }

    #[test]
    fn the_budget_covers_all_frames() {
        let c = VideoProcessorConfig {
            cap_pixels_per_frame: false,
            ..Default::default()
        };
        // 8 frames of 1920x1080 uncapped: 8*1088*1920 > 25165824 -> scaled down.
        let (h, w) = smart_resize_video(8, 1080, 1920, c.min_pixels, c.max_pixels).unwrap();
        assert!(8 * h as u64 * w as u64 <= c.max_pixels, "{h}x{w}");
        assert_eq!((h % 32, w % 32), (0, 0));
        // Capped: at most 768 tokens a frame.
        let capped = VideoProcessorConfig::default();
        let g = VideoGeometry::plan(1920, 1080, 8, Some(8.0), Sampling::Default, &capped).unwrap();
        assert!(g.group_tokens() <= 768, "{g:?}");
        assert_eq!(g.groups(), 2);
        // A 1-frame video cannot fill a temporal patch (the reference raises).
        let err = VideoGeometry::plan(64, 64, 1, Some(8.0), Sampling::Default, &capped);
        assert!(matches!(
            err,
            Err(VideoGeometryError::TooFewFrames { frames: 1 })
        ));
    }

    #[test]
    fn tiny_frames_are_scaled_up_to_a_patch_first() {
        let (h, w) = smart_resize_video(4, 20, 40, 4096, 25_165_824).unwrap();
        assert_eq!((h % 32, w % 32), (0, 0));
        assert!(h >= 32 && w >= 32);
    }
}
