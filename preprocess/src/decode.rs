//! Image bytes -> 8-bit RGB, the way the reference sees the image: decoded by format, first frame
//! of an animation, transparency composited onto white (transformers `convert_to_rgb`:
//! `PIL.Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")`).
//!
//! Decompression bombs are refused from the header, before any pixel is decoded.
use crate::error::{PreprocessError, Result};
use image::{DynamicImage, ImageError, ImageFormat, ImageReader, Limits, RgbImage};
use std::io::Cursor;

/// The formats this build decodes.
const SUPPORTED: &[ImageFormat] = &[
    ImageFormat::Png,
    ImageFormat::Jpeg,
    ImageFormat::WebP,
    ImageFormat::Gif,
];
const SUPPORTED_NAMES: &str = "PNG, JPEG, WebP, GIF";

/// A reader positioned on `bytes` whose format is one of [`SUPPORTED`]; a JPEG must be whole
/// (a truncated one would decode to a partly gray image).
fn reader(bytes: &[u8]) -> Result<(ImageReader<Cursor<&[u8]>>, ImageFormat)> {
    if bytes.is_empty() {
        return Err(PreprocessError::invalid("image data is empty"));
    }
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| PreprocessError::invalid(format!("cannot read the image: {e}")))?;
    match reader.format() {
        Some(ImageFormat::Jpeg) => {
            crate::jpeg_complete::check(bytes)
                .map_err(|e| PreprocessError::invalid(format!("corrupt Jpeg image: {e}")))?;
            Ok((reader, ImageFormat::Jpeg))
        }
        Some(f) if SUPPORTED.contains(&f) => Ok((reader, f)),
        Some(f) => Err(PreprocessError::invalid(format!(
            "unsupported image format {f:?} (supported: {SUPPORTED_NAMES})"
        ))),
        None => Err(PreprocessError::invalid(format!(
            "unrecognised image format: the data is not {SUPPORTED_NAMES}"
        ))),
    }
}

fn header_error(format: ImageFormat, e: ImageError) -> PreprocessError {
    PreprocessError::invalid(format!(
        "corrupt {format:?} image: cannot read its header: {e}"
    ))
}

/// (width, height) from the image header only; no pixel is decoded.
pub fn read_image_size(bytes: &[u8]) -> Result<(u32, u32)> {
    let (reader, format) = reader(bytes)?;
    reader
        .into_dimensions()
        .map_err(|e| header_error(format, e))
}

/// Decodes PNG/JPEG/WebP/GIF (first frame) to RGB, compositing transparency onto white as the
/// reference processor does. Images over `max_decode_pixels` (width * height, from the header)
/// are refused before decoding.
pub fn decode_image(bytes: &[u8], max_decode_pixels: u64) -> Result<RgbImage> {
    let (reader, format) = reader(bytes)?;
    let (width, height) = reader
        .into_dimensions()
        .map_err(|e| header_error(format, e))?;
    let pixels = width as u64 * height as u64;
    if pixels > max_decode_pixels {
        return Err(PreprocessError::invalid(format!(
            "image is {width}x{height} = {pixels} pixels, over the decode limit of {max_decode_pixels} pixels"
        )));
    }
    if pixels == 0 {
        return Err(PreprocessError::invalid(format!(
            "image is {width}x{height}: it has no pixels"
        )));
    }
    // Second line of defence: the decoder itself refuses larger frames and allocations (a
    // header can lie about frame sizes in GIF/WebP). 16-bit RGBA is 8 bytes per pixel.
    let mut limits = Limits::default();
    limits.max_image_width = Some(width);
    limits.max_image_height = Some(height);
    limits.max_alloc = Some(pixels.saturating_mul(8).saturating_add(64 << 20));
    let (mut reader, _) = self::reader(bytes)?;
    reader.limits(limits);
    let image = reader.decode().map_err(|e| match e {
        ImageError::Limits(l) => PreprocessError::invalid(format!(
            "{format:?} image {width}x{height} exceeds the decoder limits: {l}"
        )),
        ImageError::Unsupported(u) => {
            PreprocessError::invalid(format!("unsupported {format:?} image: {u}"))
        }
        other => PreprocessError::invalid(format!("corrupt {format:?} image: {other}")),
    })?;
    Ok(to_rgb_on_white(image))
}

