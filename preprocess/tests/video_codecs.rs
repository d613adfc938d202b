//! Every container and codec users send (issue 39), made with the ffmpeg CLI from known RGB
//! frames and decoded back: header info, frames close to their sources in presentation
//! order, rotation, a long clip, and hostile input. Skipped (with a message) without ffmpeg.
use image::RgbImage;
use vlm_preprocess::{decode_video, decode_video_frames, read_video_info, DecodeLimits};
use vlm_test_support::ffmpeg;

const LIMIT: u64 = 1 << 24;
const W: u32 = 64;
const H: u32 = 48;
const N: u32 = 12;
const FPS: u32 = 8;

/// Frame `t`: smooth moving gradients (lossy codecs keep them well at tiny sizes).
fn pattern(w: u32, h: u32, t: i64) -> RgbImage {
    RgbImage::from_raw(w, h, vlm_test_support::ffmpeg::gradient_frame(w, h, t)).unwrap()
}

fn source(w: u32, h: u32, n: u32) -> Vec<RgbImage> {
    (0..n as i64).map(|t| pattern(w, h, t)).collect()
}

fn encode(frames: &[RgbImage], args: &[&str], ext: &str) -> Option<Vec<u8>> {
    let (w, h) = frames[0].dimensions();
    let rgb: Vec<u8> = frames.iter().flat_map(|f| f.as_raw().clone()).collect();
    ffmpeg::encode_rgb(&rgb, w, h, FPS, args, ext)
}

/// Mean absolute difference per channel value.
fn mad(a: &RgbImage, b: &RgbImage) -> f64 {
    assert_eq!(a.dimensions(), b.dimensions());
    vlm_test_support::ffmpeg::mean_abs_diff(a.as_raw(), b.as_raw())
}

macro_rules! need_ffmpeg {
    () => {
        if !ffmpeg::available() {
            vlm_test_support::skip!("no ffmpeg CLI (deploy/ci-install.sh installs it)");
            return;
        }
    };
}

/// Decodes frames 0, 5, 5, 11 of a clip of `source(W, H, N)` and checks each is nearest its
/// own source frame; returns the codec string.
fn check_clip(name: &str, file: &[u8], max_mad: f64) -> String {
    let src = source(W, H, N);
    let info = read_video_info(file).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(
        (info.width, info.height, info.frames),
        (W, H, N),
        "{name}: {info:?}"
    );
    let fps = info
        .fps
        .unwrap_or_else(|| panic!("{name}: no fps: {info:?}"));
    assert!((fps - FPS as f64).abs() < 0.01, "{name}: {info:?}");
    assert!((info.duration_s - 1.5).abs() < 0.2, "{name}: {info:?}");
    let idx = [0, 5, 5, 11];
    let got = decode_video(file, &idx, &DecodeLimits::new(LIMIT))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(got.frames[1], got.frames[2], "{name}");
    for ((&i, f), &t) in idx.iter().zip(&got.frames).zip(&got.times_s) {
        let own = mad(f, &src[i as usize]);
        assert!(
            own < max_mad,
            "{name} frame {i}: {own:.2} levels off its source"
        );
        for (j, other) in src.iter().enumerate() {
            if j != i as usize {
                assert!(
                    own < mad(f, other),
                    "{name} frame {i} is closer to frame {j}"
                );
            }
        }
        // Times from the stream's timestamps: frame i at i / fps.
        assert!(
            (t - i as f64 / FPS as f64).abs() < 0.01,
            "{name} frame {i} at {t}"
        );
    }
    eprintln!("{name}: {} ({})", info.codec, info.container);
    info.codec
}

#[test]
fn h264_profiles_and_containers() {
    need_ffmpeg!();
    let src = source(W, H, N);
    let x264 = ["-c:v", "libx264", "-crf", "10", "-bf", "3", "-g", "6"];
    let cases: &[(&str, &[&str], &str, &str)] = &[
        ("mp4 High", &["-pix_fmt", "yuv420p"], "mp4", "h264 (High)"),
        (
            "mp4 High 10",
            &["-pix_fmt", "yuv420p10le"],
            "mp4",
            "h264 (High 10)",
        ),
        (
            "mp4 High 4:4:4",
            &["-pix_fmt", "yuv444p"],
            "mp4",
            "h264 (High 4:4:4 Predictive)",
        ),
        ("mkv High", &["-pix_fmt", "yuv420p"], "mkv", "h264"),
        (
            "fragmented mp4",
            &[
                "-pix_fmt",
                "yuv420p",
                "-movflags",
                "frag_keyframe+empty_moov",
            ],
            "mp4",
            "h264 (High)",
        ),
        (
            "mov, moov first",
            &["-pix_fmt", "yuv420p", "-movflags", "+faststart"],
            "mov",
            "h264",
        ),
    ];
    for (name, extra, ext, codec) in cases {
        let args: Vec<&str> = x264.iter().chain(extra.iter()).copied().collect();
        let file = encode(&src, &args, ext).expect("ffmpeg");
        let got = check_clip(name, &file, 4.0);
        assert!(got.starts_with(codec), "{name}: {got}");
    }
}

