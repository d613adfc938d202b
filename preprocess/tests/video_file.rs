//! MP4 (H.264) files embedded here: a libx264 clip with B-frames (against PyAV's decode), the
//! PyAV golden fixture when present, the refusals, and corrupt inputs (truncated, random,
//! flipped bytes), which must give errors and never panic. Other codecs and containers:
//! `video_codecs.rs`.
use image::RgbImage;
use vlm_preprocess::{decode_video_frames, read_video_info};

const LIMIT: u64 = 1 << 24;

/// Frame `t` of a clip of moving gradients (the same formula made the embedded libx264 clip).
fn pattern(w: u32, h: u32, t: i64) -> RgbImage {
    RgbImage::from_raw(w, h, vlm_test_support::ffmpeg::gradient_frame(w, h, t)).unwrap()
}

/// Mean absolute difference per channel value.
fn mad(a: &RgbImage, b: &RgbImage) -> f64 {
    assert_eq!(a.dimensions(), b.dimensions());
    vlm_test_support::ffmpeg::mean_abs_diff(a.as_raw(), b.as_raw())
}

fn all_indices(n: u32) -> Vec<u32> {
    (0..n).collect()
}

/// (offset of the body, body length) of the first top-level box of type `kind`.
fn top_box(mp4: &[u8], kind: &[u8; 4]) -> (usize, usize) {
    let mut pos = 0;
    while pos + 8 <= mp4.len() {
        let size = u32::from_be_bytes(mp4[pos..pos + 4].try_into().unwrap()) as usize;
        if &mp4[pos + 4..pos + 8] == kind {
            return (pos + 8, size - 8);
        }
        pos += size;
    }
    panic!("no top-level {kind:?} box");
}

