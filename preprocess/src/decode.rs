//! Image bytes -> 8-bit RGB, the way the reference sees the image: decoded by format, first frame
//! of an animation, transparency composited onto white (transformers `convert_to_rgb`:
//! `PIL.Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")`).
//!
//! The EXIF orientation (JPEG, WebP, PNG `eXIf`) is applied, as vLLM's image loader and
//! transformers' `load_image` do with `PIL.ImageOps.exif_transpose`: a portrait phone photo
//! stored sideways reaches the model upright, and its size is the displayed one.
//!
//! AVIF goes through FFmpeg (its MP4 demuxer and libdav1d, the video path's libraries): the
//! `image` crate's AVIF decoder binds dav1d >= 1.3, where Debian 12 ships 1.0. Colour as
//! swscale converts it (lossless AVIF: the source pixels exactly; 4:4:4 within 1 of libavif's
//! `avifdec`, 4:2:0 within 7: the chroma upsampling differs). An AVIF's alpha plane (an
//! auxiliary item) is not read: its pixels are taken as they are stored, not onto white.
//!
//! Decompression bombs are refused from the header, before any pixel is decoded.
use crate::error::{PreprocessError, Result};
use crate::video_file::{decode_video, read_video_info, DecodeLimits, VideoError};
use image::metadata::Orientation;
use image::{DynamicImage, ImageDecoder, ImageError, ImageFormat, ImageReader, Limits, RgbImage};
use std::io::Cursor;

/// The formats this build decodes.
const SUPPORTED: &[ImageFormat] = &[
    ImageFormat::Png,
    ImageFormat::Jpeg,
    ImageFormat::WebP,
    ImageFormat::Gif,
    ImageFormat::Bmp,
    ImageFormat::Tiff,
];
const SUPPORTED_NAMES: &str = "PNG, JPEG, WebP, GIF, BMP, TIFF, AVIF";

/// Whether `bytes` start as an AVIF file: an ISOBMFF `ftyp` box whose major or compatible
/// brands include `avif` (a still) or `avis` (a sequence: its first frame is taken).
pub(crate) fn is_avif(bytes: &[u8]) -> bool {
    let Some(size) = bytes
        .get(..4)
        .map(|b| u32::from_be_bytes(b.try_into().unwrap()) as usize)
    else {
        return false;
    };
    if bytes.get(4..8) != Some(b"ftyp") || size < 16 || size > bytes.len() {
        return false;
    }
    let brand = |b: &[u8]| b == b"avif" || b == b"avis";
    brand(&bytes[8..12]) || bytes[16..size].chunks_exact(4).any(brand)
}

/// An AVIF's (width, height), from FFmpeg's reading of its header (nothing decoded).
fn avif_size(bytes: &[u8]) -> Result<(u32, u32)> {
    let info = read_video_info(bytes)
        .map_err(|e| PreprocessError::invalid(format!("corrupt Avif image: {e}")))?;
    Ok((info.width, info.height))
}

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

/// Whether `o` turns the image a quarter (width and height trade places).
fn swaps_sides(o: Orientation) -> bool {
    matches!(
        o,
        Orientation::Rotate90
            | Orientation::Rotate270
            | Orientation::Rotate90FlipH
            | Orientation::Rotate270FlipH
    )
}

/// The stored (width, height) and the EXIF orientation from the header; no pixel is decoded.
/// An unreadable EXIF block counts as no orientation (PIL's `exif_transpose` too ignores it).
fn header(decoder: &mut impl ImageDecoder) -> ((u32, u32), Orientation) {
    let dims = decoder.dimensions();
    let orientation = decoder.orientation().unwrap_or(Orientation::NoTransforms);
    (dims, orientation)
}

/// (width, height) as displayed (after the EXIF orientation), from the image header only; no
/// pixel is decoded.
pub fn read_image_size(bytes: &[u8]) -> Result<(u32, u32)> {
    if is_avif(bytes) {
        return avif_size(bytes);
    }
    let (reader, format) = reader(bytes)?;
    let mut decoder = reader.into_decoder().map_err(|e| header_error(format, e))?;
    let ((w, h), o) = header(&mut decoder);
    Ok(if swaps_sides(o) { (h, w) } else { (w, h) })
}