#[test]
fn h264_with_audio_tracks() {
    need_ffmpeg!();
    let src = source(W, H, N);
    for (audio, ext) in [("aac", "mp4"), ("libopus", "mp4"), ("libopus", "webm")] {
        let vcodec = if ext == "webm" {
            "libvpx-vp9"
        } else {
            "libx264"
        };
        let args = [
            "-f",
            "lavfi",
            "-i",
            "sine=frequency=440:duration=1.5",
            "-c:v",
            vcodec,
            "-crf",
            "10",
            "-b:v",
            "0",
            "-pix_fmt",
            "yuv420p",
            "-c:a",
            audio,
            "-shortest",
        ];
        let file = encode(&src, &args, ext).expect("ffmpeg");
        check_clip(&format!("{vcodec} + {audio} in {ext}"), &file, 6.0);
    }
}

#[test]
fn hevc_vp8_vp9_av1_mpeg4() {
    need_ffmpeg!();
    let src = source(W, H, N);
    let x265: &[&str] = &[
        "-c:v",
        "libx265",
        "-crf",
        "8",
        "-x265-params",
        "log-level=none",
        "-pix_fmt",
        "yuv420p",
    ];
    let cases: Vec<(&str, Vec<&str>, &str, &str, f64)> = vec![
        (
            "HEVC mp4 hvc1",
            [x265, &["-tag:v", "hvc1"]].concat(),
            "mp4",
            "hevc (Main)",
            4.0,
        ),
        (
            "HEVC mov hvc1",
            [x265, &["-tag:v", "hvc1"]].concat(),
            "mov",
            "hevc (Main)",
            4.0,
        ),
        (
            "VP9 webm",
            vec![
                "-c:v",
                "libvpx-vp9",
                "-crf",
                "10",
                "-b:v",
                "0",
                "-deadline",
                "realtime",
                "-pix_fmt",
                "yuv420p",
            ],
            "webm",
            "vp9",
            6.0,
        ),
        (
            "VP8 webm",
            vec![
                "-c:v",
                "libvpx",
                "-crf",
                "4",
                "-b:v",
                "2M",
                "-deadline",
                "realtime",
            ],
            "webm",
            "vp8",
            6.0,
        ),
        (
            "AV1 mp4",
            vec![
                "-c:v",
                "libaom-av1",
                "-crf",
                "10",
                "-cpu-used",
                "8",
                "-usage",
                "realtime",
                "-pix_fmt",
                "yuv420p",
            ],
            "mp4",
            "av1 (Main)",
            6.0,
        ),
        (
            "MPEG-4 Part 2 avi",
            vec!["-c:v", "mpeg4", "-q:v", "2"],
            "avi",
            "mpeg4",
            6.0,
        ),
        (
            "MPEG-4 Part 2 mp4",
            vec!["-c:v", "mpeg4", "-q:v", "2"],
            "mp4",
            "mpeg4",
            6.0,
        ),
    ];
    for (name, args, ext, codec, tol) in cases {
        let file = encode(&src, &args, ext).expect("ffmpeg");
        let got = check_clip(name, &file, tol);
        assert!(got.starts_with(codec), "{name}: {got}");
    }
}

/// A display matrix (a portrait phone clip) gives the frames of the same clip turned before
/// encoding, as the ffmpeg CLI's autorotate turns them. Lossless 4:4:4, so chroma siting plays
/// no part. (FFmpeg 5.1's CLI sets the matrix from a `rotate` tag on a stream copy only, and
/// `rotate=90` asks for a quarter turn counterclockwise.)
#[test]
fn rotation_is_applied() {
    need_ffmpeg!();
    let src = source(W, H, 4);
    let lossless = [
        "-c:v",
        "libx264",
        "-qp",
        "0",
        "-pix_fmt",
        "yuv444p",
        "-movflags",
        "+faststart",
    ];
    let upright_src = encode(&src, &lossless, "mp4").expect("ffmpeg");
    for (tag, clockwise) in [("90", 270), ("180", 180), ("270", 90)] {
        let meta = format!("rotate={tag}");
        let rotated = ffmpeg::make_with_input(
            &[
                "-i",
                "-",
                "-c",
                "copy",
                "-metadata:s:v:0",
                &meta,
                "-f",
                "mp4",
            ],
            "mp4",
            Some(&upright_src),
        )
        .expect("ffmpeg");
        let turned: Vec<RgbImage> = src
            .iter()
            .map(|f| match clockwise {
                90 => image::imageops::rotate90(f),
                180 => image::imageops::rotate180(f),
                _ => image::imageops::rotate270(f),
            })
            .collect();
        let upright = encode(&turned, &lossless, "mp4").expect("ffmpeg");
        let info = read_video_info(&rotated).unwrap();
        assert_eq!(info.rotation, clockwise, "{info:?}");
        let (w, h) = turned[0].dimensions();
        assert_eq!((info.width, info.height), (w, h), "{info:?}");
        let a = decode_video_frames(&rotated, &[0, 3], LIMIT).unwrap();
        let b = decode_video_frames(&upright, &[0, 3], LIMIT).unwrap();
        for k in 0..2 {
            let d = mad(&a[k], &b[k]);
            assert!(
                d < 1.0,
                "rotate={tag}: frame {k} is {d:.2} levels off the turned clip"
            );
        }
    }
}

