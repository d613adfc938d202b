//! Image geometry of the Qwen3-VL processor: `smart_resize`, the patch grid, the number of raw
//! patches (the unit of a ViT bucket) and of image tokens.
//!
//! Matches `smart_resize` in transformers' `models/qwen2_vl/image_processing_qwen2_vl.py`
//! (Qwen3-VL uses the Qwen2-VL processor classes with patch 16, merge 2, factor 32).

/// Qwen3-VL's processor defaults (`preprocessor_config.json`).
pub const PATCH_SIZE: u32 = 16;
pub const MERGE_SIZE: u32 = 2;
pub const TEMPORAL_PATCH_SIZE: u32 = 2;
pub const DEFAULT_MIN_PIXELS: u64 = 65_536;
pub const DEFAULT_MAX_PIXELS: u64 = 16_777_216;
/// The reference refuses images whose long side is more than 200 times the short side.
pub const MAX_ASPECT_RATIO: f64 = 200.0;

/// Why an image size cannot be resized.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GeometryError {
    #[error("image size {width}x{height} has a zero side")]
    Empty { width: u32, height: u32 },
    #[error(
        "image size {width}x{height} has aspect ratio {ratio:.1}, over the limit of {MAX_ASPECT_RATIO}"
    )]
    AspectRatio { width: u32, height: u32, ratio: f64 },
}

/// Where an image lands after the processor's resize.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ImageGeometry {
    /// Original size.
    pub width: u32,
    pub height: u32,
    /// Size after `smart_resize` (multiples of patch * merge).
    pub resized_width: u32,
    pub resized_height: u32,
    /// `image_grid_thw`: temporal, rows and columns of raw patches.
    pub grid_t: u32,
    pub grid_h: u32,
    pub grid_w: u32,
}

impl ImageGeometry {
    /// Raw 16-px patches the ViT sees per temporal patch: (H/16)*(W/16). The ViT bucket unit.
    pub fn patches(&self) -> u64 {
        self.grid_h as u64 * self.grid_w as u64
    }
    /// Image tokens in the LM prompt: t*h*w / merge^2.
    pub fn tokens(&self) -> u64 {
        self.grid_t as u64 * self.patches() / (MERGE_SIZE * MERGE_SIZE) as u64
    }
}

/// `smart_resize(height, width, factor, min_pixels, max_pixels)` of the reference: both sides
/// rounded to multiples of `factor`, then scaled (keeping the aspect ratio) into
/// [min_pixels, max_pixels]. Returns (height, width). Python's `round` rounds ties to even.
pub fn smart_resize(
    height: u32,
    width: u32,
    factor: u32,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(u32, u32), GeometryError> {
    if height == 0 || width == 0 {
        return Err(GeometryError::Empty { width, height });
    }
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    let ratio = h.max(w) / h.min(w);
    if ratio > MAX_ASPECT_RATIO {
        return Err(GeometryError::AspectRatio {
            width,
            height,
            ratio,
        });
    }
    let mut hb = (h / f).round_ties_even() * f;
    let mut wb = (w / f).round_ties_even() * f;
    if hb * wb > max_pixels as f64 {
        let beta = (h * w / max_pixels as f64).sqrt();
        hb = f.max((h / beta / f).floor() * f);
        wb = f.max((w / beta / f).floor() * f);
    } else if hb * wb < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        hb = (h * beta / f).ceil() * f;
        wb = (w * beta / f).ceil() * f;
    }
    Ok((hb as u32, wb as u32))
}

/// The geometry of a `width`x`height` image under Qwen3-VL's processor with the given limits.
pub fn image_geometry(
    width: u32,
    height: u32,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<ImageGeometry, GeometryError> {
    let (rh, rw) = smart_resize(
        height,
        width,
        PATCH_SIZE * MERGE_SIZE,
        min_pixels,
        max_pixels,
    )?;
    Ok(ImageGeometry {
        width,
        height,
        resized_width: rw,
        resized_height: rh,
        grid_t: 1,
        grid_h: rh / PATCH_SIZE,
        grid_w: rw / PATCH_SIZE,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo(w: u32, h: u32) -> ImageGeometry {
        image_geometry(w, h, DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS).unwrap()
    }

    #[test]
    fn seed_sizes() {
        assert_eq!(geo(1024, 1024).patches(), 4096);
        assert_eq!(geo(1024, 1024).tokens(), 1024);
        assert_eq!(geo(2048, 2048).patches(), 16384);
        assert_eq!(geo(4096, 4096).patches(), 65536);
        assert_eq!(geo(1792, 1792).patches(), 12544);
    }

    #[test]
    fn small_images_are_upscaled_to_min_pixels() {
        // 100x75 -> rounds to 96x64 (6144 px) < 65536 -> scaled up, keeping the aspect ratio.
        let g = geo(100, 75);
        assert!(g.resized_width as u64 * g.resized_height as u64 >= DEFAULT_MIN_PIXELS);
        assert_eq!((g.resized_width, g.resized_height), (320, 224));
    }

    #[test]
    fn python_round_ties_to_even() {
        // 48/32 = 1.5 -> 2 (even), 80/32 = 2.5 -> 2 (even); with min_pixels 0 nothing rescales.
        assert_eq!(smart_resize(48, 80, 32, 0, u64::MAX).unwrap(), (64, 64));
    }

    #[test]
    fn refuses_extreme_aspect_ratio() {
        let err = smart_resize(1, 300, 32, DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS).unwrap_err();
        assert!(err.to_string().contains("aspect ratio"), "{err}");
    }
}
