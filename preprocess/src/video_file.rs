//! MP4 (H.264) video files -> RGB frames, with no system ffmpeg: a small ISO-BMFF reader of
//! this crate's own (`video_file/bmff.rs`) and OpenH264's decoder, built from its bundled C++
//! source by the `openh264` crate.
//!
//! - [`read_mp4_info`] reads the header only (the `moov` box): frame size and count, frame
//!   rate, codec. No frame is decoded, and it refuses every file [`decode_mp4_frames`] would
//!   refuse from its header, so it can gate admission.
//! - [`decode_mp4_frames`] decodes the requested frames, in presentation order, sequentially
//!   from the first sample and stopping after the last one needed. One decoded picture at a
//!   time is converted; only the requested frames are kept.
//!
//! **Supported**: the first video track of a non-fragmented MP4/MOV whose samples are H.264
//! (`avc1`/`avc3` with parameter sets in `avcC`) in the Constrained Baseline, Baseline, Main or
//! High profile, 8-bit 4:2:0, progressive: what OpenH264 decodes. Everything else is refused
//! from the header with an error naming it (the codec, the profile, the chroma format, the bit
//! depth, interlacing), as are truncated and corrupt files; nothing here panics on bad input.
//!
//! **B-frames** are decoded and reordered: MP4 stores samples in decode order, and a frame's
//! presentation index is its rank by composition time (decode time + `ctts` offset). Each
//! access unit goes into the decoder tagged with its decode index, which comes back with the
//! picture it becomes, so frames are matched to samples exactly, whatever order (and delay)
//! OpenH264 outputs them in. Edit lists (`elst`) are not applied: every sample is a frame.
//!
//! **Colour**: YUV -> RGB follows ffmpeg's swscale, which the reference (transformers' video
//! loaders via PyAV/torchvision, `frame.to_ndarray(format="rgb24")`) converts with, bit for bit
//! as its x86-64 SIMD yuv420p -> rgb24 path computes it: the matrix and range the stream's VUI
//! signals (as PyAV passes the frame's colorspace and color_range to swscale), BT.601 limited
//! range (Y 16..235) when it signals none, which is also OpenH264's `write_rgb8` matrix; each
//! chroma sample used for its 2x2 block; 13-bit fixed-point coefficients and `pmulhw` floors.
//! Checked equal to PyAV 18.1 (FFmpeg 8) on x86-64 for libx264 Baseline, Main and High clips
//! with B-frames, and BT.601, BT.709, BT.2020, FCC, SMPTE 240M, limited and full range (the
//! tests keep three of them). Where PyAV's swscale takes another path (its C tables, or NEON on
//! aarch64) its frames differ from these by a level or two. `write_rgb8` itself is not used:
//! it truncates a float formula (up to 2 levels off swscale), knows only BT.601 limited, and is
//! only reachable from the crate's safe decode path, which cannot tell B-frames apart.
mod bmff;
mod codec;
mod h264;
mod mux;

use crate::error::{PreprocessError, Result};
use bmff::{fourcc, VideoTrack};
use h264::{AvcConfig, Sps};
use image::RgbImage;
use std::collections::HashMap;

/// What an MP4's header says about its video track.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoInfo {
    /// The displayed (cropped) frame size, from the H.264 SPS.
    pub width: u32,
    pub height: u32,
    /// Samples in the track: every one is a frame.
    pub frames: u32,
    /// `frames / duration_s`; `None` when the track's duration is 0.
    pub fps: Option<f64>,
    /// The sample entry and the stream, e.g. `avc1 (H.264 High profile, level 3.1)`.
    pub codec: String,
    /// The sum of the sample durations (`stts`) over the track's timescale (`mdhd`).
    pub duration_s: f64,
}

/// Whether the bytes look like an MP4/ISO-BMFF file (an `ftyp` box at the start).
pub fn is_mp4(bytes: &[u8]) -> bool {
    if bytes.len() < 8 || &bytes[4..8] != b"ftyp" {
        return false;
    }
    let size = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    size == 1 || size >= 8
}

/// The parsed header of an MP4 whose video track this module decodes.
struct Header<'a> {
    track: VideoTrack<'a>,
    avc: AvcConfig,
    sps: Sps,
    info: VideoInfo,
}

fn unsupported_codec(kind: &[u8; 4]) -> PreprocessError {
    let name = match kind {
        b"hvc1" | b"hev1" => "HEVC/H.265",
        b"dvh1" | b"dvhe" => "Dolby Vision (HEVC)",
        b"vp08" => "VP8",
        b"vp09" => "VP9",
        b"av01" => "AV1",
        b"mp4v" => "MPEG-4 Part 2",
        b"s263" | b"h263" => "H.263",
        b"avc2" | b"avc4" => "H.264 with aggregators/extractors (avc2/avc4)",
        b"encv" => "encrypted video",
        b"jpeg" | b"mjpa" | b"mjpb" => "Motion JPEG",
        b"apcn" | b"apch" | b"apcs" | b"apco" | b"ap4h" | b"ap4x" => "Apple ProRes",
        _ => "an unknown codec",
    };
    PreprocessError::invalid(format!(
        "unsupported codec {name} ('{}'); H.264 ('avc1') is supported",
        fourcc(kind)
    ))
}

