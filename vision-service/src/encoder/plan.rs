//! The cheap checks done on the caller's task before an image takes a queue slot: format and
//! size from the header (nothing decoded), the decode limit, where the image lands
//! (`visual.plan_image`: resize, bucket, `oversize`), and the caller's expected grid. The
//! expensive part (decode, resize, normalize, patchify) runs later on a compute thread
//! ([`PlannedImage::pixel_values`]).
use super::request::{ImageInput, ImageSource};
use crate::error::VisionError;
use image::RgbImage;
use std::sync::Arc;
use vlm_config::VisualConfig;
use vlm_preprocess::worker::MediaDecoding;
use vlm_preprocess::{self as preprocess, PixelValues, PreprocessConfig, PreprocessError};

/// Declared types that say nothing of the format: like an empty one, the format is detected
/// from the bytes (what vLLM's loader does with any type).
const UNTYPED_MIME: &[&str] = &["application/octet-stream", "binary/octet-stream"];

/// MIME types a caller may declare (an empty one means: detect from the bytes).
const SUPPORTED_MIME: &[&str] = &[
    "image/png",
    "image/jpeg",
    "image/jpg",
    "image/webp",
    "image/gif",
    "image/bmp",
    "image/x-ms-bmp",
    "image/tiff",
    "image/avif",
];

/// What every image is checked against.
#[derive(Debug, Clone)]
pub struct Limits {
    pub visual: VisualConfig,
    /// Header width * height above which an image is refused before decoding.
    pub max_decode_pixels: u64,
    pub preprocess: PreprocessConfig,
    /// Where FFmpeg parses AVIF images (`--media-decoding`); other formats decode in process.
    pub decoding: MediaDecoding,
}

impl Limits {
    pub fn new(visual: VisualConfig, max_decode_pixels: u64) -> Limits {
        let preprocess = PreprocessConfig {
            min_pixels: visual.min_pixels,
            max_pixels: visual.max_pixels,
            max_decode_pixels,
            ..PreprocessConfig::default()
        };
        Limits {
            visual,
            max_decode_pixels,
            preprocess,
            decoding: MediaDecoding::InProcess,
        }
    }
}

/// The pixels of an image that passed the checks.
#[derive(Debug, Clone)]
enum Pixels {
    /// Decode, then resize to `target` (width, height).
    Encoded { data: Vec<u8>, target: (u32, u32) },
    /// Already at its final size; a video temporal group also has its second frame.
    Resized(RgbImage, Option<RgbImage>),
}

/// An image that passed the checks: where it lands and how to get its pixel values.
#[derive(Debug, Clone)]
pub struct PlannedImage {
    pub index: usize,
    pub content_hash: Arc<Vec<u8>>,
    /// (t, h, w) in raw patches after the resize.
    pub grid: [u32; 3],
    /// The ViT bucket it will run in.
    pub bucket: u32,
    /// True when `oversize: downscale` shrank it to fit the largest bucket.
    pub downscaled: bool,
    pixels: Pixels,
}

/// The message of a preprocessing error about the caller's input, without the "invalid
/// input:" prefix.
fn input_message(e: PreprocessError) -> String {
    e.0
}

