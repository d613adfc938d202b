//! Decoding untrusted image bytes: the pixel limit is enforced from the header before any
//! pixel is decoded, corrupt and unsupported data are clear errors, alpha is composited onto
//! white, a GIF gives its first frame.
use vlm_preprocess::{decode_image, over_white, read_image_size, PreprocessConfig};
use vlm_test_support::png::crc32;

fn encode_png(img: &image::DynamicImage) -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

/// A PNG whose header claims `w` x `h` RGB pixels, with no image data behind it.
fn png_header_only(w: u32, h: u32) -> Vec<u8> {
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut chunk = b"IHDR".to_vec();
    chunk.extend_from_slice(&w.to_be_bytes());
    chunk.extend_from_slice(&h.to_be_bytes());
    chunk.extend_from_slice(&[8, 2, 0, 0, 0]);
    out.extend_from_slice(&13u32.to_be_bytes());
    out.extend_from_slice(&chunk);
    out.extend_from_slice(&crc32(&chunk).to_be_bytes());
    // An IDAT with a bare zlib header: decoders read the header up to the first IDAT.
    let idat = b"IDAT\x78\x9c";
    out.extend_from_slice(&2u32.to_be_bytes());
    out.extend_from_slice(idat);
    out.extend_from_slice(&crc32(idat).to_be_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(b"IEND");
    out.extend_from_slice(&crc32(b"IEND").to_be_bytes());
    out
}

#[test]
fn refuses_decompression_bombs_before_decoding() {
    let bomb = png_header_only(100_000, 100_000);
    assert_eq!(read_image_size(&bomb).unwrap(), (100_000, 100_000));
    let err = decode_image(&bomb, PreprocessConfig::default().max_decode_pixels)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(
            "image is 100000x100000 = 10000000000 pixels, over the decode limit of 67108864 pixels"
        ),
        "{err}"
    );
    let small = encode_png(&image::DynamicImage::new_rgb8(300, 200));
    let err = decode_image(&small, 1000).unwrap_err().to_string();
    assert!(
        err.contains("300x200 = 60000 pixels, over the decode limit of 1000 pixels"),
        "{err}"
    );
    assert!(decode_image(&small, 60000).is_ok());
}

#[test]
fn corrupt_and_unsupported_data_are_clear_errors() {
    let png = encode_png(&image::DynamicImage::ImageRgb8(image::RgbImage::from_fn(
        64,
        64,
        |x, y| image::Rgb([(x * 3) as u8, (y * 3) as u8, 77]),
    )));
    let truncated = &png[..png.len() / 2];
    let err = decode_image(truncated, 1 << 20).unwrap_err().to_string();
    assert!(err.contains("corrupt Png image"), "{err}");
    let err = decode_image(&png[..20], 1 << 20).unwrap_err().to_string();
    assert!(err.contains("corrupt Png image"), "{err}");
    let bmp = b"BM\x3a\x00\x00\x00\x00\x00\x00\x00\x36\x00\x00\x00\x28\x00\x00\x00";
    let err = decode_image(bmp, 1 << 20).unwrap_err().to_string();
    assert!(err.contains("corrupt Bmp image"), "{err}");
    let qoi = b"qoif\x00\x00\x00\x40\x00\x00\x00\x40\x03\x00";
    let err = decode_image(qoi, 1 << 20).unwrap_err().to_string();
    assert!(err.contains("unsupported image format Qoi"), "{err}");
    let err = read_image_size(b"hello, this is not an image")
        .unwrap_err()
        .to_string();
    assert!(err.contains("unrecognised image format"), "{err}");
    let err = decode_image(b"", 1 << 20).unwrap_err().to_string();
    assert!(err.contains("empty"), "{err}");
    // Errors are InvalidInput, which services map to INVALID_ARGUMENT.
    assert!(matches!(
        decode_image(truncated, 1 << 20),
        Err(vlm_preprocess::PreprocessError(_))
    ));
}

