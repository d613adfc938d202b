//! Bicubic resize on 8-bit RGB, matching the reference processor's PIL backend
//! (`Qwen2VLImageProcessorPil.resize` -> `PIL.Image.resize(size, BICUBIC)`, reducing_gap None).
//!
//! fast_image_resize's `Convolution(CatmullRom)` is a port of Pillow's resampler: the same
//! cubic kernel (a = -0.5), the same support widening when downscaling (antialias), separable
//! horizontal then vertical passes on u8 with fixed-point coefficients.
use crate::error::{ModelError, Result};
use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};
use image::RgbImage;

/// Resizes `src` to `width` x `height` with Pillow's BICUBIC filter.
pub fn resize_bicubic(src: &RgbImage, width: u32, height: u32) -> Result<RgbImage> {
    if width == 0 || height == 0 {
        return Err(ModelError::invalid(format!("cannot resize an image to {width}x{height}")));
    }
    if src.dimensions() == (width, height) {
        // Pillow returns a copy when the size does not change.
        return Ok(src.clone());
    }
    let (sw, sh) = src.dimensions();
    let fail = |e: &dyn std::fmt::Display| {
        ModelError::invalid(format!("resizing {sw}x{sh} to {width}x{height} failed: {e}"))
    };
    let src_view = ImageRef::new(sw, sh, src.as_raw(), PixelType::U8x3).map_err(|e| fail(&e))?;
    let mut dst = Image::new(width, height, PixelType::U8x3);
    let options = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::CatmullRom));
    Resizer::new().resize(&src_view, &mut dst, &options).map_err(|e| fail(&e))?;
    RgbImage::from_raw(width, height, dst.into_vec())
        .ok_or_else(|| fail(&"destination buffer has the wrong size"))
}