/// Checks image `index` of a request and plans it.
pub fn plan(index: usize, input: ImageInput, limits: &Limits) -> Result<PlannedImage, VisionError> {
    let patch = limits.preprocess.patch_size as u32;
    let (pixels, grid, bucket, downscaled) = match input.source {
        ImageSource::Encoded { data, mime_type } => {
            let mime = mime_type.trim().to_ascii_lowercase();
            let untyped = mime.is_empty() || UNTYPED_MIME.contains(&mime.as_str());
            if !untyped && !SUPPORTED_MIME.contains(&mime.as_str()) {
                return Err(VisionError::invalid(
                    index,
                    format!(
                        "unsupported image format {mime_type:?} (supported: {})",
                        SUPPORTED_MIME.join(", ")
                    ),
                ));
            }
            let (width, height) = preprocess::worker::read_image_size(&limits.decoding, &data)
                .map_err(|e| VisionError::invalid(index, input_message(e)))?;
            let pixels = width as u64 * height as u64;
            if pixels > limits.max_decode_pixels {
                return Err(VisionError::invalid(
                    index,
                    format!(
                        "image is {width}x{height} = {pixels} pixels, over the decode limit of {} pixels",
                        limits.max_decode_pixels
                    ),
                ));
            }
            let planned = limits
                .visual
                .plan_image_within(width, height, input.budget)
                .map_err(|e| VisionError::invalid(index, format!("image {width}x{height}: {e}")))?;
            let g = planned.geometry;
            let grid = [g.grid_t, g.grid_h, g.grid_w];
            let target = (g.resized_width, g.resized_height);
            (
                Pixels::Encoded { data, target },
                grid,
                planned.bucket,
                planned.downscaled,
            )
        }
        ImageSource::Pixels {
            width,
            height,
            rgb8,
            second_frame,
        } => {
            let factor = limits.preprocess.factor();
            if width == 0 || height == 0 || width % factor != 0 || height % factor != 0 {
                return Err(VisionError::invalid(
                    index,
                    format!("resized pixels are {width}x{height}; both sides must be positive multiples of {factor}"),
                ));
            }
            let want = width as u64 * height as u64 * 3;
            if rgb8.len() as u64 != want {
                return Err(VisionError::invalid(
                    index,
                    format!(
                        "resized pixels {width}x{height} need {want} RGB8 bytes, got {}",
                        rgb8.len()
                    ),
                ));
            }
            let patches = (width / patch) as u64 * (height / patch) as u64;
            let bucket = limits.visual.bucket_for(patches).map_err(|_| {
                VisionError::invalid(
                    index,
                    format!(
                        "resized pixels {width}x{height} = {patches} patches, over the largest ViT bucket of {} patches \
                         (already-resized pixels are never downscaled)",
                        limits.visual.largest_bucket()
                    ),
                )
            })?;
            if !second_frame.is_empty() && second_frame.len() as u64 != want {
                return Err(VisionError::invalid(
                    index,
                    format!(
                        "the second frame of a {width}x{height} temporal group needs {want} RGB8 bytes, got {}",
                        second_frame.len()
                    ),
                ));
            }
            let frame = |bytes: Vec<u8>| {
                RgbImage::from_raw(width, height, bytes).ok_or_else(|| {
                    VisionError::invalid(index, "resized pixels do not fill the image")
                })
            };
            let img = frame(rgb8)?;
            let second = match second_frame.is_empty() {
                true => None,
                false => Some(frame(second_frame)?),
            };
            (
                Pixels::Resized(img, second),
                [1, height / patch, width / patch],
                bucket,
                false,
            )
        }
    };
    if let Some(expected) = input.expected_grid.filter(|g| *g != [0, 0, 0]) {
        if expected != grid {
            return Err(VisionError::invalid(
                index,
                format!("expected grid (t, h, w) = {expected:?} but the image resizes to {grid:?} (bucket {bucket})"),
            ));
        }
    }
    Ok(PlannedImage {
        index,
        content_hash: Arc::new(input.content_hash),
        grid,
        bucket,
        downscaled,
        pixels,
    })
}