/// libx264 (PyAV 18.1, FFmpeg 8 mp4 muxer, `+bitexact`): 64x48 at 8 fps, 10 frames of
/// `pattern`, High profile, CABAC, `bf=3 b-pyramid=normal g=6`: frame types I B B P B P I P B
/// P in presentation order, so decode order differs (a `ctts` box).
const X264_B_FRAMES: &[&str] = &[
    "000000206674797069736f6d0000020069736f6d69736f32617663316d7034310000000866726565000006c06d646174",
    "0000029b0605ffff97dc45e9bde6d948b7962cd820d923eeef78323634202d20636f726520313635202d20482e323634",
    "2f4d5045472d342041564320636f646563202d20436f70796c65667420323030332d32303235202d20687474703a2f2f",
    "7777772e766964656f6c616e2e6f72672f783236342e68746d6c202d206f7074696f6e733a2063616261633d31207265",
    "663d33206465626c6f636b3d313a303a3020616e616c7973653d3078333a3078313133206d653d686578207375626d65",
    "3d37207073793d31207073795f72643d312e30303a302e3030206d697865645f7265663d31206d655f72616e67653d31",
    "36206368726f6d615f6d653d31207472656c6c69733d31203878386463743d312063716d3d3020646561647a6f6e653d",
    "32312c313120666173745f70736b69703d31206368726f6d615f71705f6f66667365743d2d3220746872656164733d31",
    "206c6f6f6b61686561645f746872656164733d3120736c696365645f746872656164733d30206e723d3020646563696d",
    "6174653d3120696e7465726c616365643d3020626c757261795f636f6d7061743d3020636f6e73747261696e65645f69",
    "6e7472613d3020626672616d65733d3320625f707972616d69643d3220625f61646170743d3120625f626961733d3020",
    "6469726563743d3120776569676874623d31206f70656e5f676f703d3020776569676874703d32206b6579696e743d36",
    "206b6579696e745f6d696e3d31207363656e656375743d3020696e7472615f726566726573683d302072635f6c6f6f6b",
    "61686561643d362072633d637266206d62747265653d31206372663d31362e302071636f6d703d302e36302071706d69",
    "6e3d302071706d61783d3639207170737465703d342069705f726174696f3d312e34302061713d313a312e3030008000",
    "0000e865888401ffecebcbeecef8eb405cf171cf903667b9b2d8a5f38d727a073af4f611e033da25369678788c4d0349",
    "8e77d0087a5971bf97e06ffe98a41415a87f40671334cfb0ec95a686eb431dc6e0bdad4b89f81fc91ea34258ded0706d",
    "c1f7df6865035192656f9f92f5e1474e79d21c0e4fe1e3dffd72caed241efd47eddf96182a587227c2abf4328239b598",
    "8efd8e6c3374d61d9a77475c0453ab022878f1e6bd0b115fc291753386db517f178008396d5f6ec271e7bdd460f4e341",
    "7acf1e626f04265e6c4d6aca0591850a27dd0f1ca4ff0fa0939e0f3435b8fc7eaaf36dbea70c2b44764e7f0000006d41",
    "9a23638880860e4057014007e059276705f89ec527f747f238bd109e2e1d34c7fd3226ca922f3e9c7108a02710ee2559",
    "193a98489b00b82833f20ba5fe082f3ec1c1da21969ee8cf4cf54a92ee2ed18bb86293cc98ec8464cc1f5db0139b0014",
    "f24521eddd64dee9d9a2184000000032419e4178af8d13a697b5cf6fe53f882f793b16355a8e9a277e6397abab7e47c5",
    "3707251309e07e37a4d64752f288766a0ebf0000001a019e626a49ff92e8cd2367250ed608df3a76402d3c4633455ce0",
    "0000005e419a654ba842105a21cd0104148360b010074041048053c9ff62441cf8f6e70cb3d8e77bd0d5e89d7c00e8d0",
    "3457591d5a4d276c27066f8ff694d7e1c73993ad6694daed836d806c2fe562306b600bccc836325f22062cc522db842a",
    "b53b0000001d019e846a49ffc7aa550ee02ea48f79a1cca6ef0699a276de971469753d000000f6658882002ff04df7ff",
    "c3cf00b95abc17fe59cacf107fcdc72d1ea41a611f137aa7e1dd454536db099867070143e301c9ee6cfcae486e8b1531",
    "25b62d230eb491cc7925ea9aede4f1ff95c7ac49d937a4cadf7f7b53daab8d0131c4189d79964cf672fb8e77cda41bdc",
    "a3d7fd5f89a1ba2179c307b0a7add8d713d854a6f3572b687094ee700cdc4caad72a4c42d56febe0ebccf4fad73ed9b2",
    "9702ce963f6828953ecce6bb45de33dd633f3c1758b40acc98e8298766b017ca2340cd236dda7cb62581750c87d71c55",
    "f957e413b0019ef38135e8d6fca192b5fb066fffe6364c402bee9cff1209d29811f35eebbdae3ac2f627c7f0ef000000",
    "56419a2169e8540420640fc215ff66b944704d729ff320df23ad56d49a740a92b107f7f49e2186f0b987582cb1ce19f0",
    "424b5d3b55a8c90e2d3b211a4dbc806f9297a8f3b7411f2205e18fbf1d7570847ac00cc844b28700000065419a4349e1",
    "084321cf03f062025809a020303f058093ff91d32362ef9bebe01b01c2c9097d8f9635e68b091455bdcc4e8ce811fa3d",
    "b379186952f0fea783a78af1997c144ff76628ae8d2e454a2f9c987d9b8895d241106164ecc46c185a727b91e41cd0c0",
    "00000024019e626a49ff89806e492f921fcc5e6a4a77498139c47a5446467e2aa068d6c3e8cf837c000003706d6f6f76",
    "0000006c6d766864000000000000000000000000000003e8000004e20001000001000000000000000000000000010000",
    "000000000000000000000000000100000000000000000000000000004000000000000000000000000000000000000000",
    "000000000000000000000002000002bf7472616b0000005c746b68640000000300000000000000000000000100000000",
    "000004e20000000000000000000000000000000000010000000000000000000000000000000100000000000000000000",
    "0000000040000000004000000030000000000024656474730000001c656c73740000000000000001000004e200001000",
    "00010000000002376d646961000000206d646864000000000000000000000000000040000000580055c400000000002d",
    "68646c72000000000000000076696465000000000000000000000000566964656f48616e646c657200000001e26d696e",
    "6600000014766d68640000000100000000000000000000002464696e660000001c647265660000000000000001000000",
    "0c75726c2000000001000001a27374626c000000ae7374736400000000000000010000009e6176633100000000000000",
    "010000000000000000000000000000000000400030004800000048000000000000000100000000000000000000000000",
    "000000000000000000000000000000000000000018ffff00000034617663430164000affe100176764000aacd9447a10",
    "00000300100000030100f122596001000668ebe0acb22cfdf8f80000000014627472740000000000002b000000000000",
    "0000187374747300000000000000010000000a0000080000000018737473730000000000000002000000010000000700",
    "000050637474730000000000000008000000010000100000000001000020000000000200000800000000010000180000",
    "000001000008000000000200001000000000010000180000000001000008000000001c73747363000000000000000100",
    "0000010000000a000000010000003c7374737a00000000000000000000000a0000038b00000071000000360000001e00",
    "00006200000021000000fa0000005a0000006900000028000000147374636f0000000000000001000000300000003d75",
    "647461000000356d657461000000000000002168646c7200000000000000006d6469726170706c000000000000000000",
    "00000008696c7374",
];