#[test]
fn alpha_is_composited_onto_white() {
    let rgba = image::RgbaImage::from_fn(16, 16, |x, y| {
        image::Rgba([(x * 16) as u8, (y * 16) as u8, 200, ((x + y) * 8) as u8])
    });
    let png = encode_png(&image::DynamicImage::ImageRgba8(rgba.clone()));
    let rgb = decode_image(&png, 1 << 20).unwrap();
    for (p, q) in rgba.pixels().zip(rgb.pixels()) {
        let a = p.0[3];
        assert_eq!(
            q.0,
            [
                over_white(p.0[0], a),
                over_white(p.0[1], a),
                over_white(p.0[2], a)
            ]
        );
    }
    // Fully transparent is white, opaque is unchanged.
    assert_eq!(rgb.get_pixel(0, 0).0, [255, 255, 255]);
    // Gray + alpha too.
    let la = image::DynamicImage::ImageLumaA8(image::GrayAlphaImage::from_pixel(
        2,
        2,
        image::LumaA([10, 128]),
    ));
    let rgb = decode_image(&encode_png(&la), 1 << 20).unwrap();
    assert_eq!(rgb.get_pixel(1, 1).0, [over_white(10, 128); 3]);
}

#[test]
fn gif_decodes_its_first_frame() {
    use image::codecs::gif::GifEncoder;
    use image::{Delay, Frame};
    let mut bytes = Vec::new();
    {
        let mut enc = GifEncoder::new(&mut bytes);
        for color in [[200u8, 10, 10, 255], [10, 10, 200, 255]] {
            let buf = image::RgbaImage::from_pixel(8, 6, image::Rgba(color));
            enc.encode_frame(Frame::from_parts(
                buf,
                0,
                0,
                Delay::from_numer_denom_ms(100, 1),
            ))
            .unwrap();
        }
    }
    assert_eq!(read_image_size(&bytes).unwrap(), (8, 6));
    let rgb = decode_image(&bytes, 1 << 20).unwrap();
    assert_eq!(rgb.dimensions(), (8, 6));
    let p = rgb.get_pixel(3, 3).0;
    assert!(p[0] > 150 && p[2] < 60, "first frame is red, got {p:?}");
}

/// `preprocess/tests/data/NAME` (made by `preprocess/tests/data/make-avif.sh`).
fn data(name: &str) -> Vec<u8> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    std::fs::read(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn png_rgb(name: &str) -> image::RgbImage {
    decode_image(&data(name), 1 << 20).unwrap()
}

/// The largest per-value difference of two images of the same size.
fn max_diff(a: &image::RgbImage, b: &image::RgbImage) -> u8 {
    assert_eq!(a.dimensions(), b.dimensions());
    a.as_raw()
        .iter()
        .zip(b.as_raw())
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap()
}

/// AVIF files as libavif's `avifenc` writes them (item-based stills): a lossless one decodes to
/// its source's pixels exactly; lossy ones to libavif's own decode (`avifdec`) within the
/// colour conversion's rounding (4:4:4) and its chroma upsampling (4:2:0, measured 7).
#[test]
fn avif_stills_decode_as_libavif_does() {
    let source = png_rgb("avif_source.png");
    let lossless = data("lossless.avif");
    assert_eq!(read_image_size(&lossless).unwrap(), (48, 32));
    assert_eq!(
        max_diff(&decode_image(&lossless, 1 << 20).unwrap(), &source),
        0
    );
    for (file, reference, tolerance) in [
        ("lossy444.avif", "lossy444.avifdec.png", 1),
        ("lossy420.avif", "lossy420.avifdec.png", 7),
    ] {
        let got = decode_image(&data(file), 1 << 20).unwrap();
        let d = max_diff(&got, &png_rgb(reference));
        assert!(d <= tolerance, "{file}: {d} from avifdec's decode");
    }
    // The pixel limit holds before decoding; damage is a clear error.
    let err = decode_image(&lossless, 1000).unwrap_err().to_string();
    assert!(
        err.contains("48x32 = 1536 pixels, over the decode limit of 1000 pixels"),
        "{err}"
    );
    let cut = &lossless[..lossless.len() / 2];
    let err = decode_image(cut, 1 << 20).unwrap_err().to_string();
    assert!(err.contains("corrupt Avif image"), "{err}");
}
