//! Property tests of image header reading and decoding (issue 18): `read_image_size` and
//! `decode_image` on random bytes, and on small random PNG / JPEG / GIF / WebP / BMP / TIFF
//! images (encoded here with the `image` crate) and the AVIF test files that are truncated, have bytes flipped, inserted
//! or removed, or have their header's size rewritten (PNG with a fixed CRC, so the lie gets past
//! the checksum).
//!
//! - nothing panics;
//! - when both succeed, the decoded image has the header's size;
//! - when the header is refused, decoding is refused too;
//! - a decode limit below the header's width * height is always refused, naming the limit;
//! - an intact image reads and decodes to its own size, and the lossless formats (PNG, WebP)
//!   decode to its pixels (alpha composited onto white, as the reference does);
//! - a JPEG cut short anywhere is refused (the decoder would fill the rest with gray).
//!
//! Bounded: a fixed number of cases per property, images of at most 40x40. A failing case is
//! kept in `proptest-regressions/fuzz_images.txt` and replayed first on every run.
use image::{DynamicImage, ImageFormat, RgbImage};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use std::io::Cursor;
use vlm_preprocess::{decode_image, over_white, read_image_size};

/// The decode limit used on mutated data: a lying header cannot make a case allocate more than
/// a few MiB.
const LIMIT: u64 = 1 << 20;

/// `PROPTEST_CASES` (e.g. for a longer run by hand) overrides the bounded default.
fn config() -> ProptestConfig {
    ProptestConfig {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(2048),
        // Relative to the crate (cargo runs tests there): `preprocess/proptest-regressions/`.
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "proptest-regressions/fuzz_images.txt",
        ))),
        ..ProptestConfig::default()
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Color {
    Rgb8,
    Rgba8,
    L8,
    La8,
    Rgb16,
}

/// A small random image: its size, color type, and pixels from a seed (noise, a gradient or a
/// flat color, so both the entropy coders' easy and hard paths run).
#[derive(Debug, Clone)]
struct Img {
    w: u32,
    h: u32,
    color: Color,
    seed: u64,
    pattern: u8,
}

impl Img {
    fn rgba(&self) -> image::RgbaImage {
        let mut s = self.seed | 1;
        image::RgbaImage::from_fn(self.w, self.h, |x, y| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let b = s.to_le_bytes();
            match self.pattern {
                0 => image::Rgba([b[0], b[1], b[2], b[3]]),
                1 => image::Rgba([(x * 6) as u8, (y * 6) as u8, (x + y) as u8, 255 - x as u8]),
                _ => image::Rgba([self.seed as u8, 7, 200, (self.seed >> 8) as u8]),
            }
        })
    }

    fn dynamic(&self) -> DynamicImage {
        let rgba = DynamicImage::ImageRgba8(self.rgba());
        match self.color {
            Color::Rgb8 => DynamicImage::ImageRgb8(rgba.to_rgb8()),
            Color::Rgba8 => rgba,
            Color::L8 => DynamicImage::ImageLuma8(rgba.to_luma8()),
            Color::La8 => DynamicImage::ImageLumaA8(rgba.to_luma_alpha8()),
            Color::Rgb16 => DynamicImage::ImageRgb16(rgba.to_rgb16()),
        }
    }

    /// The image the reference sees: alpha composited onto white, as 8-bit RGB.
    fn expected_rgb(&self) -> RgbImage {
        let d = self.dynamic();
        let rgba = d.to_rgba8();
        RgbImage::from_fn(self.w, self.h, |x, y| {
            let p = rgba.get_pixel(x, y).0;
            image::Rgb([
                over_white(p[0], p[3]),
                over_white(p[1], p[3]),
                over_white(p[2], p[3]),
            ])
        })
    }
}

fn img() -> impl Strategy<Value = Img> {
    (
        1u32..=40,
        1u32..=40,
        prop::sample::select(vec![
            Color::Rgb8,
            Color::Rgba8,
            Color::L8,
            Color::La8,
            Color::Rgb16,
        ]),
        any::<u64>(),
        0u8..3,
    )
        .prop_map(|(w, h, color, seed, pattern)| Img {
            w,
            h,
            color,
            seed,
            pattern,
        })
}

fn format() -> impl Strategy<Value = ImageFormat> {
    prop::sample::select(vec![
        ImageFormat::Png,
        ImageFormat::Jpeg,
        ImageFormat::Gif,
        ImageFormat::WebP,
        ImageFormat::Bmp,
        ImageFormat::Tiff,
    ])
}