/// FNV-1a 64 of PyAV's `frame.to_ndarray(format="rgb24")` of each frame of the clip above
/// (swscale's x86-64 SIMD YUV -> RGB).
const X264_PYAV_FNV: [u64; 10] = [
    0xf7aedb26a0ee7a21,
    0x11cb51f92e373edc,
    0x9d04e103d2a73ce8,
    0xab6328354181d9fa,
    0x6faeddefcba388c7,
    0x4f612ff54514d032,
    0x9e5803301a037648,
    0x37884e814ce95ff1,
    0x65ababb445f2ad3c,
    0x44e48b0d73834d29,
];

fn unhex(lines: &[&str]) -> Vec<u8> {
    let hex: String = lines.concat();
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

#[test]
fn libx264_b_frames_decode_in_presentation_order_bit_exact_with_pyav() {
    let mp4 = unhex(X264_B_FRAMES);
    let info = read_video_info(&mp4).unwrap();
    assert_eq!((info.width, info.height, info.frames), (64, 48, 10));
    assert_eq!(info.fps, Some(8.0));
    assert!(info.codec == "h264 (High)", "{}", info.codec);
    let all = decode_video_frames(&mp4, &all_indices(10), LIMIT).unwrap();
    for (i, f) in all.iter().enumerate() {
        assert_eq!(
            fnv1a(f.as_raw()),
            X264_PYAV_FNV[i],
            "frame {i} differs from PyAV's"
        );
        let own = mad(f, &pattern(64, 48, i as i64));
        assert!(own < 3.0, "frame {i}: {own:.2} levels off its source");
    }
    // Each frame alone (stopping early, flushing the reorder buffer), and repeats.
    for i in 0..10u32 {
        let one = decode_video_frames(&mp4, &[i], LIMIT).unwrap();
        assert_eq!(one[0], all[i as usize], "frame {i} alone");
    }
    let some = decode_video_frames(&mp4, &[1, 2, 2, 8], LIMIT).unwrap();
    assert_eq!(
        some,
        vec![
            all[1].clone(),
            all[2].clone(),
            all[2].clone(),
            all[8].clone()
        ]
    );
}

/// The PyAV golden of `fixtures/tiny/video_mp4` (libx264 Constrained Baseline
/// clip.mp4, `decoded_frames_u8` from PyAV's rgb24), when that fixture is present.
#[test]
fn pyav_golden_fixture() {
    let dir = vlm_test_support::tiny_dir().join("video_mp4");
    let (Ok(mp4), Ok(golden)) = (
        std::fs::read(dir.join("clip.mp4")),
        std::fs::read(dir.join("golden.safetensors")),
    ) else {
        vlm_test_support::skip!("no {}/clip.mp4 and golden.safetensors", dir.display());
        return;
    };
    let golden = safetensors::SafeTensors::deserialize(&golden).unwrap();
    let want = golden.tensor("decoded_frames_u8").unwrap();
    let shape = want.shape().to_vec();
    assert_eq!(shape.len(), 4);
    let info = read_video_info(&mp4).unwrap();
    assert_eq!(
        (
            info.frames as usize,
            info.height as usize,
            info.width as usize,
            3
        ),
        (shape[0], shape[1], shape[2], shape[3])
    );
    let frames = decode_video_frames(&mp4, &all_indices(info.frames), LIMIT).unwrap();
    let per = shape[1] * shape[2] * 3;
    let (mut max, mut differing) = (0u8, 0usize);
    for (i, f) in frames.iter().enumerate() {
        for (a, b) in f.as_raw().iter().zip(&want.data()[i * per..(i + 1) * per]) {
            max = max.max(a.abs_diff(*b));
            differing += (a != b) as usize;
        }
    }
    eprintln!(
        "fixture: {} frames, {differing} of {} values differ from PyAV, by at most {max}",
        frames.len(),
        frames.len() * per
    );
    // Bit-exact against an x86-64 PyAV; other swscale SIMD paths round differently.
    assert!(max <= 2, "up to {max} levels off PyAV's decode");
}

/// `fixtures/video_codecs/`: H.264 High with B-frames, HEVC, VP9 and AV1 clips made by the
/// ffmpeg CLI, with PyAV's rgb24 decode of each (`fixtures/gen_video_codecs.py`). Ours (Debian's
/// FFmpeg 5.1, our conversion) is within 1 level on average of PyAV's (its FFmpeg 8.1).
#[test]
fn pyav_goldens_of_each_codec() {
    let dir = vlm_test_support::fixtures_dir().join("video_codecs");
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("golden.json")).unwrap()).unwrap();
    let clips = meta["clips"].as_array().unwrap();
    assert_eq!(clips.len(), 4);
    for c in clips {
        let name = c["name"].as_str().unwrap();
        let file = std::fs::read(dir.join(c["file"].as_str().unwrap())).unwrap();
        let want = std::fs::read(dir.join(format!("{name}.rgb"))).unwrap();
        let (n, w, h) = (
            c["frames"].as_u64().unwrap() as u32,
            c["width"].as_u64().unwrap() as u32,
            c["height"].as_u64().unwrap() as u32,
        );
        let info = read_video_info(&file).unwrap();
        assert_eq!((info.frames, info.width, info.height), (n, w, h), "{name}");
        let frames = decode_video_frames(&file, &all_indices(n), LIMIT).unwrap();
        let got: Vec<u8> = frames.iter().flat_map(|f| f.as_raw().clone()).collect();
        assert_eq!(got.len(), want.len(), "{name}");
        let max = got
            .iter()
            .zip(&want)
            .map(|(a, b)| a.abs_diff(*b))
            .max()
            .unwrap();
        let mean = vlm_test_support::ffmpeg::mean_abs_diff(&got, &want);
        eprintln!("{name}: mean {mean:.3}, max {max} levels off PyAV's decode");
        assert!(
            mean <= 1.0,
            "{name}: {mean:.3} levels off PyAV's decode on average"
        );
    }
}

