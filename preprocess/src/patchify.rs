//! Normalize and patchify a resized RGB image into the ViT's `pixel_values` rows
//! (reference: `Qwen2VLImageProcessorPil.patchify` after `rescale` and `normalize`).
use image::RgbImage;

/// The PIL backend's value of an 8-bit sample: `rescale` multiplies by 1/255 in float64 and
/// casts to float32, then `normalize` computes `(x - 0.5) / 0.5` in float32.
pub fn normalize_u8(u: u8) -> f32 {
    let x = (u as f64 * (1.0 / 255.0)) as f32;
    (x - 0.5) / 0.5
}

/// The 256 values of [`normalize_u8`].
fn lut() -> [f32; 256] {
    let mut t = [0f32; 256];
    for (u, v) in t.iter_mut().enumerate() {
        *v = normalize_u8(u as u8);
    }
    t
}

/// Patch rows of a `(grid_h*patch) x (grid_w*patch)` RGB image, in merge-block order with the
/// single frame repeated `temporal` times (an image: the reference stacks it `temporal` times).
/// Returns (values, rows, columns). The caller checks the sides are multiples of patch*merge.
pub fn patchify(
    img: &RgbImage,
    patch: usize,
    merge: usize,
    temporal: usize,
) -> (Vec<f32>, usize, usize) {
    patchify_frames(&vec![img; temporal], patch, merge)
}

/// Patch rows of one temporal patch made of `frames` (all the same size; a video's temporal
/// group, `Qwen3VLVideoProcessor.patchify`), in merge-block order:
/// row `((bh*(gw/m)+bw)*m+ih)*m+iw` holds patch (row `m*bh+ih`, col `m*bw+iw`), and its column
/// `c*T*P*P + t*P*P + py*P + px` holds channel c of pixel (py, px) of that patch in frame t.
/// Returns (values, rows, columns).
pub fn patchify_frames(
    frames: &[&RgbImage],
    patch: usize,
    merge: usize,
) -> (Vec<f32>, usize, usize) {
    let lut = lut();
    let temporal = frames.len();
    let Some(first) = frames.first() else {
        return (Vec::new(), 0, 0);
    };
    let (w, h) = (first.width() as usize, first.height() as usize);
    let (gh, gw) = (h / patch, w / patch);
    let pp = patch * patch;
    let cols = 3 * temporal * pp;
    let rows = gh * gw;
    let mut out = vec![0f32; rows * cols];
    let mut row = 0;
    for bh in 0..gh / merge {
        for bw in 0..gw / merge {
            for ih in 0..merge {
                for iw in 0..merge {
                    let (pr, pc) = (bh * merge + ih, bw * merge + iw);
                    let dst = &mut out[row * cols..(row + 1) * cols];
                    for (t, frame) in frames.iter().enumerate() {
                        let raw = frame.as_raw();
                        for py in 0..patch {
                            let y = pr * patch + py;
                            let start = (y * w + pc * patch) * 3;
                            let line = &raw[start..start + patch * 3];
                            for (px, rgb) in line.chunks_exact(3).enumerate() {
                                for (c, &u) in rgb.iter().enumerate() {
                                    dst[c * temporal * pp + t * pp + py * patch + px] =
                                        lut[u as usize];
                                }
                            }
                        }
                    }
                    row += 1;
                }
            }
        }
    }
    (out, rows, cols)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_endpoints() {
        assert_eq!(normalize_u8(0), -1.0);
        assert_eq!(normalize_u8(255), 1.0);
        assert!((normalize_u8(128) - 0.003_921_628).abs() < 1e-7);
    }

    #[test]
    fn merge_block_order() {
        // 4x2 patches of 1 px (patch 1, merge 2): pixel value encodes its (row, col).
        let img = RgbImage::from_fn(4, 2, |x, y| image::Rgb([(y * 10 + x) as u8, 0, 255]));
        let (v, rows, cols) = patchify(&img, 1, 2, 2);
        assert_eq!((rows, cols), (8, 6));
        let firsts: Vec<u8> = (0..rows)
            .map(|r| ((v[r * cols] + 1.0) * 127.5).round() as u8)
            .collect();
        // blocks (bh=0,bw=0): (0,0),(0,1),(1,0),(1,1); then (bh=0,bw=1): (0,2),(0,3),(1,2),(1,3)
        assert_eq!(firsts, [0, 1, 10, 11, 2, 3, 12, 13]);
        // temporal duplicate and channel-major columns: [r, r, g, g, b, b]
        assert_eq!(v[0], v[1]);
        assert_eq!(&v[2..6], &[-1.0, -1.0, 1.0, 1.0]);
    }

    #[test]
    fn two_frames_fill_the_temporal_columns_in_order() {
        let a = RgbImage::from_fn(2, 2, |_, _| image::Rgb([0, 0, 0]));
        let b = RgbImage::from_fn(2, 2, |_, _| image::Rgb([255, 255, 255]));
        let (v, rows, cols) = patchify_frames(&[&a, &b], 1, 2);
        assert_eq!((rows, cols), (4, 6));
        // [r(t0), r(t1), g(t0), g(t1), b(t0), b(t1)]
        assert_eq!(&v[..6], &[-1.0, 1.0, -1.0, 1.0, -1.0, 1.0]);
    }
}
