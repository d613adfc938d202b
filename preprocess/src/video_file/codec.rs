//! OpenH264 (the `openh264` crate, which builds Cisco's C++ source with `cc`): the decoder, the
//! encoder, and the YUV 4:2:0 -> RGB conversion of decoded pictures.
//!
//! The decoder is driven through the crate's raw API so that each access unit carries a
//! timestamp in (`SBufferInfo::uiInBsTimeStamp`) that comes back with the picture it decodes to
//! (`uiOutYuvTimeStamp`): with B-frames OpenH264 outputs pictures later than it reads them, in
//! an order of its own heuristics (POC and slice types), and the timestamp is what tells which
//! sample a picture is. The crate's safe `Decoder::decode` always passes timestamp 0.
use super::h264;
use crate::error::{PreprocessError, Result};
use image::RgbImage;
use openh264::decoder::{Decoder, DecoderConfig, Flush};
use openh264::encoder::{
    BitRate, Encoder, EncoderConfig, FrameRate, FrameType, QpRange, RateControlMode,
};
use openh264::formats::{RgbSliceU8, YUVBuffer};
use openh264::OpenH264API;
use openh264_sys2::{
    videoFormatI420, SBufferInfo, DECODER_OPTION_NUM_OF_FRAMES_REMAINING_IN_BUFFER, DECODING_STATE,
};
use std::os::raw::{c_int, c_void};
use std::ptr::null_mut;

/// A decoded picture, borrowed from the decoder until its next call.
pub(super) struct Picture<'a> {
    /// The timestamp of the access unit it was decoded from.
    pub ts: u64,
    pub width: usize,
    pub height: usize,
    y: &'a [u8],
    u: &'a [u8],
    v: &'a [u8],
    y_stride: usize,
    uv_stride: usize,
}

/// Names of the bits of an OpenH264 `DECODING_STATE`.
fn describe_state(state: DECODING_STATE) -> String {
    const NAMES: &[(DECODING_STATE, &str)] = &[
        (0x01, "frame pending"),
        (0x02, "reference lost"),
        (0x04, "bitstream error"),
        (0x08, "dependent layer lost"),
        (0x10, "no parameter sets"),
        (0x20, "data error concealed"),
        (0x40, "reference list null pointers"),
        (0x1000, "invalid argument"),
        (0x2000, "initialization expected"),
        (0x4000, "out of memory"),
        (0x8000, "destination buffer needs expansion"),
    ];
    let names: Vec<&str> = NAMES
        .iter()
        .filter(|(bit, _)| state & bit != 0)
        .map(|(_, n)| *n)
        .collect();
    if names.is_empty() {
        format!("state {state:#x}")
    } else {
        format!("{} (state {state:#x})", names.join(", "))
    }
}

fn openh264_error(what: &str, e: openh264::Error) -> PreprocessError {
    PreprocessError::invalid(format!("OpenH264 {what}: {e}"))
}

/// OpenH264's H.264 decoder, single-threaded, with error concealment off (a damaged picture is
/// an error, not a patched-up frame).
pub(super) struct H264Decoder {
    dec: Decoder,
}

impl H264Decoder {
    pub fn new() -> Result<Self> {
        // Flushing is done by `flush` at the end; the crate's own flush mode is unused on the
        // raw path.
        let config = DecoderConfig::new().flush_after_decode(Flush::NoFlush);
        let dec = Decoder::with_api_config(OpenH264API::from_source(), config)
            .map_err(|e| openh264_error("decoder initialization failed", e))?;
        Ok(H264Decoder { dec })
    }