/// Frames resized as they are decoded equal the full decode resized afterwards (the gateway's
/// path, which holds one source-size frame at a time).
#[test]
fn resizing_while_decoding_equals_resizing_after() {
    let file =
        std::fs::read(vlm_test_support::fixtures_dir().join("video_codecs/hevc.mp4")).unwrap();
    let limits = vlm_preprocess::DecodeLimits::new(LIMIT);
    let idx = [0, 3, 3, 7];
    let full = vlm_preprocess::decode_video(&file, &idx, &limits).unwrap();
    let small = vlm_preprocess::decode_video_resized(&file, &idx, &limits, (32, 32)).unwrap();
    assert_eq!(small.times_s, full.times_s);
    assert_eq!(small.frames.len(), 4);
    for (s, f) in small.frames.iter().zip(&full.frames) {
        assert_eq!(s, &vlm_preprocess::resize_bicubic(f, 32, 32).unwrap());
    }
}

#[test]
fn the_pixel_limit_is_enforced_before_decoding() {
    let mut mp4 = unhex(X264_B_FRAMES);
    // Wreck every frame: only a check made before decoding can still answer with the limit.
    let (body, len) = top_box(&mp4, b"mdat");
    mp4[body..body + len].fill(0xee);
    let e = decode_video_frames(&mp4, &[0], 64 * 48 - 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("64x48 = 3072 pixels") && e.contains("decode limit of 3071 pixels"),
        "{e}"
    );
    let e = decode_video_frames(&mp4, &[9], 64 * 48)
        .unwrap_err()
        .to_string();
    assert!(e.contains("corrupt or truncated video"), "{e}");
}