/// 17 s at 4 fps: longer than the 16 s the old image queue allowed; the last frame decodes.
#[test]
fn a_17_second_clip() {
    need_ffmpeg!();
    let file =
        ffmpeg::lavfi_h264("testsrc2=size=64x48:rate=4:duration=17", &[], "mp4").expect("ffmpeg");
    let info = read_video_info(&file).unwrap();
    assert_eq!(info.frames, 68, "{info:?}");
    assert!((info.duration_s - 17.0).abs() < 0.01, "{info:?}");
    let got = decode_video(&file, &[0, 33, 67], &DecodeLimits::new(LIMIT)).unwrap();
    assert!((got.times_s[2] - 16.75).abs() < 0.01, "{:?}", got.times_s);
}

#[test]
fn unsupported_codecs_and_streams_are_named() {
    need_ffmpeg!();
    let src = source(W, H, 4);
    let ffv1 = encode(&src, &["-c:v", "ffv1"], "mkv").expect("ffmpeg");
    let e = read_video_info(&ffv1).unwrap_err().to_string();
    assert!(e.contains("unsupported video codec 'ffv1'"), "{e}");
    let mjpeg = encode(&src, &["-c:v", "mjpeg"], "avi").expect("ffmpeg");
    let e = decode_video_frames(&mjpeg, &[0], LIMIT)
        .unwrap_err()
        .to_string();
    assert!(e.contains("unsupported video codec 'mjpeg'"), "{e}");
    let audio = ffmpeg::make(
        &["-f", "lavfi", "-i", "sine=duration=0.5", "-c:a", "libopus"],
        "mka",
    )
    .expect("ffmpeg");
    let e = read_video_info(&audio).unwrap_err().to_string();
    assert!(e.contains("has no video stream"), "{e}");
    let wav = ffmpeg::make(&["-f", "lavfi", "-i", "sine=duration=0.5"], "wav").expect("ffmpeg");
    let e = read_video_info(&wav).unwrap_err().to_string();
    assert!(e.contains("unsupported video container 'wav'"), "{e}");
}

/// Hostile bytes: errors, quickly, never a panic.
#[test]
fn hostile_input_is_refused() {
    need_ffmpeg!();
    let e = read_video_info(&[]).unwrap_err().to_string();
    assert!(e.contains("empty"), "{e}");
    let noise = vlm_test_support::noise(100_000);
    assert!(read_video_info(&noise).is_err());
    assert!(decode_video_frames(&noise, &[0], LIMIT).is_err());
    let src = source(W, H, N);
    let args = ["-c:v", "libx264", "-pix_fmt", "yuv420p"];
    for (ext, flags) in [("mp4", "+faststart"), ("mkv", ""), ("webm", "")] {
        let mut args = args.to_vec();
        if ext == "webm" {
            args = vec!["-c:v", "libvpx-vp9", "-deadline", "realtime"];
        }
        if !flags.is_empty() {
            args.extend(["-movflags", flags]);
        }
        let file = encode(&src, &args, ext).expect("ffmpeg");
        for keep in [8, file.len() / 4, file.len() / 2, file.len() * 3 / 4] {
            let cut = &file[..keep];
            let res = read_video_info(cut)
                .and_then(|i| decode_video_frames(cut, &(0..i.frames).collect::<Vec<_>>(), LIMIT));
            match res {
                Err(e) => eprintln!("{ext} cut to {keep}: {e}"),
                Ok(f) => eprintln!("{ext} cut to {keep}: {} frames decoded", f.len()),
            }
        }
    }
    // The pixel limit is applied from the header, before decoding.
    let file = encode(&src, &args, "mp4").expect("ffmpeg");
    let e = decode_video_frames(&file, &[0], 64 * 48 - 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("64x48 = 3072 pixels") && e.contains("limit of 3071"),
        "{e}"
    );
    // The packet budget stops the work.
    let tight = DecodeLimits {
        max_packets: 3,
        ..DecodeLimits::new(LIMIT)
    };
    let e = decode_video(&file, &[11], &tight).unwrap_err().to_string();
    assert!(e.contains("too many packets"), "{e}");
}