    /// Decodes one access unit (an Annex-B byte stream) tagged `ts`; `sink` sees the picture
    /// that comes out, if any (not necessarily this access unit's: see the module docs).
    pub fn decode(
        &mut self,
        access_unit: &[u8],
        ts: u64,
        sink: &mut dyn FnMut(&Picture<'_>) -> Result<()>,
    ) -> Result<()> {
        let len = c_int::try_from(access_unit.len()).map_err(|_| {
            PreprocessError::invalid(format!(
                "an H.264 access unit of {} bytes is over the decoder's 2 GiB limit",
                access_unit.len()
            ))
        })?;
        let mut dst = [null_mut::<u8>(); 3];
        let mut info = SBufferInfo {
            uiInBsTimeStamp: ts,
            ..SBufferInfo::default()
        };
        // SAFETY: the decoder is initialized (Decoder::with_api_config) and used from this
        // thread only; `access_unit` is valid for `len` bytes for the call, which does not keep
        // it; `dst` and `info` are valid for writes and outlive the call. This is the call
        // `Decoder::decode_with_options` makes, with a timestamp in `info`.
        let state = unsafe {
            self.dec.raw_api().decode_frame_no_delay(
                access_unit.as_ptr(),
                len,
                dst.as_mut_ptr(),
                &mut info,
            )
        };
        if state != 0 {
            return Err(PreprocessError::invalid(format!(
                "corrupt H.264 stream: the decoder reports {}",
                describe_state(state)
            )));
        }
        if info.iBufferStatus == 1 {
            // SAFETY: iBufferStatus 1 means `dst` and `info` describe a picture in the
            // decoder's buffers, valid until the next call on the decoder; `sink` runs before
            // that and cannot keep the borrow.
            let picture = unsafe { picture(&dst, &info) }?;
            sink(&picture)?;
        }
        Ok(())
    }

    /// Outputs the pictures still held for reordering.
    pub fn flush(&mut self, sink: &mut dyn FnMut(&Picture<'_>) -> Result<()>) -> Result<()> {
        // The decoder holds at most 16 pictures for reordering; the bound guards against a
        // count that does not go down.
        for _ in 0..32 {
            let mut remaining: c_int = 0;
            // SAFETY: the option writes one int to the pointer, which is valid for that.
            let rc = unsafe {
                self.dec.raw_api().get_option(
                    DECODER_OPTION_NUM_OF_FRAMES_REMAINING_IN_BUFFER,
                    (&mut remaining as *mut c_int).cast::<c_void>(),
                )
            };
            if rc != 0 || remaining <= 0 {
                break;
            }
            let mut dst = [null_mut::<u8>(); 3];
            let mut info = SBufferInfo::default();
            // SAFETY: as in `decode`; flush_frame only writes `dst` and `info`.
            let state = unsafe { self.dec.raw_api().flush_frame(dst.as_mut_ptr(), &mut info) };
            if state != 0 {
                return Err(PreprocessError::invalid(format!(
                    "corrupt H.264 stream: flushing the decoder reports {}",
                    describe_state(state)
                )));
            }
            if info.iBufferStatus != 1 {
                break;
            }
            // SAFETY: as in `decode`.
            let picture = unsafe { picture(&dst, &info) }?;
            sink(&picture)?;
        }
        Ok(())
    }
}

/// The planes of an output picture.
///
/// # Safety
///
/// `dst` and `info` must be what the decoder just returned with `iBufferStatus == 1`; the
/// slices borrow its buffers, valid until its next call.
unsafe fn picture<'a>(dst: &[*mut u8; 3], info: &SBufferInfo) -> Result<Picture<'a>> {
    // SAFETY: `sSystemBuffer` is the union's only member, written by the decoder.
    let buf = unsafe { info.UsrData.sSystemBuffer };
    let bad = |what: &str| {
        PreprocessError::invalid(format!(
            "the H.264 decoder returned an unusable picture ({what}: {}x{}, strides {:?}, format {})",
            buf.iWidth, buf.iHeight, buf.iStride, buf.iFormat
        ))
    };
    if dst.iter().any(|p| p.is_null()) {
        return Err(bad("no planes"));
    }
    if buf.iFormat != videoFormatI420 as c_int {
        return Err(bad("not I420"));
    }
    let (w, h) = (buf.iWidth, buf.iHeight);
    let (ys, uvs) = (buf.iStride[0], buf.iStride[1]);
    if w <= 0 || h <= 0 || w % 2 != 0 || h % 2 != 0 || ys < w || uvs < w / 2 {
        return Err(bad("bad geometry"));
    }
    let (w, h, ys, uvs) = (w as usize, h as usize, ys as usize, uvs as usize);
    // SAFETY: OpenH264 allocates each plane for (at least) its height times its stride, as the
    // crate's `DecodedYUV` also assumes; 4:2:0 chroma planes have h/2 rows.
    let (y, u, v) = unsafe {
        (
            std::slice::from_raw_parts(dst[0], h * ys),
            std::slice::from_raw_parts(dst[1], h / 2 * uvs),
            std::slice::from_raw_parts(dst[2], h / 2 * uvs),
        )
    };
    Ok(Picture {
        ts: info.uiOutYuvTimeStamp,
        width: w,
        height: h,
        y,
        u,
        v,
        y_stride: ys,
        uv_stride: uvs,
    })
}

/// `ff_yuv2rgb_coeffs` of ffmpeg's swscale, indexed by the H.273 matrix (`AVColorSpace`):
/// `{crv, cbu, cgu, cgv}` in 16-bit fixed point for limited-range chroma, e.g. BT.601's
/// crv = 65536 * 255/224 * 1.402 = 104597.
const SWS_COEFFS: [[i64; 4]; 11] = [
    [104597, 132201, 25675, 53279], // 0: RGB / none: BT.601
    [117489, 138438, 13975, 34925], // 1: BT.709
    [104597, 132201, 25675, 53279], // 2: unspecified: BT.601
    [104597, 132201, 25675, 53279], // 3: reserved
    [104448, 132798, 24759, 53109], // 4: FCC
    [104597, 132201, 25675, 53279], // 5: BT.470 System B, G (BT.601)
    [104597, 132201, 25675, 53279], // 6: SMPTE 170M (BT.601)
    [117579, 136230, 16907, 35559], // 7: SMPTE 240M
    [104597, 132201, 25675, 53279], // 8: YCgCo: swscale falls back to its default
    [110013, 140363, 12277, 42626], // 9: BT.2020 non-constant luminance
    [110013, 140363, 12277, 42626], // 10: BT.2020 constant luminance
];

/// swscale's YUV -> RGB conversion of yuv420p to rgb24 as its x86 SIMD path does it (the one
/// PyAV's `to_ndarray(format="rgb24")` takes on x86-64): samples scaled by 8, coefficients in
/// 13-bit fixed point (`ff_yuv2rgb_c_init_tables` with default contrast and saturation), each
/// product's high 16 bits (`pmulhw`, a floor), summed and saturated to 0..255.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Yuv2Rgb {
    y_coeff: i32,
    y_offset: i32,
    vr: i32,
    ub: i32,
    ug: i32,
    vg: i32,
}

/// swscale's `roundToInt16`.
fn round_to_i16(f: i64) -> i32 {
    ((f + (1 << 15)) >> 16).clamp(-0x7fff, 0x7fff) as i32
}

impl Yuv2Rgb {
    /// The conversion for an H.273 `matrix` (VUI `matrix_coefficients`) and range, as swscale
    /// picks it from the decoded frame's colorspace and color_range: unknown matrices are
    /// BT.601, as in `sws_getCoefficients`.
    pub fn new(matrix: u8, full_range: bool) -> Self {
        let [mut crv, mut cbu, cgu, cgv] = SWS_COEFFS
            .get(matrix as usize)
            .copied()
            .unwrap_or(SWS_COEFFS[2]);
        let (mut cgu, mut cgv) = (-cgu, -cgv);
        let (cy, oy) = if full_range {
            crv = crv * 224 / 255;
            cbu = cbu * 224 / 255;
            cgu = cgu * 224 / 255;
            cgv = cgv * 224 / 255;
            (1i64 << 16, 0i64)
        } else {
            ((1i64 << 16) * 255 / 219, 16i64 << 16)
        };
        Yuv2Rgb {
            y_coeff: round_to_i16(cy << 13),
            y_offset: round_to_i16(oy << 3),
            vr: round_to_i16(crv << 13),
            ub: round_to_i16(cbu << 13),
            ug: round_to_i16(cgu << 13),
            vg: round_to_i16(cgv << 13),
        }
    }
}

/// `pmulhw`: the high 16 bits of a signed 16 x 16-bit product.
#[inline]
fn mulhi(a: i32, b: i32) -> i32 {
    (a * b) >> 16
}

impl Picture<'_> {
    /// The picture as 8-bit RGB, each chroma sample used for its 2x2 block (nearest, as
    /// OpenH264's `write_rgb8` and swscale's unscaled converter).
    pub fn to_rgb(&self, conv: &Yuv2Rgb) -> RgbImage {
        let (w, h) = (self.width, self.height);
        let mut out = vec![0u8; w * h * 3];
        for (row, px) in out.chunks_exact_mut(w * 3).enumerate() {
            let y_row = &self.y[row * self.y_stride..][..w];
            let u_row = &self.u[row / 2 * self.uv_stride..][..w / 2];
            let v_row = &self.v[row / 2 * self.uv_stride..][..w / 2];
            for (x, rgb) in px.chunks_exact_mut(3).enumerate() {
                let luma = mulhi(((y_row[x] as i32) << 3) - conv.y_offset, conv.y_coeff);
                let cb = ((u_row[x / 2] as i32) - 128) << 3;
                let cr = ((v_row[x / 2] as i32) - 128) << 3;
                rgb[0] = (luma + mulhi(cr, conv.vr)).clamp(0, 255) as u8;
                rgb[1] = (luma + mulhi(cb, conv.ug) + mulhi(cr, conv.vg)).clamp(0, 255) as u8;
                rgb[2] = (luma + mulhi(cb, conv.ub)).clamp(0, 255) as u8;
            }
        }
        // The buffer is exactly w*h*3 bytes.
        RgbImage::from_raw(w as u32, h as u32, out)
            .unwrap_or_else(|| RgbImage::new(w as u32, h as u32))
    }
}