#[test]
fn an_index_beyond_the_track_is_refused() {
    let mp4 = unhex(X264_B_FRAMES);
    let e = decode_video_frames(&mp4, &[0, 3, 10], LIMIT)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("frame index 10 is beyond the video's 10 frames"),
        "{e}"
    );
}

#[test]
fn non_video_data_is_refused() {
    let mut png = std::io::Cursor::new(Vec::new());
    pattern(16, 16, 0)
        .write_to(&mut png, image::ImageFormat::Png)
        .unwrap();
    let png = png.into_inner();
    let e = read_video_info(&png).unwrap_err().to_string();
    assert!(e.contains("unsupported video container 'png_pipe'"), "{e}");
    for data in [&png[..], b"hello, this is not a video", b"\0\0\0\x08ftyx"] {
        let e = read_video_info(data).unwrap_err().to_string();
        assert!(
            e.contains("unrecognised video format") || e.contains("unsupported video container"),
            "{e}"
        );
        assert!(decode_video_frames(data, &[0], LIMIT).is_err());
    }
    let e = read_video_info(&[]).unwrap_err().to_string();
    assert!(e.contains("empty"), "{e}");
}

/// xorshift64*: deterministic noise without a dependency.
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Decodes every frame; the result may be an error, but it must come back.
fn try_all(mp4: &[u8]) -> Result<usize, String> {
    let info = read_video_info(mp4).map_err(|e| e.to_string())?;
    let frames =
        decode_video_frames(mp4, &all_indices(info.frames), LIMIT).map_err(|e| e.to_string())?;
    assert_eq!(frames.len(), info.frames as usize);
    for f in &frames {
        assert_eq!(f.dimensions(), (info.width, info.height));
    }
    Ok(frames.len())
}

#[test]
fn truncated_files_are_refused() {
    for mp4 in [unhex(X264_B_FRAMES), unhex(X264_BT709_FULL_RANGE)] {
        let n = mp4.len();
        let mut cuts: Vec<usize> = (0..n).step_by(n / 29).collect();
        cuts.extend([1, 7, 8, 9, 31, 32, 33, n - 8, n - 1]);
        // The `moov` is at the end: every cut loses the header (the last bytes are `udta`,
        // which the demuxer may do without).
        for keep in cuts {
            match try_all(&mp4[..keep]) {
                Err(e) => assert!(
                    e.contains("truncated")
                        || e.contains("unrecognised video format")
                        || e.contains("unsupported video container")
                        || e.contains("no video stream")
                        || e.contains("empty"),
                    "cut to {keep} of {n}: {e}"
                ),
                Ok(_) => assert!(keep >= n - 64, "{keep} of {n} bytes decoded"),
            }
        }
    }
}

#[test]
fn random_bytes_are_refused() {
    let mut noise = Noise(0x9e37_79b9_7f4a_7c15);
    for round in 0..300 {
        let len = (noise.next() % 3000) as usize;
        let mut data: Vec<u8> = (0..len).map(|_| noise.next() as u8).collect();
        if round % 2 == 0 && len >= 8 {
            // Past the format check: an ftyp header, then noise.
            data[..8].copy_from_slice(b"\0\0\0\x08ftyp");
        }
        assert!(try_all(&data).is_err(), "round {round}: noise decoded");
    }
}