/// Bytes flipped all over clips of each codec: errors or frames, never a crash or a hang
/// (FFmpeg's parsers run on them; a crash would abort this test's process).
#[test]
fn mutated_files_never_crash() {
    need_ffmpeg!();
    let src = source(W, H, 6);
    let recipes: &[(&[&str], &str)] = &[
        (
            &["-c:v", "libx264", "-pix_fmt", "yuv420p", "-bf", "2"],
            "mp4",
        ),
        (
            &[
                "-c:v",
                "libx265",
                "-x265-params",
                "log-level=none",
                "-pix_fmt",
                "yuv420p",
            ],
            "mkv",
        ),
        (
            &[
                "-c:v",
                "libvpx-vp9",
                "-deadline",
                "realtime",
                "-pix_fmt",
                "yuv420p",
            ],
            "webm",
        ),
        (
            &[
                "-c:v",
                "libaom-av1",
                "-cpu-used",
                "8",
                "-usage",
                "realtime",
                "-pix_fmt",
                "yuv420p",
            ],
            "mp4",
        ),
        (&["-c:v", "mpeg4"], "avi"),
    ];
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let started = std::time::Instant::now();
    for (args, ext) in recipes {
        let file = encode(&src, args, ext).expect("ffmpeg");
        let (mut ok, mut refused) = (0, 0);
        for _ in 0..250 {
            let mut bad = file.clone();
            for _ in 0..1 + next() % 4 {
                let at = (next() % bad.len() as u64) as usize;
                bad[at] ^= 1 << (next() % 8);
            }
            let res = read_video_info(&bad).and_then(|i| {
                let idx: Vec<u32> = (0..i.frames.min(64)).collect();
                decode_video_frames(&bad, &idx, LIMIT)
            });
            match res {
                Ok(_) => ok += 1,
                Err(_) => refused += 1,
            }
        }
        eprintln!("{ext} {}: {ok} decoded, {refused} refused", args[1]);
    }
    assert!(started.elapsed().as_secs() < 60, "{:?}", started.elapsed());
}

/// This process's resident memory, in bytes (VmRSS).
fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

/// Memory returns after each decode: a ~5 MB clip read to its last packet 12 times grows
/// the process by far less than one clip. Reusing one `Packet` for `av_read_frame` leaked
/// every packet's buffer (found by cargo fuzz's LeakSanitizer): 12 reads grew it by ~60 MB.
#[test]
fn repeated_decodes_give_their_memory_back() {
    need_ffmpeg!();
    let noise = ffmpeg::lavfi_h264(
        "nullsrc=s=256x192:d=4:r=20,geq=lum='random(1)*255':cb=128:cr=128",
        &["-qp", "0"],
        "mkv",
    )
    .expect("ffmpeg");
    assert!(noise.len() > 3 << 20, "{} bytes", noise.len());
    let once = || {
        let info = read_video_info(&noise).unwrap();
        let f = decode_video_frames(&noise, &[info.frames - 1], LIMIT).unwrap();
        assert_eq!(f.len(), 1);
    };
    // Warm up (allocator arenas, FFmpeg's tables), then measure.
    once();
    once();
    let before = rss();
    for _ in 0..12 {
        once();
    }
    let grown = rss().saturating_sub(before);
    assert!(
        grown < noise.len() as u64,
        "12 decodes of a {} byte clip grew the process by {grown} bytes",
        noise.len()
    );
}

/// Decode time of a 1080p 30 fps 10 s H.264 clip sampled at 2 fps (20 of 300 frames), printed:
/// `cargo test -p vlm-preprocess --test video_codecs -- --ignored --nocapture timing`.
#[test]
#[ignore = "a measurement, not a check"]
fn timing_1080p() {
    need_ffmpeg!();
    let file = ffmpeg::lavfi_h264(
        "testsrc2=size=1920x1080:rate=30:duration=10",
        &["-preset", "ultrafast"],
        "mp4",
    )
    .expect("ffmpeg");
    let t = std::time::Instant::now();
    let info = read_video_info(&file).unwrap();
    let header = t.elapsed();
    let idx: Vec<u32> = (0..20).map(|k| k * 15 + 7).collect();
    let t = std::time::Instant::now();
    let frames = decode_video_frames(&file, &idx, LIMIT).unwrap();
    eprintln!(
        "1080p H.264, {} frames, {} bytes: header {header:?}, 20 sampled frames decoded in {:?}",
        info.frames,
        file.len(),
        t.elapsed()
    );
    assert_eq!(frames.len(), 20);
}