/// Encodes `img` as `format`, converting the color type to one the encoder takes.
fn encode(img: &Img, format: ImageFormat) -> Vec<u8> {
    let d = img.dynamic();
    let d = match (format, img.color) {
        (ImageFormat::Jpeg, Color::L8 | Color::La8) => DynamicImage::ImageLuma8(d.to_luma8()),
        (ImageFormat::Jpeg, _) => DynamicImage::ImageRgb8(d.to_rgb8()),
        (ImageFormat::Gif, _) => DynamicImage::ImageRgba8(d.to_rgba8()),
        (ImageFormat::WebP, Color::Rgb8 | Color::L8 | Color::Rgb16) => {
            DynamicImage::ImageRgb8(d.to_rgb8())
        }
        (ImageFormat::WebP, _) => DynamicImage::ImageRgba8(d.to_rgba8()),
        (ImageFormat::Bmp | ImageFormat::Tiff, Color::Rgb8 | Color::L8 | Color::Rgb16) => {
            DynamicImage::ImageRgb8(d.to_rgb8())
        }
        (ImageFormat::Bmp | ImageFormat::Tiff, _) => DynamicImage::ImageRgba8(d.to_rgba8()),
        _ => d,
    };
    let mut out = Cursor::new(Vec::new());
    d.write_to(&mut out, format)
        .unwrap_or_else(|e| panic!("encode {format:?} {:?}: {e}", img.color));
    out.into_inner()
}