#[test]
fn flipped_bytes_in_the_frames_never_panic() {
    for mp4 in [unhex(X264_B_FRAMES), unhex(X264_BT709_FULL_RANGE)] {
        let (body, len) = top_box(&mp4, b"mdat");
        let mut noise = Noise(len as u64 | 1);
        let (mut errors, mut tries) = (0, 0);
        // Every byte of the first NAL units (length prefixes, headers, slice headers), then
        // spots all over the frame data.
        let spots: Vec<usize> = (0..64.min(len))
            .chain((0..200).map(|_| (noise.next() % len as u64) as usize))
            .collect();
        for at in spots {
            let mut bad = mp4.clone();
            bad[body + at] ^= 1 << (noise.next() % 8);
            tries += 1;
            // FFmpeg conceals most damage (as PyAV decodes it too); what it cannot is an error.
            if let Err(e) = try_all(&bad) {
                assert!(
                    e.contains("corrupt or truncated video"),
                    "byte {at} of mdat: {e}"
                );
                errors += 1;
            }
        }
        eprintln!("{errors} of {tries} single-bit flips in mdat were refused (the others decoded)");
    }
}

#[test]
fn flipped_bytes_in_the_header_never_panic() {
    for mp4 in [unhex(X264_B_FRAMES), unhex(X264_BT709_FULL_RANGE)] {
        let (body, len) = top_box(&mp4, b"moov");
        let mut refused = 0;
        for at in body - 8..body + len {
            for flip in [0xff, 0x01, 0x80] {
                let mut bad = mp4.clone();
                bad[at] ^= flip;
                refused += try_all(&bad).is_err() as usize;
            }
        }
        eprintln!(
            "{refused} of {} header byte flips were refused",
            (len + 8) * 3
        );
    }
}

/// libx264 (as above), 32x32, 3 frames, no B-frames, tagged BT.709 matrix and full range in its
/// VUI, which PyAV's conversion follows.
const X264_BT709_FULL_RANGE: &[&str] = &[
    "000000206674797069736f6d0000020069736f6d69736f32617663316d7034310000000866726565000002fb6d646174",
    "000002620605ffff5edc45e9bde6d948b7962cd820d923eeef78323634202d20636f726520313635202d20482e323634",
    "2f4d5045472d342041564320636f646563202d20436f70796c65667420323030332d32303235202d20687474703a2f2f",
    "7777772e766964656f6c616e2e6f72672f783236342e68746d6c202d206f7074696f6e733a2063616261633d31207265",
    "663d33206465626c6f636b3d313a303a3020616e616c7973653d3078333a3078313133206d653d686578207375626d65",
    "3d37207073793d31207073795f72643d312e30303a302e3030206d697865645f7265663d31206d655f72616e67653d31",
    "36206368726f6d615f6d653d31207472656c6c69733d31203878386463743d312063716d3d3020646561647a6f6e653d",
    "32312c313120666173745f70736b69703d31206368726f6d615f71705f6f66667365743d2d3220746872656164733d31",
    "206c6f6f6b61686561645f746872656164733d3120736c696365645f746872656164733d30206e723d3020646563696d",
    "6174653d3120696e7465726c616365643d3020626c757261795f636f6d7061743d3020636f6e73747261696e65645f69",
    "6e7472613d3020626672616d65733d3020776569676874703d32206b6579696e743d323530206b6579696e745f6d696e",
    "3d38207363656e656375743d343020696e7472615f726566726573683d302072635f6c6f6f6b61686561643d34302072",
    "633d637266206d62747265653d31206372663d31382e302071636f6d703d302e36302071706d696e3d302071706d6178",
    "3d3639207170737465703d342069705f726174696f3d312e34302061713d313a312e3030008000000054658884ffe89d",
    "50ea0bf5b01fa010b58e17f04b38faf9551deefaa773e9a0bf42582c998a4d4281b6834aa9afea097f3ec5a3d3fd5648",
    "a5313bbd75463bc5b6e2c6553c65c089f80d4fcbee642064ede0fd38b7ff00000012419a3a7a05d03f03903f0795ffe1",
    "256d33fc0000001b419a52784210c93d02e808007e07e0f502c024ff5979be0b938b79000003036d6f6f760000006c6d",
    "766864000000000000000000000000000003e80000017700010000010000000000000000000000000100000000000000",
    "000000000000000001000000000000000000000000000040000000000000000000000000000000000000000000000000",
    "00000000000002000002527472616b0000005c746b686400000003000000000000000000000001000000000000017700",
    "000000000000000000000000000000000100000000000000000000000000000001000000000000000000000000000040",
    "000000002000000020000000000024656474730000001c656c7374000000000000000100000177000000000001000000",
    "0001ca6d646961000000206d646864000000000000000000000000000040000000180055c400000000002d68646c7200",
    "0000000000000076696465000000000000000000000000566964656f48616e646c657200000001756d696e6600000014",
    "766d68640000000100000000000000000000002464696e660000001c6472656600000000000000010000000c75726c20",
    "00000001000001357374626c000000b1737473640000000000000001000000a161766331000000000000000100000000",
    "000000000000000000000000002000200048000000480000000000000001000000000000000000000000000000000000",
    "00000000000000000000000000000018ffff00000037617663430164000affe1001a6764000aacb212d3701010140000",
    "03000400000300403c48992001000668ebc08cb22cfdf8f80000000014627472740000000000003eea00000000000000",
    "18737474730000000000000001000000030000080000000014737473730000000000000001000000010000001c737473",
    "630000000000000001000000010000000300000001000000207374737a000000000000000000000003000002be000000",
    "160000001f000000147374636f0000000000000001000000300000003d75647461000000356d65746100000000000000",
    "2168646c7200000000000000006d6469726170706c00000000000000000000000008696c7374",
];