fn header(bytes: &[u8]) -> Result<Header<'_>> {
    if bytes.is_empty() {
        return Err(PreprocessError::invalid("video data is empty"));
    }
    if !is_mp4(bytes) {
        return Err(PreprocessError::invalid(
            "unrecognised video format: the data is not an MP4 file (no 'ftyp' box at the start); \
             MP4 with H.264 is supported",
        ));
    }
    let track = bmff::video_track(bytes)?;
    let kind = track.entry.kind;
    if !matches!(&kind, b"avc1" | b"avc3") {
        return Err(unsupported_codec(&kind));
    }
    if track.sample_count == 0 {
        return Err(PreprocessError::invalid(
            "the video track has no frames (0 samples)",
        ));
    }
    let avcc = track
        .entry
        .children
        .iter()
        .find(|b| &b.kind == b"avcC")
        .ok_or_else(|| {
            bmff::corrupt(format!(
                "the '{}' sample entry has no 'avcC' box",
                fourcc(&kind)
            ))
        })?;
    let avc = h264::parse_avcc(avcc.body)?;
    let (Some(sps_nal), false) = (avc.sps.first(), avc.pps.is_empty()) else {
        return Err(PreprocessError::invalid(
            "the H.264 track's 'avcC' box has no SPS or no PPS: parameter sets only in the samples \
             (in-band 'avc3') are not supported",
        ));
    };
    let sps = h264::parse_sps(sps_nal)?;
    h264::check_supported(&sps)?;
    if sps.matrix == 8 {
        // swscale (the reference's conversion) refuses it too.
        return Err(PreprocessError::invalid(
            "unsupported H.264 video with the YCgCo colour matrix (VUI matrix_coefficients 8)",
        ));
    }
    let duration = track.total_duration()?;
    let duration_s = duration as f64 / track.timescale as f64;
    let frames = track.sample_count;
    let info = VideoInfo {
        width: sps.width,
        height: sps.height,
        frames,
        fps: (duration > 0).then(|| frames as f64 / duration_s),
        codec: format!("{} (H.264 {})", fourcc(&kind), sps.describe()),
        duration_s,
    };
    Ok(Header {
        track,
        avc,
        sps,
        info,
    })
}

/// Header only (moov box: track dims, sample count, timescale): no frame is decoded. Cheap
/// enough to call before admission.
///
/// Refuses what [`decode_mp4_frames`] refuses from the header (not an MP4, no video track,
/// a codec other than H.264, an H.264 profile or format OpenH264 does not decode, corrupt or
/// truncated boxes), except the pixel limit, which the caller applies to `width * height`.
pub fn read_mp4_info(bytes: &[u8]) -> Result<VideoInfo> {
    Ok(header(bytes)?.info)
}

/// The decoded pictures wanted, by decode index.
struct Wanted {
    /// Decode index -> presentation index.
    by_sample: HashMap<u32, u32>,
    /// Presentation index -> frame.
    frames: HashMap<u32, RgbImage>,
    size: (u32, u32),
    colour: codec::Yuv2Rgb,
}

impl Wanted {
    fn take(&mut self, pic: &codec::Picture<'_>) -> Result<()> {
        let Some(&p) = u32::try_from(pic.ts)
            .ok()
            .and_then(|d| self.by_sample.get(&d))
        else {
            return Ok(());
        };
        let (w, h) = self.size;
        if (pic.width, pic.height) != (w as usize, h as usize) {
            return Err(PreprocessError::invalid(format!(
                "corrupt H.264 stream: frame {p} decoded to {}x{}, but the SPS says {w}x{h}",
                pic.width, pic.height
            )));
        }
        self.frames
            .entry(p)
            .or_insert_with(|| pic.to_rgb(&self.colour));
        Ok(())
    }

    fn done(&self) -> bool {
        self.frames.len() == self.by_sample.len()
    }
}

fn in_sample(e: PreprocessError, d: usize, n: usize) -> PreprocessError {
    PreprocessError::invalid(format!("{} (in sample {d} of {n}, decode order)", e.0))
}

