//! Decoded pictures -> RGB24 with swscale, the way the reference (PyAV's
//! `frame.to_ndarray(format="rgb24")`, which transformers' video loaders use) converts them:
//! the matrix and range the stream signals (BT.601 limited range when it signals none), no
//! scaling, then the display-matrix rotation.
use super::error::VideoError;
use ffmpeg_next::ffi;
use ffmpeg_next::format::Pixel;
use ffmpeg_next::software::scaling::{Context as Scaler, Flags};
use ffmpeg_next::util::color::Range;
use ffmpeg_next::util::frame::Video as Frame;
use image::RgbImage;

/// A swscale context, rebuilt when the pictures' format or size change.
pub(super) struct ToRgb {
    rotation: u32,
    scaler: Option<(Pixel, u32, u32, Scaler)>,
    out: Frame,
}

impl ToRgb {
    pub fn new(rotation: u32) -> Self {
        ToRgb {
            rotation,
            scaler: None,
            out: Frame::empty(),
        }
    }

    pub fn convert(&mut self, frame: &Frame) -> Result<RgbImage, VideoError> {
        let (fmt, w, h) = (frame.format(), frame.width(), frame.height());
        if !matches!(&self.scaler, Some((f, sw, sh, _)) if (*f, *sw, *sh) == (fmt, w, h)) {
            // BILINEAR as PyAV's default; no scaling happens, so only the colour path matters.
            let scaler =
                Scaler::get(fmt, w, h, Pixel::RGB24, w, h, Flags::BILINEAR).map_err(|e| {
                    VideoError::corrupt(format!("no RGB conversion for {fmt:?} {w}x{h}"), e)
                })?;
            self.scaler = Some((fmt, w, h, scaler));
            self.out = Frame::empty();
        }
        let (_, _, _, scaler) = self.scaler.as_mut().expect("set above");
        // SAFETY: a live swscale context; the coefficient tables are static.
        unsafe {
            let space = (*frame.as_ptr()).colorspace as i32;
            let table = ffi::sws_getCoefficients(space);
            let full = i32::from(frame.color_range() == Range::JPEG);
            ffi::sws_setColorspaceDetails(
                scaler.as_mut_ptr(),
                table,
                full,
                ffi::sws_getCoefficients(ffi::SWS_CS_DEFAULT),
                1,
                0,
                1 << 16,
                1 << 16,
            );
        }
        scaler
            .run(frame, &mut self.out)
            .map_err(|e| VideoError::corrupt("converting a frame to RGB", e))?;
        let stride = self.out.stride(0);
        let data = self.out.data(0);
        let row = w as usize * 3;
        let mut rgb = Vec::with_capacity(row * h as usize);
        for y in 0..h as usize {
            rgb.extend_from_slice(&data[y * stride..y * stride + row]);
        }
        let img = RgbImage::from_raw(w, h, rgb).expect("w*h*3 bytes");
        Ok(match self.rotation {
            90 => image::imageops::rotate90(&img),
            180 => image::imageops::rotate180(&img),
            270 => image::imageops::rotate270(&img),
            _ => img,
        })
    }
}