/// FNV-1a 64 of PyAV's rgb24 of each frame of the clip above.
const X264_BT709_PYAV_FNV: [u64; 3] = [0xbe8bafbd1af1b953, 0x301e7a9cf47b9a03, 0x7fa9ad396a9b4dab];

#[test]
fn vui_colour_signalling_is_followed_like_pyav() {
    let mp4 = unhex(X264_BT709_FULL_RANGE);
    let info = read_video_info(&mp4).unwrap();
    assert_eq!((info.width, info.height, info.frames), (32, 32, 3));
    let frames = decode_video_frames(&mp4, &[0, 1, 2], LIMIT).unwrap();
    for (i, f) in frames.iter().enumerate() {
        // (Not close to `pattern`: PyAV encoded its BT.601 limited-range YUV under these tags.)
        assert_eq!(fnv1a(f.as_raw()), X264_BT709_PYAV_FNV[i], "frame {i}");
    }
}

/// Found by cargo fuzz (`fuzz/fuzz_targets/video_decode.rs`): 1,002 bytes of MP4 whose header
/// declares 194 days of samples. The MOV demuxer indexed them all: 4.3 GB and 13 s before
/// FFmpeg's single allocations were bounded (`MAX_FFMPEG_ALLOC`); now a clear refusal at once.
#[test]
fn a_header_declaring_days_of_samples_is_refused_without_the_memory() {
    let file =
        std::fs::read(vlm_test_support::fixtures_dir().join("video_codecs/hostile/index-bomb.mp4"))
            .unwrap();
    assert_eq!(file.len(), 1002);
    let peak = || {
        let s = std::fs::read_to_string("/proc/self/status").unwrap();
        let kb: u64 = s
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap();
        kb << 10
    };
    let before = peak();
    let e = read_video_info(&file).unwrap_err().to_string();
    assert!(
        e.contains("more than FFmpeg may allocate at once (256 MiB)"),
        "{e}"
    );
    let grown = peak().saturating_sub(before);
    assert!(grown < 1 << 30, "the process peaked {grown} bytes higher");
}
