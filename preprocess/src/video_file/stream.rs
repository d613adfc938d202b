//! The video stream of an opened file: which one, whether its codec is allowed, and what its
//! header says (size, frame count, duration, rate, rotation).
use super::avio::MemoryInput;
use super::error::VideoError;
use super::VideoInfo;
use ffmpeg_next::codec::{self, Id};
use ffmpeg_next::ffi;
use ffmpeg_next::format::stream::Stream;
use ffmpeg_next::packet::side_data::Type as SideData;
use ffmpeg_next::{media, Packet, Rational};

/// The decoders allowed, by codec: (codec, preferred decoder names, in order). AV1 has no
/// software decoder of FFmpeg's own before FFmpeg 6 (the native one needs a hwaccel).
const DECODERS: &[(Id, &[&str])] = &[
    (Id::H264, &["h264"]),
    (Id::HEVC, &["hevc"]),
    (Id::VP8, &["vp8"]),
    (Id::VP9, &["vp9"]),
    (Id::AV1, &["libdav1d", "libaom-av1", "av1"]),
    (Id::MPEG4, &["mpeg4"]),
];

/// What [`select`] found.
pub(super) struct Selected {
    pub index: usize,
    pub decoder: ffmpeg_next::Codec,
    pub info: VideoInfo,
    /// Clockwise degrees to turn decoded frames by (0, 90, 180, 270).
    pub rotation: u32,
    pub time_base: Rational,
    /// Whether the packets were read to count the frames (the header had no count): the
    /// demuxer must be opened again to decode.
    pub counted: bool,
}

fn codec_name(id: Id) -> String {
    // SAFETY: avcodec_get_name returns a static string for any id.
    unsafe { std::ffi::CStr::from_ptr(ffi::avcodec_get_name(id.into())) }
        .to_string_lossy()
        .into_owned()
}

/// The video stream FFmpeg ranks best, cover art (attached pictures) excluded.
fn best_video_stream(input: &MemoryInput<'_>) -> Option<usize> {
    let eligible = |s: &Stream| {
        s.parameters().medium() == media::Type::Video
            && s.disposition().bits() & ffi::AV_DISPOSITION_ATTACHED_PIC == 0
    };
    let best = input.input().streams().best(media::Type::Video);
    match best {
        Some(s) if eligible(&s) => Some(s.index()),
        _ => input.input().streams().find(eligible).map(|s| s.index()),
    }
}

/// Clockwise quarter turns the display matrix asks for (as the ffmpeg CLI's autorotate reads
/// it), 0 when there is none or it is not a multiple of 90 degrees.
fn rotation(stream: &Stream) -> u32 {
    for sd in stream.side_data() {
        if sd.kind() != SideData::DisplayMatrix || sd.data().len() < 9 * 4 {
            continue;
        }
        let mut m = [0i32; 9];
        for (v, b) in m.iter_mut().zip(sd.data().chunks_exact(4)) {
            *v = i32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        }
        // SAFETY: `m` is the 3x3 matrix the function reads.
        let ccw = unsafe { ffi::av_display_rotation_get(m.as_ptr()) };
        if !ccw.is_finite() {
            return 0;
        }
        let cw = (-ccw).rem_euclid(360.0);
        let quarter = (cw / 90.0).round();
        if (cw - quarter * 90.0).abs() > 1.0 {
            return 0;
        }
        return (quarter as u32 % 4) * 90;
    }
    0
}

fn seconds(ts: i64, tb: Rational) -> f64 {
    ts as f64 * f64::from(tb)
}

/// Demuxes (no decoding) the stream's packets: their number and the time they span, for
/// containers whose header has no frame count (Matroska, fragmented MP4).
fn count_packets(
    input: &mut MemoryInput<'_>,
    index: usize,
    tb: Rational,
    budget: &super::Budget,
) -> Result<(u32, f64), VideoError> {
    let (mut n, mut first, mut end) = (0u32, i64::MAX, i64::MIN);
    let mut read = 0u64;
    loop {
        // A new packet each time: `av_read_frame` does not unref the one it is given, so
        // reusing it leaked each packet's buffers (found by cargo fuzz, LeakSanitizer).
        let mut packet = Packet::empty();
        match packet.read(input.input_mut()) {
            Ok(()) => {}
            Err(ffmpeg_next::Error::Eof) => break,
            Err(e) => return Err(VideoError::corrupt("reading the packets", e)),
        }
        read += 1;
        budget.check(read)?;
        if packet.stream() != index {
            continue;
        }
        n = n.saturating_add(1);
        if let Some(pts) = packet.pts().or(packet.dts()) {
            first = first.min(pts);
            end = end.max(pts.saturating_add(packet.duration().max(0)));
        }
    }
    let span = if end > first {
        seconds(end - first, tb)
    } else {
        0.0
    };
    Ok((n, span))
}