/// Decodes the frames at `indices` (presentation order, 0-based, ascending, repeats allowed)
/// into RGB images, decoding sequentially from the start and stopping after the last needed
/// frame. Refuses before decoding when width*height > max_decode_pixels or when the last index
/// is beyond the track.
///
/// The result has one image per index, in the order of `indices`. Colours are converted as
/// swscale converts them (the module docs): equal to PyAV's `to_ndarray(format="rgb24")` on
/// x86-64, within a level or two elsewhere. Memory: one decoded picture at a time inside the
/// decoder (plus its reference and reordering buffers), the requested frames as RGB, and
/// per-sample tables of at most a few tens of bytes a frame.
pub fn decode_mp4_frames(
    bytes: &[u8],
    indices: &[u32],
    max_decode_pixels: u64,
) -> Result<Vec<RgbImage>> {
    let Header {
        track,
        avc,
        sps,
        info,
    } = header(bytes)?;
    let (w, h) = (info.width, info.height);
    let pixels = w as u64 * h as u64;
    if pixels > max_decode_pixels {
        return Err(PreprocessError::invalid(format!(
            "video is {w}x{h} = {pixels} pixels a frame, over the decode limit of {max_decode_pixels} pixels"
        )));
    }
    let Some(&last) = indices.iter().max() else {
        return Ok(Vec::new());
    };
    if last >= info.frames {
        return Err(PreprocessError::invalid(format!(
            "frame index {last} is beyond the video's {} frames (indices 0..={})",
            info.frames,
            info.frames - 1
        )));
    }
    let samples = track.samples(bytes.len())?;
    let order = track.presentation_order()?;
    let n = samples.len();
    let mut wanted = Wanted {
        by_sample: indices.iter().map(|&p| (order[p as usize], p)).collect(),
        frames: HashMap::new(),
        size: (w, h),
        colour: codec::Yuv2Rgb::new(sps.matrix, sps.full_range),
    };
    let stop_at = wanted.by_sample.keys().copied().max().unwrap_or(0) as usize;

    let mut decoder = codec::H264Decoder::new()?;
    let mut access_unit = Vec::new();
    for (d, sample) in samples.iter().enumerate().take(stop_at + 1) {
        access_unit.clear();
        if d == 0 {
            for nal in avc.sps.iter().chain(&avc.pps) {
                h264::push_annexb(&mut access_unit, nal);
            }
        }
        let data = bytes
            .get(sample.offset..sample.offset + sample.size)
            .unwrap_or_default();
        if data.is_empty() {
            return Err(in_sample(bmff::corrupt("the sample is empty"), d, n));
        }
        h264::for_each_nal(data, avc.length_size, |nal| {
            if nal[0] & 0x1f == h264::NAL_SPS {
                check_inband_sps(nal, &info)?;
            }
            h264::push_annexb(&mut access_unit, nal);
            Ok(())
        })
        .map_err(|e| in_sample(e, d, n))?;
        decoder
            .decode(&access_unit, d as u64, &mut |pic| wanted.take(pic))
            .map_err(|e| in_sample(e, d, n))?;
        if wanted.done() {
            break;
        }
    }
    if !wanted.done() {
        decoder.flush(&mut |pic| wanted.take(pic))?;
    }
    let mut out = Vec::with_capacity(indices.len());
    for &p in indices {
        let Some(frame) = wanted.frames.get(&p) else {
            return Err(PreprocessError::invalid(format!(
                "corrupt H.264 stream: the decoder output no picture for frame {p} (sample {} in \
                 decode order)",
                order[p as usize]
            )));
        };
        out.push(frame.clone());
    }
    Ok(out)
}

/// A parameter set repeated in the samples must keep the frame size and stay decodable (the
/// pixel limit was checked against the `avcC` SPS).
fn check_inband_sps(nal: &[u8], info: &VideoInfo) -> Result<()> {
    let sps = h264::parse_sps(nal)?;
    h264::check_supported(&sps)?;
    if (sps.width, sps.height) != (info.width, info.height) {
        return Err(PreprocessError::invalid(format!(
            "the H.264 stream changes its frame size from {}x{} to {}x{} mid-stream; that is not \
             supported",
            info.width, info.height, sps.width, sps.height
        )));
    }
    Ok(())
}

/// Encodes frames (all the same size, even sides) as H.264 (OpenH264's encoder) in an MP4 with
/// the given fps: for tests, benches and sample clips.
///
/// The stream is Constrained Baseline (no B-frames), one IDR frame then P frames, at a quality
/// (QP 10..18) at which frames decode within 2-3 levels of their sources; RGB -> YUV is
/// OpenH264's BT.601 limited-range conversion, the inverse of the decoder side's. The MP4 has
/// `mdat` before `moov` (not "fast start") and at most 4 GiB of samples.
pub fn encode_mp4_h264(frames: &[RgbImage], fps: u32) -> Result<Vec<u8>> {
    let Some(first) = frames.first() else {
        return Err(PreprocessError::invalid("no frames to encode"));
    };
    if fps == 0 {
        return Err(PreprocessError::invalid("fps must be positive, got 0"));
    }
    let (w, h) = first.dimensions();
    if w == 0 || h == 0 || w % 2 != 0 || h % 2 != 0 {
        return Err(PreprocessError::invalid(format!(
            "frames are {w}x{h}; H.264 4:2:0 encoding needs positive, even sides"
        )));
    }
    if let Some((i, f)) = frames
        .iter()
        .enumerate()
        .find(|(_, f)| f.dimensions() != (w, h))
    {
        return Err(PreprocessError::invalid(format!(
            "frame {i} is {}x{} but frame 0 is {w}x{h}: all frames must be the same size",
            f.width(),
            f.height()
        )));
    }
    let stream = codec::encode(frames, fps)?;
    mux::write_mp4(&stream, w, h, fps)
}
