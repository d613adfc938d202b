//! Image preprocessing, on the host (no tensor library), as the reference processor does it (`Qwen2VLImageProcessorPil` with
//! Qwen3-VL's `preprocessor_config.json`): decode, `convert_to_rgb` (alpha onto white),
//! `smart_resize`, Pillow BICUBIC resize on u8, `x/255`, `(x-0.5)/0.5`, patchify in merge-block
//! order with the frame repeated `temporal_patch_size` times.
//!
//! The reference's other backend (torchvision, a=-0.75 antialiased bicubic) differs from the
//! PIL backend by up to 2/127.5 per value; this module matches the PIL backend.
mod decode;
mod error;
mod jpeg_complete;
mod patchify;
mod resize;
mod video_file;
pub mod worker;

pub use decode::{decode_image, over_white, read_image_size, to_rgb_on_white};
pub use error::{PreprocessError, Result};
pub use patchify::{normalize_u8, patchify, patchify_frames};
pub use resize::resize_bicubic;
pub use video_file::*;

pub use image::RgbImage;
pub use vlm_compute::PixelValues;
use vlm_config::geometry::{self, smart_resize};

/// Processor settings. Defaults are Qwen3-VL's.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct PreprocessConfig {
    /// `size.shortest_edge`: smaller images are scaled up to at least this many pixels.
    pub min_pixels: u64,
    /// `size.longest_edge`: larger images are scaled down to at most this many pixels.
    pub max_pixels: u64,
    pub patch_size: usize,
    pub merge_size: usize,
    pub temporal_patch_size: usize,
    /// Images whose header says more pixels than this are refused before decoding.
    pub max_decode_pixels: u64,
}

/// 8192 x 8192: a decoded RGBA frame of at most 256 MiB.
pub const DEFAULT_MAX_DECODE_PIXELS: u64 = 8192 * 8192;

impl Default for PreprocessConfig {
    fn default() -> Self {
        PreprocessConfig {
            min_pixels: geometry::DEFAULT_MIN_PIXELS,
            max_pixels: geometry::DEFAULT_MAX_PIXELS,
            patch_size: geometry::PATCH_SIZE as usize,
            merge_size: geometry::MERGE_SIZE as usize,
            temporal_patch_size: geometry::TEMPORAL_PATCH_SIZE as usize,
            max_decode_pixels: DEFAULT_MAX_DECODE_PIXELS,
        }
    }
}

impl PreprocessConfig {
    /// The resize factor: both sides become multiples of patch * merge (32).
    pub fn factor(&self) -> u32 {
        (self.patch_size * self.merge_size) as u32
    }