/// One frame of an encoded stream: its NAL units, each after a 4-byte big-endian length.
pub(super) struct EncodedSample {
    pub data: Vec<u8>,
    pub sync: bool,
}

pub(super) struct EncodedStream {
    pub sps: Vec<u8>,
    pub pps: Vec<u8>,
    pub samples: Vec<EncodedSample>,
}

/// Encodes `frames` (same size, even sides) with OpenH264's encoder: Constrained Baseline, one
/// IDR frame then P frames, no frame skipping, buffer-based rate control held to QP 10..18 (the
/// quality and bitrate modes warn on stderr without frame skipping, and "off" fixes QP 26), so
/// the frames decode within 2-3 levels of their sources.
pub(super) fn encode(frames: &[RgbImage], fps: u32) -> Result<EncodedStream> {
    let (w, h) = frames[0].dimensions();
    let bps = (w as u64 * h as u64 * fps as u64 * 4).clamp(1_000_000, 200_000_000) as u32;
    let config = EncoderConfig::new()
        .skip_frames(false)
        .max_frame_rate(FrameRate::from_hz(fps as f32))
        .bitrate(BitRate::from_bps(bps))
        .rate_control_mode(RateControlMode::Bufferbased)
        .qp(QpRange::new(10, 18))
        .num_threads(1);
    let mut enc = Encoder::with_api_config(OpenH264API::from_source(), config)
        .map_err(|e| openh264_error("encoder initialization failed", e))?;
    let (mut sps, mut pps) = (None::<Vec<u8>>, None::<Vec<u8>>);
    let mut samples = Vec::with_capacity(frames.len());
    for (i, frame) in frames.iter().enumerate() {
        let yuv =
            YUVBuffer::from_rgb8_source(RgbSliceU8::new(frame.as_raw(), (w as usize, h as usize)));
        let stream = enc
            .encode(&yuv)
            .map_err(|e| openh264_error(&format!("failed to encode frame {i}"), e))?;
        if matches!(stream.frame_type(), FrameType::Skip | FrameType::Invalid) {
            return Err(PreprocessError::invalid(format!(
                "OpenH264 encoder skipped frame {i} ({:?})",
                stream.frame_type()
            )));
        }
        let annexb = stream.to_vec();
        let mut data = Vec::with_capacity(annexb.len());
        let mut sync = false;
        for nal in h264::split_annexb(&annexb) {
            let kind = nal[0] & 0x1f;
            let slot = match kind {
                h264::NAL_SPS => Some(&mut sps),
                h264::NAL_PPS => Some(&mut pps),
                _ => None,
            };
            if let Some(slot) = slot {
                match slot {
                    None => *slot = Some(nal.to_vec()),
                    Some(first) if first == nal => {}
                    Some(_) => {
                        return Err(PreprocessError::invalid(format!(
                            "OpenH264 encoder changed its parameter sets at frame {i}"
                        )))
                    }
                }
                continue;
            }
            sync |= kind == h264::NAL_SLICE_IDR;
            data.extend_from_slice(&(nal.len() as u32).to_be_bytes());
            data.extend_from_slice(nal);
        }
        if data.is_empty() {
            return Err(PreprocessError::invalid(format!(
                "OpenH264 encoder wrote no picture for frame {i}"
            )));
        }
        samples.push(EncodedSample { data, sync });
    }
    match (sps, pps) {
        (Some(sps), Some(pps))
            if sps.len() >= 4
                && sps.len() <= u16::MAX as usize
                && pps.len() <= u16::MAX as usize =>
        {
            Ok(EncodedStream { sps, pps, samples })
        }
        _ => Err(PreprocessError::invalid(
            "OpenH264 encoder wrote no usable SPS/PPS",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bt601_limited_range_levels() {
        let planes = |yv: u8, uv: u8, vv: u8| (vec![yv; 4], vec![uv; 1], vec![vv; 1]);
        let rgb = |(y, u, v): (Vec<u8>, Vec<u8>, Vec<u8>)| {
            Picture {
                ts: 0,
                width: 2,
                height: 2,
                y: &y,
                u: &u,
                v: &v,
                y_stride: 2,
                uv_stride: 1,
            }
            .to_rgb(&Yuv2Rgb::new(2, false))
            .get_pixel(1, 1)
            .0
        };
        assert_eq!(rgb(planes(16, 128, 128)), [0, 0, 0]);
        assert_eq!(rgb(planes(235, 128, 128)), [255, 255, 255]);
        assert_eq!(rgb(planes(126, 128, 128)), [128, 128, 128]);
        // Pure red in BT.601 limited range: Y 81, Cb 90, Cr 240.
        let [r, g, b] = rgb(planes(81, 90, 240));
        assert!(r >= 253 && g <= 2 && b <= 2, "{r} {g} {b}");
    }

    #[test]
    fn swscale_coefficients() {
        // BT.601 limited range, as swscale computes them (yuv2rgb.c).
        let c = Yuv2Rgb::new(2, false);
        assert_eq!(
            (c.y_coeff, c.y_offset, c.vr, c.ub, c.ug, c.vg),
            (9539, 128, 13075, 16525, -3209, -6660)
        );
        let full = Yuv2Rgb::new(1, true);
        assert_eq!((full.y_coeff, full.y_offset), (8192, 0));
        assert_eq!(Yuv2Rgb::new(200, false), c);
    }

    #[test]
    fn decoding_states_are_named() {
        assert_eq!(
            describe_state(0x14),
            "bitstream error, no parameter sets (state 0x14)"
        );
    }
}