/// Picks the video stream, checks its codec and reads its header; counts the packets where
/// the header has no frame count (then [`Selected::counted`]).
pub(super) fn select(
    input: &mut MemoryInput<'_>,
    budget: &super::Budget,
) -> Result<Selected, VideoError> {
    let container = input.container.clone();
    let index = best_video_stream(input).ok_or_else(|| VideoError::NoVideoStream {
        container: container.clone(),
    })?;
    let stream = input.input().stream(index).expect("index from streams()");
    let params = stream.parameters();
    let id = params.id();
    if id == Id::None {
        return Err(VideoError::Corrupt(
            "the video stream's codec is not identified".into(),
        ));
    }
    let Some((_, names)) = DECODERS.iter().find(|(c, _)| *c == id) else {
        return Err(VideoError::UnsupportedCodec {
            name: codec_name(id),
        });
    };
    let decoder = names
        .iter()
        .find_map(|n| codec::decoder::find_by_name(n))
        .ok_or_else(|| VideoError::NoDecoder {
            name: codec_name(id),
        })?;
    let size = |input: &MemoryInput<'_>| {
        let params = input.input().stream(index).expect("index").parameters();
        // SAFETY: codecpar of an opened stream.
        unsafe { ((*params.as_ptr()).width, (*params.as_ptr()).height) }
    };
    let (mut width, mut height) = size(input);
    if width <= 0 || height <= 0 {
        // Some muxers leave the size to the bitstream (MPEG-4 Part 2 in MP4): FFmpeg's probe
        // decodes the first frames for it, with only the allowed decoders.
        // SAFETY: an opened format context.
        let ret = unsafe {
            ffi::avformat_find_stream_info(input.input_mut().as_mut_ptr(), std::ptr::null_mut())
        };
        if ret >= 0 {
            (width, height) = size(input);
        }
    }
    let stream = input.input().stream(index).expect("index from streams()");
    if width <= 0 || height <= 0 {
        return Err(VideoError::Corrupt(format!(
            "the {} stream's header has no frame size ({width}x{height})",
            codec_name(id)
        )));
    }
    let (width, height) = (width as u32, height as u32);
    let tb = stream.time_base();
    let rotation = rotation(&stream);
    let avg = stream.avg_frame_rate();
    let rate = (avg.numerator() > 0 && avg.denominator() > 0).then(|| f64::from(avg));
    let mut duration_s = match stream.duration() {
        d if d > 0 && tb.numerator() > 0 && tb.denominator() > 0 => seconds(d, tb),
        _ => match input.input().duration() {
            d if d > 0 => d as f64 / f64::from(ffi::AV_TIME_BASE),
            _ => 0.0,
        },
    };
    let mut frames = u32::try_from(stream.frames().max(0)).unwrap_or(u32::MAX);
    let mut counted = false;
    if frames == 0 {
        let (n, span) = count_packets(input, index, tb, budget)?;
        frames = n;
        if duration_s <= 0.0 {
            duration_s = span;
        }
        counted = true;
    }
    if frames == 0 {
        return Err(VideoError::Corrupt(format!(
            "the {} stream has no frames",
            codec_name(id)
        )));
    }
    // Every frame takes at least a byte: a larger count is a damaged (or hostile) header.
    if frames as usize > input.len {
        return Err(VideoError::Corrupt(format!(
            "the header states {frames} frames in a file of {} bytes",
            input.len
        )));
    }
    let fps = rate.or_else(|| (duration_s > 0.0).then(|| frames as f64 / duration_s));
    let (w, h) = if rotation % 180 == 90 {
        (height, width)
    } else {
        (width, height)
    };
    let profile = profile_name(&params);
    let info = VideoInfo {
        width: w,
        height: h,
        frames,
        fps,
        codec: format!("{}{profile}", codec_name(id)),
        duration_s,
        container: container.clone(),
        rotation,
    };
    Ok(Selected {
        index,
        decoder,
        info,
        rotation,
        time_base: tb,
        counted,
    })
}

/// ` (High 10)` and the like, when the header's decoder configuration (`avcC`, `hvcC`, `av1C`
/// as MP4 and Matroska store them) names a profile FFmpeg knows. The demuxers leave it unset
/// (FFmpeg's parsers fill it in while probing, which is not run here).
fn profile_name(params: &codec::Parameters) -> String {
    // SAFETY: codecpar of an opened stream: extradata is null or `extradata_size` bytes.
    let (id, extra) = unsafe {
        let p = params.as_ptr();
        let extra = if (*p).extradata.is_null() || (*p).extradata_size <= 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts((*p).extradata, (*p).extradata_size as usize)
        };
        ((*p).codec_id, extra)
    };
    let profile = match (id, extra) {
        (ffi::AVCodecID::AV_CODEC_ID_H264, [1, idc, flags, ..]) => {
            let mut p = *idc as i32;
            if *idc == 66 && flags & 0x40 != 0 {
                p |= ffi::FF_PROFILE_H264_CONSTRAINED;
            }
            if matches!(idc, 110 | 122 | 244) && flags & 0x10 != 0 {
                p |= ffi::FF_PROFILE_H264_INTRA;
            }
            p
        }
        (ffi::AVCodecID::AV_CODEC_ID_HEVC, [1, b, ..]) => (b & 0x1f) as i32,
        (ffi::AVCodecID::AV_CODEC_ID_AV1, [0x81, b, ..]) => (b >> 5) as i32,
        _ => return String::new(),
    };
    // SAFETY: avcodec_profile_name returns a static string or null.
    unsafe {
        let name = ffi::avcodec_profile_name(id, profile);
        if name.is_null() {
            String::new()
        } else {
            format!(" ({})", std::ffi::CStr::from_ptr(name).to_string_lossy())
        }
    }
}