/// transformers `convert_to_rgb`: an image with alpha is composited onto opaque white, other
/// images are converted to RGB.
pub fn to_rgb_on_white(image: DynamicImage) -> RgbImage {
    if !image.color().has_alpha() {
        return match image {
            DynamicImage::ImageRgb8(rgb) => rgb,
            other => other.to_rgb8(),
        };
    }
    let rgba = image.to_rgba8();
    let (w, h) = rgba.dimensions();
    let mut out = Vec::with_capacity(w as usize * h as usize * 3);
    for px in rgba.as_raw().chunks_exact(4) {
        let a = px[3];
        out.extend_from_slice(&[
            over_white(px[0], a),
            over_white(px[1], a),
            over_white(px[2], a),
        ]);
    }
    // The buffer holds exactly w*h*3 bytes, so from_raw cannot fail; fall back to white.
    RgbImage::from_raw(w, h, out)
        .unwrap_or_else(|| RgbImage::from_pixel(w, h, image::Rgb([255; 3])))
}

/// One channel of Pillow's `alpha_composite(dst=opaque white, src=(c, a))`, in Pillow's integer
/// arithmetic (libImaging/AlphaComposite.c, PRECISION_BITS = 7). With an opaque destination
/// `outa255 = 255*255`, so `coef1 = a*128` and `coef2 = (255-a)*128` exactly. Checked against
/// Pillow for all 65536 (c, a) pairs.
#[inline]
pub fn over_white(c: u8, a: u8) -> u8 {
    if a == 0 {
        return 255;
    }
    let (c, a) = (c as u32, a as u32);
    let tmp = c * a * 128 + 255 * (255 - a) * 128 + (0x80 << 7);
    // SHIFTFORDIV255(x) = ((x >> 8) + x) >> 8, then drop the precision bits.
    ((((tmp >> 8) + tmp) >> 8) >> 7) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn over_white_extremes() {
        for c in 0..=255u8 {
            assert_eq!(over_white(c, 255), c);
            assert_eq!(over_white(c, 0), 255);
        }
        // Spot values computed with Pillow 12 alpha_composite onto white.
        let got: Vec<u8> = [
            (0, 128),
            (10, 128),
            (200, 128),
            (7, 1),
            (250, 254),
            (3, 254),
            (99, 254),
        ]
        .iter()
        .map(|&(c, a)| over_white(c, a))
        .collect();
        assert_eq!(got, [127, 132, 227, 254, 250, 4, 100]);
    }

    #[test]
    fn truncated_images_are_refused_in_every_format() {
        let img =
            image::RgbImage::from_fn(64, 48, |x, y| image::Rgb([x as u8 * 3, y as u8 * 5, 90]));
        for format in SUPPORTED {
            let mut out = Cursor::new(Vec::new());
            img.write_to(&mut out, *format).unwrap();
            let whole = out.into_inner();
            decode_image(&whole, 1 << 20).unwrap();
            // Pixel data cut short; for JPEG also a missing end-of-image marker (other
            // formats' trailers after the pixel data, like PNG's IEND, are not needed).
            let mut cuts = vec![whole.len() / 2, whole.len() * 6 / 10];
            if *format == ImageFormat::Jpeg {
                cuts.push(whole.len() - 1);
            }
            for keep in cuts {
                let e = decode_image(&whole[..keep], 1 << 20);
                assert!(
                    e.is_err(),
                    "{format:?} cut to {keep} of {} bytes decoded",
                    whole.len()
                );
            }
        }
        // A JPEG is refused from its markers alone, before decoding, with the reason.
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, ImageFormat::Jpeg).unwrap();
        let j = out.into_inner();
        let e = read_image_size(&j[..j.len() / 2]).unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");
    }
}