    /// Width of one `pixel_values` row: 3 * T * P * P (1536).
    pub fn patch_dim(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// (width, height) after `smart_resize` of a `width` x `height` image.
    pub fn target_size(&self, width: u32, height: u32) -> Result<(u32, u32)> {
        let (h, w) = smart_resize(
            height,
            width,
            self.factor(),
            self.min_pixels,
            self.max_pixels,
        )
        .map_err(|e| PreprocessError::invalid(e.to_string()))?;
        Ok((w, h))
    }

    /// Raw patches (the ViT bucket unit) of a `width` x `height` image after the resize.
    pub fn patches_for(&self, width: u32, height: u32) -> Result<usize> {
        let (w, h) = self.target_size(width, height)?;
        Ok((w as usize / self.patch_size) * (h as usize / self.patch_size))
    }

    /// The settings for `oversize: downscale`: `max_pixels` lowered to
    /// `max_patches * patch^2` (and `min_pixels` with it), so that `smart_resize` keeps the
    /// aspect ratio and yields at most `max_patches` raw patches.
    pub fn capped_to_patches(&self, max_patches: usize) -> PreprocessConfig {
        let cap = max_patches as u64 * (self.patch_size * self.patch_size) as u64;
        PreprocessConfig {
            max_pixels: self.max_pixels.min(cap),
            min_pixels: self.min_pixels.min(cap),
            ..self.clone()
        }
    }

    fn validate(&self) -> Result<()> {
        if self.patch_size == 0 || self.merge_size == 0 || self.temporal_patch_size == 0 {
            return Err(PreprocessError::invalid(format!(
                "preprocess config: patch_size {}, merge_size {} and temporal_patch_size {} must be positive",
                self.patch_size, self.merge_size, self.temporal_patch_size
            )));
        }
        Ok(())
    }
}

/// (width, height) for `oversize: downscale`: the image resized keeping its aspect ratio so that
/// it has at most `max_patches` raw patches. An error when even the smallest grid the resize
/// can make (one merge block per side) is over the limit.
pub fn downscale_target(
    width: u32,
    height: u32,
    cfg: &PreprocessConfig,
    max_patches: usize,
) -> Result<(u32, u32)> {
    let capped = cfg.capped_to_patches(max_patches);
    let patches_of =
        |(w, h): (u32, u32)| (w as usize / cfg.patch_size) * (h as usize / cfg.patch_size);
    let mut size = capped.target_size(width, height)?;
    if patches_of(size) > max_patches {
        // The upscale branch rounds each side up and can overshoot: do not upscale at all.
        size = PreprocessConfig {
            min_pixels: 0,
            ..capped
        }
        .target_size(width, height)?;
    }
    let (w, h) = size;
    let patches = patches_of(size);
    if patches > max_patches {
        return Err(PreprocessError::invalid(format!(
            "image {width}x{height} cannot be downscaled to at most {max_patches} patches \
             (the smallest resize keeping its aspect ratio is {w}x{h} = {patches} patches)"
        )));
    }
    Ok((w, h))
}

/// smart_resize + bicubic resize + normalize + patchify of an RGB image.
pub fn preprocess_rgb(img: &RgbImage, cfg: &PreprocessConfig) -> Result<PixelValues> {
    cfg.validate()?;
    let (w, h) = cfg.target_size(img.width(), img.height())?;
    let resized = resize_bicubic(img, w, h)?;
    preprocess_resized(&resized, cfg)
}

/// Normalize + patchify of an image the caller already resized (sides multiples of
/// patch * merge).
pub fn preprocess_resized(img: &RgbImage, cfg: &PreprocessConfig) -> Result<PixelValues> {
    cfg.validate()?;
    let (w, h) = img.dimensions();
    let f = cfg.factor();
    if w == 0 || h == 0 || w % f != 0 || h % f != 0 {
        return Err(PreprocessError::invalid(format!(
            "resized image is {w}x{h}; both sides must be positive multiples of {f} (patch {} x merge {})",
            cfg.patch_size, cfg.merge_size
        )));
    }
    let (values, rows, cols) =
        patchify(img, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size);
    debug_assert_eq!(values.len(), rows * cols);
    Ok(PixelValues {
        values,
        grid_thw: [1, h as usize / cfg.patch_size, w as usize / cfg.patch_size],
    })
}

/// Normalize + patchify of one temporal group of a video: `temporal_patch_size` frames the
/// caller already resized, all the same size (`Qwen3VLVideoProcessor.patchify` for one group;
/// the grid is `[1, h, w]`, as `get_rope_index` splits a video into its groups).
pub fn preprocess_video_group(frames: &[&RgbImage], cfg: &PreprocessConfig) -> Result<PixelValues> {
    cfg.validate()?;
    if frames.len() != cfg.temporal_patch_size {
        return Err(PreprocessError::invalid(format!(
            "a temporal group has {} frames; it takes {} (temporal_patch_size)",
            frames.len(),
            cfg.temporal_patch_size
        )));
    }
    let (w, h) = frames[0].dimensions();
    if let Some(f) = frames.iter().find(|f| f.dimensions() != (w, h)) {
        return Err(PreprocessError::invalid(format!(
            "the frames of a temporal group differ in size: {w}x{h} and {}x{}",
            f.width(),
            f.height()
        )));
    }
    let f = cfg.factor();
    if w == 0 || h == 0 || w % f != 0 || h % f != 0 {
        return Err(PreprocessError::invalid(format!(
            "resized frames are {w}x{h}; both sides must be positive multiples of {f} (patch {} x merge {})",
            cfg.patch_size, cfg.merge_size
        )));
    }
    let (values, _, _) = patchify_frames(frames, cfg.patch_size, cfg.merge_size);
    Ok(PixelValues {
        values,
        grid_thw: [1, h as usize / cfg.patch_size, w as usize / cfg.patch_size],
    })
}

/// A video's sampled frames resized to `width` x `height` (each like an image, Pillow's
/// bicubic) and paired into temporal groups of two, an odd last frame repeated
/// (`Qwen3VLVideoProcessor.patchify` pads so). Each pair feeds [`preprocess_video_group`].
pub fn temporal_groups(
    frames: &[RgbImage],
    width: u32,
    height: u32,
) -> Result<Vec<(RgbImage, RgbImage)>> {
    let mut resized = frames.iter().map(|f| resize_bicubic(f, width, height));
    let mut groups = Vec::with_capacity(frames.len().div_ceil(2));
    while let Some(a) = resized.next() {
        let a = a?;
        let b = match resized.next() {
            Some(b) => b?,
            None => a.clone(),
        };
        groups.push((a, b));
    }
    Ok(groups)
}

/// [`preprocess_rgb`] for `oversize: downscale`: the image is resized (keeping its aspect
/// ratio) to at most `max_patches` raw patches, see [`downscale_target`].
pub fn preprocess_rgb_within(
    img: &RgbImage,
    cfg: &PreprocessConfig,
    max_patches: usize,
) -> Result<PixelValues> {
    cfg.validate()?;
    let (w, h) = downscale_target(img.width(), img.height(), cfg, max_patches)?;
    let resized = resize_bicubic(img, w, h)?;
    preprocess_resized(&resized, cfg)
}

/// decode + [`preprocess_rgb`].
pub fn preprocess_bytes(bytes: &[u8], cfg: &PreprocessConfig) -> Result<PixelValues> {
    let img = decode_image(bytes, cfg.max_decode_pixels)?;
    preprocess_rgb(&img, cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downscale_keeps_under_the_patch_limit() {
        let cfg = PreprocessConfig::default();
        // 2048x2048 -> 16384 patches; capped at 4096 -> 1024x1024.
        assert_eq!(cfg.patches_for(2048, 2048).unwrap(), 16384);
        assert_eq!(
            downscale_target(2048, 2048, &cfg, 4096).unwrap(),
            (1024, 1024)
        );
        let (w, h) = downscale_target(3000, 1000, &cfg, 1024).unwrap();
        assert!((w as usize / 16) * (h as usize / 16) <= 1024, "{w}x{h}");
        assert!(w > h);
        // Small images are not scaled up past the limit either.
        let (w, h) = downscale_target(100, 75, &cfg, 64).unwrap();
        assert!((w as usize / 16) * (h as usize / 16) <= 64, "{w}x{h}");
    }

    #[test]
    fn preprocess_within_a_patch_budget() {
        let img = RgbImage::from_fn(1000, 500, |x, y| image::Rgb([x as u8, y as u8, 7]));
        let cfg = PreprocessConfig::default();
        let full = preprocess_rgb(&img, &cfg).unwrap();
        assert_eq!(full.patches(), 62 * 32); // 992x512
        let small = preprocess_rgb_within(&img, &cfg, 1024).unwrap();
        assert!(small.patches() <= 1024, "{:?}", small.grid_thw);
        assert!(small.grid_thw[2] > small.grid_thw[1]);
    }

    #[test]
    fn preprocess_shapes() {
        let img = RgbImage::from_fn(100, 75, |x, y| image::Rgb([x as u8, y as u8, 7]));
        let pv = preprocess_rgb(&img, &PreprocessConfig::default()).unwrap();
        assert_eq!(pv.grid_thw, [1, 14, 20]); // 224x320, as the reference resizes it
        assert_eq!((pv.rows(), pv.row_len()), (280, 1536));
        let err = preprocess_resized(&img, &PreprocessConfig::default()).unwrap_err();
        assert!(err.to_string().contains("multiples of 32"), "{err}");
    }
}
