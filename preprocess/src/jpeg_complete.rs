//! Whether JPEG data holds a whole image. The decoder fills what a truncated file lacks with
//! gray and returns no error; Pillow (the reference) raises "image file is truncated". So the
//! markers are walked from SOI: segments are skipped by their length (an EXIF thumbnail with
//! its own EOI stays inside its APP1), entropy-coded data is scanned to the next marker (in it
//! 0xFF is followed by 0x00 or a restart marker), and the image is whole once EOI is reached.
//! Bytes after EOI are ignored, as Pillow ignores them.

/// `Err(reason)` when the data ends before the image's EOI marker.
pub(crate) fn check(bytes: &[u8]) -> Result<(), String> {
    if bytes.len() < 4 || bytes[0] != 0xFF || bytes[1] != 0xD8 {
        return Err("it does not start with the SOI marker".into());
    }
    let mut i = 2;
    let mut in_scan = false;
    while i < bytes.len() {
        if bytes[i] != 0xFF {
            if !in_scan {
                return Err(format!("byte {i} is not a marker"));
            }
            i += 1;
            continue;
        }
        let Some(&m) = bytes.get(i + 1) else { break };
        match m {
            // Fill bytes, stuffed zero and restart markers belong to the data.
            0xFF => i += 1,
            0x00 | 0xD0..=0xD7 if in_scan => i += 2,
            0xD9 => return Ok(()),
            0x01 | 0xD0..=0xD7 => i += 2,
            _ => {
                let Some(len) = bytes.get(i + 2..i + 4) else {
                    break;
                };
                let len = u16::from_be_bytes([len[0], len[1]]) as usize;
                if len < 2 {
                    return Err(format!("marker 0xFF{m:02X} at byte {i} has length {len}"));
                }
                if i + 2 + len > bytes.len() {
                    break;
                }
                i += 2 + len;
                // Start of scan: entropy-coded data follows its header.
                in_scan = m == 0xDA;
            }
        }
    }
    Err(format!(
        "the data ends after {} bytes, before the end-of-image marker (the file is truncated)",
        bytes.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jpeg(w: u32, h: u32) -> Vec<u8> {
        let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, 7]));
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Jpeg).unwrap();
        out.into_inner()
    }

    #[test]
    fn whole_images_pass_and_every_truncation_fails() {
        let j = jpeg(40, 30);
        check(&j).unwrap();
        let mut trailing = j.clone();
        trailing.extend_from_slice(b"trailing junk");
        check(&trailing).unwrap();
        for cut in 0..j.len() - 1 {
            assert!(check(&j[..cut]).is_err(), "cut at {cut} of {}", j.len());
        }
    }
}
