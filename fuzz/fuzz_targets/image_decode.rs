//! Image bytes as a request carries them (PNG, JPEG, WebP, GIF, BMP, TIFF, AVIF, with EXIF
//! orientation): `read_image_size` (the gateway's header check) and `decode_image` under a
//! pixel limit (the vision service's decode). Never a panic; a decoded image is within the
//! limit and has the size the header check reported.
#![no_main]
use libfuzzer_sys::fuzz_target;

/// Small enough that a bomb is refused fast, large enough for every seed.
const MAX_PIXELS: u64 = 1 << 20;

fuzz_target!(|bytes: &[u8]| {
    let size = vlm_preprocess::read_image_size(bytes);
    if let Ok(img) = vlm_preprocess::decode_image(bytes, MAX_PIXELS) {
        let (w, h) = img.dimensions();
        assert!(
            w as u64 * h as u64 <= MAX_PIXELS,
            "{w}x{h} decoded over the limit"
        );
        assert_eq!(
            size.ok(),
            Some((w, h)),
            "the header check and the decode disagree"
        );
    }
});
