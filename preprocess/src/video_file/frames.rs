//! Decoding the sampled frames: packets of the selected stream into the decoder until the
//! last wanted frame comes out; only the wanted pictures are converted to RGB.
use super::avio::MemoryInput;
use super::error::VideoError;
use super::rgb::ToRgb;
use super::stream::Selected;
use super::{Budget, DecodeLimits, DecodedVideo};
use ffmpeg_next::codec::context::Context;
use ffmpeg_next::codec::decoder::Video as Decoder;
use ffmpeg_next::util::frame::Video as Frame;
use ffmpeg_next::{Error, Packet};
use image::RgbImage;
use std::collections::BTreeMap;

fn open_decoder(
    input: &MemoryInput<'_>,
    sel: &Selected,
    max_pixels: u64,
    threads: usize,
) -> Result<Decoder, VideoError> {
    let stream = input.input().stream(sel.index).expect("selected index");
    let mut ctx = Context::from_parameters(stream.parameters())
        .map_err(|e| VideoError::corrupt("the stream's codec parameters", e))?;
    // SAFETY: a fresh, unopened codec context.
    unsafe {
        let c = ctx.as_mut_ptr();
        // libavcodec refuses pictures over this before allocating them (in-band size changes).
        (*c).max_pixels = i64::try_from(max_pixels).unwrap_or(i64::MAX);
        (*c).pkt_timebase = sel.time_base.into();
        // The caller's choice: several decodes may run at once, each bounded.
        (*c).thread_count = i32::try_from(threads).unwrap_or(1);
    }
    ctx.decoder()
        .open_as(sel.decoder)
        .and_then(|d| d.video())
        .map_err(|e| VideoError::corrupt(format!("opening the {} decoder", sel.info.codec), e))
}

/// Decodes up to the last of `indices` (presentation order) and returns the wanted frames,
/// each resized to `resize` (width, height) when given, as soon as it is converted.
pub(super) fn decode(
    input: &mut MemoryInput<'_>,
    sel: &Selected,
    indices: &[u32],
    limits: &DecodeLimits,
    resize: Option<(u32, u32)>,
    budget: &Budget,
) -> Result<DecodedVideo, VideoError> {
    let Some(&last) = indices.iter().max() else {
        return Ok(DecodedVideo::default());
    };
    let mut decoder = open_decoder(input, sel, limits.max_frame_pixels, limits.threads)?;
    let mut wanted: BTreeMap<u32, Option<(RgbImage, f64)>> =
        indices.iter().map(|&i| (i, None)).collect();
    let mut to_rgb = ToRgb::new(sel.rotation);
    let mut frame = Frame::empty();
    let (mut next, mut read) = (0u32, 0u64);
    // Every converted frame is a wanted one: the last converted stands in past the end.
    let mut last_converted: Option<u32> = None;
    let mut first_pts: Option<i64> = None;
    let (w, h) = (sel.info.width, sel.info.height);

    // Takes every picture the decoder has ready; true once the last wanted one is in.
    let mut drain = |decoder: &mut Decoder, next: &mut u32| -> Result<bool, VideoError> {
        loop {
            match decoder.receive_frame(&mut frame) {
                Ok(()) => {}
                Err(Error::Eof) => return Ok(false),
                Err(Error::Other { errno }) if errno == ffmpeg_next::util::error::EAGAIN => {
                    return Ok(false)
                }
                Err(e) => return Err(VideoError::corrupt("decoding", e)),
            }
            let k = *next;
            *next += 1;
            if k == 0 {
                first_pts = frame.timestamp();
            }
            if !wanted.contains_key(&k) && k < last {
                continue; // decoded, never converted
            }
            let rgb = to_rgb.convert(&frame)?;
            if rgb.dimensions() != (w, h) {
                return Err(VideoError::Corrupt(format!(
                    "frame {k} decodes to {}x{}, the header says {w}x{h}",
                    rgb.width(),
                    rgb.height()
                )));
            }
            let rgb = match resize {
                Some((rw, rh)) => crate::resize_bicubic(&rgb, rw, rh)
                    .map_err(|e| VideoError::Corrupt(format!("resizing frame {k}: {e}")))?,
                None => rgb,
            };
            // Times from the first frame's timestamp (a fragmented MP4 has no edit list to
            // take the B-frame delay off; the header's start time is often unset).
            let pts = frame.timestamp().unwrap_or(0);
            let origin = *first_pts.get_or_insert(pts);
            let t = pts.saturating_sub(origin) as f64 * f64::from(sel.time_base);
            wanted.insert(k, Some((rgb, t)));
            last_converted = Some(k);
            if k >= last {
                return Ok(true);
            }
        }
    };

    let mut done = false;
    while !done {
        // A new packet each time: `av_read_frame` does not unref the one it is given, so
        // reusing it leaked each packet's buffers (found by cargo fuzz, LeakSanitizer).
        let mut packet = Packet::empty();
        match packet.read(input.input_mut()) {
            Ok(()) => {}
            Err(Error::Eof) => break,
            Err(e) => return Err(VideoError::corrupt("reading the packets", e)),
        }
        read += 1;
        budget.check(read)?;
        if packet.stream() != sel.index {
            continue;
        }
        if let Err(e) = decoder.send_packet(&packet) {
            // A damaged packet: FFmpeg's CLI and PyAV go on with the next one too.
            if !matches!(e, Error::InvalidData) {
                return Err(VideoError::corrupt("decoding", e));
            }
        }
        done = drain(&mut decoder, &mut next)?;
    }
    if !done {
        let _ = decoder.send_eof();
        done = drain(&mut decoder, &mut next)?;
    }
    let decoded = next;
    if !done {
        // The container's count can be a frame or two over what the decoder outputs (edit
        // lists, a dropped leading frame): past the end, the last frame stands in, as
        // decord/torchcodec clamp. More than that is a damaged stream.
        let slack = 2.max(sel.info.frames / 100);
        if decoded == 0 || last >= decoded + slack {
            return Err(VideoError::Corrupt(format!(
                "the stream ends after {decoded} decodable frames of the {} its header \
                 states; frame {last} was asked for",
                sel.info.frames
            )));
        }
    }
    // Frames move out of `wanted` (one copy of each at the peak); a frame asked for again
    // later, or standing in past the end, is copied.
    let stand_in = last_converted.expect("decoded > 0");
    let keys: Vec<u32> = indices
        .iter()
        .map(|i| match wanted.get(i) {
            Some(Some(_)) => *i,
            _ => stand_in,
        })
        .collect();
    let mut out = DecodedVideo::default();
    for (pos, key) in keys.iter().enumerate() {
        let (img, t) = if keys[pos + 1..].contains(key) {
            wanted[key].clone().expect("converted")
        } else {
            wanted.remove(key).flatten().expect("converted")
        };
        out.frames.push(img);
        out.times_s.push(t);
    }
    Ok(out)
}