#[derive(Debug, Clone)]
enum Mutation {
    Truncate(prop::sample::Index),
    Flip(prop::sample::Index, u8),
    /// A byte in the first 64 (signature, header chunk, JPEG's first segments) flipped.
    FlipHeader(prop::sample::Index, u8),
    Insert(prop::sample::Index, Vec<u8>),
    Remove(prop::sample::Index, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let i = any::<prop::sample::Index>();
    prop_oneof![
        i.clone().prop_map(Mutation::Truncate),
        (i.clone(), 1u8..=255).prop_map(|(i, x)| Mutation::Flip(i, x)),
        (i.clone(), 1u8..=255).prop_map(|(i, x)| Mutation::FlipHeader(i, x)),
        (i.clone(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        (i, 1usize..64).prop_map(|(i, n)| Mutation::Remove(i, n)),
    ]
}

fn mutate(mut b: Vec<u8>, muts: &[Mutation]) -> Vec<u8> {
    for m in muts {
        if b.is_empty() {
            break;
        }
        let n = b.len();
        match m {
            Mutation::Truncate(i) => b.truncate(i.index(n)),
            Mutation::Flip(i, x) => b[i.index(n)] ^= x,
            Mutation::FlipHeader(i, x) => b[i.index(n.min(64))] ^= x,
            Mutation::Insert(i, bytes) => {
                let k = i.index(n + 1);
                b.splice(k..k, bytes.iter().copied());
            }
            Mutation::Remove(i, len) => {
                let k = i.index(n);
                b.drain(k..(k + len).min(n));
            }
        }
    }
    b
}

/// A PNG whose IHDR says `w` x `h` (its CRC recomputed), whatever its pixel data holds.
fn png_with_size(mut png: Vec<u8>, w: u32, h: u32) -> Vec<u8> {
    // 8-byte signature, then IHDR: length (4), "IHDR" (4), width (4), height (4), 5 bytes, CRC.
    assert_eq!(&png[12..16], b"IHDR");
    png[16..20].copy_from_slice(&w.to_be_bytes());
    png[20..24].copy_from_slice(&h.to_be_bytes());
    let crc = vlm_test_support::png::crc32(&png[12..29]);
    png[29..33].copy_from_slice(&crc.to_be_bytes());
    png
}

/// The properties every input must have.
fn check_any(bytes: &[u8]) -> Result<(), TestCaseError> {
    let header = read_image_size(bytes);
    let decoded = decode_image(bytes, LIMIT);
    match (&header, &decoded) {
        (Ok((w, h)), Ok(img)) => {
            prop_assert_eq!(
                img.dimensions(),
                (*w, *h),
                "decode disagrees with the header"
            );
            prop_assert_eq!(img.as_raw().len(), *w as usize * *h as usize * 3);
        }
        (Err(e), Ok(img)) => {
            return Err(TestCaseError::fail(format!(
                "header refused ({e}) but the image decoded to {:?}",
                img.dimensions()
            )))
        }
        (_, Err(e)) => prop_assert!(!e.to_string().is_empty()),
    }
    if let Err(e) = &header {
        prop_assert!(!e.to_string().is_empty());
    }
    // A limit below the header's pixel count is refused, before any decoding.
    if let Ok((w, h)) = header {
        let pixels = w as u64 * h as u64;
        if pixels > 0 {
            let e = decode_image(bytes, pixels - 1);
            prop_assert!(
                e.is_err(),
                "{w}x{h} decoded under a limit of {}",
                pixels - 1
            );
            let msg = e.unwrap_err().to_string();
            prop_assert!(msg.contains("decode limit"), "{msg}");
            prop_assert!(msg.contains(&(pixels - 1).to_string()), "{msg}");
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    /// Random bytes, with and without a real signature in front.
    #[test]
    fn random_bytes_never_panic(
        prefix in prop::sample::select(vec![
            &b""[..],
            b"\x89PNG\r\n\x1a\n",
            b"\xff\xd8\xff",
            b"GIF89a",
            b"GIF87a",
            b"RIFF\x00\x00\x00\x00WEBPVP8L",
            b"RIFF\x00\x00\x00\x00WEBPVP8 ",
            b"BM",
            b"\x00\x00\x00\x1cftypavif\x00\x00\x00\x00avifmif1miaf",
        ]),
        rest in prop::collection::vec(any::<u8>(), 0..256),
    ) {
        let mut bytes = prefix.to_vec();
        bytes.extend_from_slice(&rest);
        check_any(&bytes)?;
    }

    /// An intact image reads and decodes to its own size; PNG and WebP (lossless here) decode to
    /// its exact pixels.
    #[test]
    fn intact_images_decode_to_themselves(img in img(), format in format()) {
        let bytes = encode(&img, format);
        prop_assert_eq!(read_image_size(&bytes).ok(), Some((img.w, img.h)));
        let decoded = decode_image(&bytes, (img.w * img.h) as u64);
        prop_assert!(decoded.is_ok(), "{:?}", decoded.err());
        let decoded = decoded.unwrap();
        prop_assert_eq!(decoded.dimensions(), (img.w, img.h));
        let lossless = match format {
            ImageFormat::Png => true,
            // The WebP encoder is lossless; luma images went in as RGB.
            ImageFormat::WebP => !matches!(img.color, Color::La8),
            _ => false,
        };
        if lossless {
            let want = if format == ImageFormat::WebP && img.color == Color::Rgb16 {
                // Went in as 8-bit RGB.
                let d = DynamicImage::ImageRgb8(img.dynamic().to_rgb8());
                d.to_rgb8()
            } else {
                img.expected_rgb()
            };
            prop_assert!(decoded == want, "{:?} {:?}: pixels differ", format, img.color);
        }
        check_any(&bytes)?;
    }

    /// Mutated images: the properties of any input.
    #[test]
    fn mutated_images_never_panic_and_agree(
        img in img(),
        format in format(),
        muts in prop::collection::vec(mutation(), 1..4),
    ) {
        let bytes = mutate(encode(&img, format), &muts);
        check_any(&bytes)?;
    }

    /// The AVIF test files (libavif's, decoded through FFmpeg), mutated: the properties of any
    /// input.
    #[test]
    fn mutated_avif_files_never_panic_and_agree(
        file in prop::sample::select(vec!["lossless.avif", "lossy444.avif", "lossy420.avif"]),
        muts in prop::collection::vec(mutation(), 1..4),
    ) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
        let bytes = mutate(std::fs::read(dir.join(file)).unwrap(), &muts);
        check_any(&bytes)?;
    }

    /// A JPEG cut short anywhere is refused by both (a truncated JPEG decodes without an error,
    /// its missing part gray).
    #[test]
    fn truncated_jpegs_are_refused(img in img(), cut in any::<prop::sample::Index>()) {
        let bytes = encode(&img, ImageFormat::Jpeg);
        let short = &bytes[..cut.index(bytes.len())];
        prop_assert!(read_image_size(short).is_err());
        prop_assert!(decode_image(short, LIMIT).is_err());
    }

    /// A PNG whose header lies about its size (checksum fixed): the header's size is read, and
    /// decoding either refuses or gives that size.
    #[test]
    fn png_headers_that_lie(
        img in img(),
        w in prop_oneof![1u32..64, Just(0u32), Just(u32::MAX), Just(1 << 31), 1u32..100_000],
        h in prop_oneof![1u32..64, Just(0u32), Just(u32::MAX), Just(1 << 31), 1u32..100_000],
    ) {
        let bytes = png_with_size(encode(&img, ImageFormat::Png), w, h);
        if let Ok(size) = read_image_size(&bytes) {
            prop_assert_eq!(size, (w, h));
        }
        check_any(&bytes)?;
        // Even the default limit (8192 x 8192) refuses a header past it.
        if (w as u64) * (h as u64) > vlm_preprocess::DEFAULT_MAX_DECODE_PIXELS {
            prop_assert!(decode_image(&bytes, vlm_preprocess::DEFAULT_MAX_DECODE_PIXELS).is_err());
        }
    }
}