/// Decodes PNG/JPEG/WebP/GIF/BMP/TIFF/AVIF (first frame) to RGB, compositing transparency onto
/// white as the reference processor does. Images over `max_decode_pixels` (width * height,
/// from the header) are refused before decoding.
pub fn decode_image(bytes: &[u8], max_decode_pixels: u64) -> Result<RgbImage> {
    if is_avif(bytes) {
        // One open: the video path checks the header's size against the limit before decoding
        // (libavcodec's `max_pixels` then holds every picture), and bounds the demuxing by its
        // packet and time budget.
        let limits = DecodeLimits::new(max_decode_pixels);
        let mut frames = decode_video(bytes, &[0], &limits)
            .map_err(|e| match e {
                VideoError::TooManyPixels {
                    width,
                    height,
                    pixels,
                    limit,
                } => over_limit(width, height, pixels, limit),
                e => PreprocessError::invalid(format!("corrupt Avif image: {e}")),
            })?
            .frames;
        return frames
            .pop()
            .ok_or_else(|| PreprocessError::invalid("corrupt Avif image: no picture decoded"));
    }
    let (reader, format) = reader(bytes)?;
    let (width, height) = reader
        .into_dimensions()
        .map_err(|e| header_error(format, e))?;
    let pixels = check_pixels(width, height, max_decode_pixels)?;
    // Second line of defence: the decoder itself refuses larger frames and allocations (a
    // header can lie about frame sizes in GIF/WebP). 16-bit RGBA is 8 bytes per pixel.
    let mut limits = Limits::default();
    limits.max_image_width = Some(width);
    limits.max_image_height = Some(height);
    limits.max_alloc = Some(pixels.saturating_mul(8).saturating_add(64 << 20));
    let (mut reader, _) = self::reader(bytes)?;
    reader.limits(limits.clone());
    let decoded = reader.into_decoder().and_then(|mut decoder| {
        let (_, orientation) = header(&mut decoder);
        // What `ImageReader::decode` checks before allocating the frame.
        limits.reserve(decoder.total_bytes())?;
        let mut image = DynamicImage::from_decoder(decoder)?;
        image.apply_orientation(orientation);
        Ok(image)
    });
    let image = decoded.map_err(|e| match e {
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

fn over_limit(width: u32, height: u32, pixels: u64, limit: u64) -> PreprocessError {
    PreprocessError::invalid(format!(
        "image is {width}x{height} = {pixels} pixels, over the decode limit of {limit} pixels"
    ))
}

/// width * height, refused over `max_decode_pixels` or at zero.
fn check_pixels(width: u32, height: u32, max_decode_pixels: u64) -> Result<u64> {
    let pixels = width as u64 * height as u64;
    if pixels > max_decode_pixels {
        return Err(over_limit(width, height, pixels, max_decode_pixels));
    }
    if pixels == 0 {
        return Err(PreprocessError::invalid(format!(
            "image is {width}x{height}: it has no pixels"
        )));
    }
    Ok(pixels)
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
    fn exif_orientation_turns_the_image_upright() {
        // 40x20: left half red, right half blue.
        let img = image::RgbImage::from_fn(40, 20, |x, _| {
            if x < 20 {
                image::Rgb([230, 20, 20])
            } else {
                image::Rgb([20, 20, 230])
            }
        });
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, ImageFormat::Jpeg).unwrap();
        let plain = out.into_inner();
        let red = |p: &image::Rgb<u8>| p[0] > 150 && p[2] < 100;
        let blue = |p: &image::Rgb<u8>| p[2] > 150 && p[0] < 100;
        // Orientation 1 (as stored) changes nothing.
        let one = vlm_test_support::exif::with_exif_orientation(&plain, 1);
        assert_eq!(read_image_size(&one).unwrap(), (40, 20));
        let d = decode_image(&one, 1 << 20).unwrap();
        assert!(red(d.get_pixel(5, 10)) && blue(d.get_pixel(35, 10)));
        // 6: stored turned left, shown turned 90 degrees clockwise: 20x40, red on top.
        let six = vlm_test_support::exif::with_exif_orientation(&plain, 6);
        assert_eq!(read_image_size(&six).unwrap(), (20, 40));
        let d = decode_image(&six, 1 << 20).unwrap();
        assert_eq!(d.dimensions(), (20, 40));
        assert!(red(d.get_pixel(10, 5)), "{:?}", d.get_pixel(10, 5));
        assert!(blue(d.get_pixel(10, 35)), "{:?}", d.get_pixel(10, 35));
        // 8: turned the other way: blue on top.
        let eight = vlm_test_support::exif::with_exif_orientation(&plain, 8);
        let d = decode_image(&eight, 1 << 20).unwrap();
        assert_eq!(d.dimensions(), (20, 40));
        assert!(blue(d.get_pixel(10, 5)) && red(d.get_pixel(10, 35)));
        // 3: upside down: blue on the left.
        let d = decode_image(
            &vlm_test_support::exif::with_exif_orientation(&plain, 3),
            1 << 20,
        )
        .unwrap();
        assert!(blue(d.get_pixel(5, 10)) && red(d.get_pixel(35, 10)));
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