impl PlannedImage {
    /// `video` for a video temporal group (two frames), else `image`: the metrics label.
    pub fn kind(&self) -> &'static str {
        match self.pixels {
            Pixels::Resized(_, Some(_)) => "video",
            _ => "image",
        }
    }

    /// The embedding cache's key: the input's bytes and what the service does with them (the
    /// resize target of a file; the frames of resized pixels).
    pub fn cache_key(&self) -> super::cache::Key {
        use super::cache::key;
        match &self.pixels {
            Pixels::Encoded { data, target } => key(&[
                b"encoded",
                data,
                &target.0.to_le_bytes(),
                &target.1.to_le_bytes(),
            ]),
            Pixels::Resized(first, second) => key(&[
                self.kind().as_bytes(),
                &first.width().to_le_bytes(),
                &first.height().to_le_bytes(),
                first.as_raw(),
                second.as_ref().map_or(&[][..], |s| s.as_raw()),
            ]),
        }
    }

    /// Raw patches the ViT sees (per temporal patch).
    pub fn patches(&self) -> u64 {
        self.grid[1] as u64 * self.grid[2] as u64
    }

    /// Decode (under the decode limit), resize like the reference processor, normalize,
    /// patchify. The expensive part; runs on a compute thread.
    pub fn pixel_values(&self, limits: &Limits) -> Result<PixelValues, VisionError> {
        let invalid = |e: PreprocessError| VisionError::invalid(self.index, input_message(e));
        match &self.pixels {
            Pixels::Encoded { data, target } => {
                let img = preprocess::worker::decode_image(
                    &limits.decoding,
                    data,
                    limits.max_decode_pixels,
                )
                .map_err(invalid)?;
                let resized =
                    preprocess::resize_bicubic(&img, target.0, target.1).map_err(invalid)?;
                preprocess::preprocess_resized(&resized, &limits.preprocess).map_err(invalid)
            }
            Pixels::Resized(img, None) => {
                preprocess::preprocess_resized(img, &limits.preprocess).map_err(invalid)
            }
            Pixels::Resized(first, Some(second)) => {
                preprocess::preprocess_video_group(&[first, second], &limits.preprocess)
                    .map_err(invalid)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vlm_config::{DeployConfig, Oversize};

    fn limits(buckets: &[u32], oversize: Oversize) -> Limits {
        let mut visual = DeployConfig::default_config().visual;
        visual.max_seq_len = buckets.to_vec();
        visual.oversize = oversize;
        Limits::new(visual, 4096 * 4096)
    }

    fn png(w: u32, h: u32) -> Vec<u8> {
        let img = RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, 3]));
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Png).unwrap();
        out.into_inner()
    }

    fn encoded(data: Vec<u8>) -> ImageInput {
        ImageInput {
            source: ImageSource::Encoded {
                data,
                mime_type: String::new(),
            },
            content_hash: vec![],
            expected_grid: None,
            budget: Default::default(),
        }
    }

    #[test]
    fn picks_the_bucket_of_the_resized_image() {
        let l = limits(&[256, 1024, 4096], Oversize::Reject);
        let p = plan(0, encoded(png(256, 256)), &l).unwrap();
        assert_eq!((p.grid, p.bucket), ([1, 16, 16], 256));
        let p = plan(1, encoded(png(512, 512)), &l).unwrap();
        assert_eq!((p.grid, p.bucket), ([1, 32, 32], 1024));
        let pv = p.pixel_values(&l).unwrap();
        assert_eq!(pv.grid_thw, [1, 32, 32]);
    }

    #[test]
    fn oversize_reject_and_downscale() {
        let err = plan(
            2,
            encoded(png(2048, 2048)),
            &limits(&[256, 1024, 4096], Oversize::Reject),
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with("image 2: ") && msg.contains("16384 patches") && msg.contains("4096"),
            "{msg}"
        );
        let l = limits(&[256, 1024, 4096], Oversize::Downscale);
        let p = plan(0, encoded(png(2048, 2048)), &l).unwrap();
        assert_eq!((p.grid, p.bucket, p.downscaled), ([1, 64, 64], 4096, true));
    }

    #[test]
    fn refuses_a_mismatched_expected_grid_and_bad_pixels() {
        let l = limits(&[256, 1024], Oversize::Reject);
        let mut input = encoded(png(256, 256));
        input.expected_grid = Some([1, 8, 8]);
        assert!(plan(0, input, &l)
            .unwrap_err()
            .to_string()
            .contains("expected grid"));
        let input = ImageInput {
            source: ImageSource::Pixels {
                width: 64,
                height: 64,
                rgb8: vec![0; 10],
                second_frame: vec![],
            },
            content_hash: vec![],
            expected_grid: None,
            budget: Default::default(),
        };
        let msg = plan(4, input, &l).unwrap_err().to_string();
        assert!(msg.contains("12288") && msg.contains("got 10"), "{msg}");
    }

    #[test]
    fn the_declared_type_is_an_image_type_or_says_nothing() {
        let l = limits(&[256, 1024], Oversize::Reject);
        let typed = |mime: &str| {
            let mut input = encoded(png(64, 64));
            if let ImageSource::Encoded { mime_type, .. } = &mut input.source {
                *mime_type = mime.into();
            }
            input
        };
        for mime in ["image/avif", "application/octet-stream", "", "IMAGE/PNG"] {
            assert!(plan(0, typed(mime), &l).is_ok(), "{mime}");
        }
        let msg = plan(0, typed("video/mp4"), &l).unwrap_err().to_string();
        assert!(
            msg.contains("unsupported image format \"video/mp4\""),
            "{msg}"
        );
    }

    #[test]
    fn refuses_by_header_before_decoding() {
        let l = Limits::new(DeployConfig::default_config().visual, 100 * 100);
        let msg = plan(0, encoded(png(128, 128)), &l).unwrap_err().to_string();
        assert!(
            msg.contains("128x128 = 16384 pixels") && msg.contains("decode limit of 10000"),
            "{msg}"
        );
        let msg = plan(0, encoded(b"not an image at all".to_vec()), &l)
            .unwrap_err()
            .to_string();
        assert!(msg.starts_with("image 0: "), "{msg}");
    }
}
