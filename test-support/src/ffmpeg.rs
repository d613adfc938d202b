//! Video fixtures made by the ffmpeg CLI (Debian's `ffmpeg`, installed by
//! `deploy/ci-install.sh`), in a temporary directory: `None` when no `ffmpeg` is on PATH, so a
//! test can `skip!`.
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};

/// Whether the ffmpeg CLI runs here.
pub fn available() -> bool {
    Command::new("ffmpeg")
        .arg("-version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn scratch(ext: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("vlm-ffmpeg-{}-{n}.{ext}", std::process::id()))
}

/// Runs `ffmpeg -y -loglevel error <args> <out.ext>` and returns the file's bytes. Panics when
/// ffmpeg is there but fails (a wrong fixture recipe), with its stderr.
pub fn make(args: &[&str], ext: &str) -> Option<Vec<u8>> {
    make_with_input(args, ext, None)
}

/// [`make`] with `input` on ffmpeg's stdin (`-i -`).
pub fn make_with_input(args: &[&str], ext: &str, input: Option<&[u8]>) -> Option<Vec<u8>> {
    if !available() {
        return None;
    }
    let out = scratch(ext);
    let mut child = Command::new("ffmpeg")
        .args(["-y", "-nostdin", "-loglevel", "error"])
        .args(args)
        .arg(&out)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning ffmpeg");
    if let Some(data) = input {
        let mut stdin = child.stdin.take().expect("piped");
        stdin.write_all(data).expect("writing to ffmpeg");
    }
    let res = child.wait_with_output().expect("waiting for ffmpeg");
    assert!(
        res.status.success(),
        "ffmpeg {args:?} failed: {}",
        String::from_utf8_lossy(&res.stderr)
    );
    let bytes = std::fs::read(&out).expect("ffmpeg's output");
    let _ = std::fs::remove_file(&out);
    Some(bytes)
}

/// An H.264 (yuv420p) clip of the lavfi source `source` (e.g.
/// `testsrc2=size=64x48:rate=2:duration=600`), with `args` (a preset, a rate factor) before
/// the output, in a file of type `ext`.
pub fn lavfi_h264(source: &str, args: &[&str], ext: &str) -> Option<Vec<u8>> {
    let mut all = vec![
        "-f", "lavfi", "-i", source, "-c:v", "libx264", "-pix_fmt", "yuv420p",
    ];
    all.extend_from_slice(args);
    make(&all, ext)
}

/// Encodes raw RGB24 frames (`width` x `height`, concatenated) at `fps` with `codec_args`
/// (e.g. `["-c:v", "libx264", "-pix_fmt", "yuv420p"]`) into a file of type `ext`.
pub fn encode_rgb(
    rgb: &[u8],
    width: u32,
    height: u32,
    fps: u32,
    codec_args: &[&str],
    ext: &str,
) -> Option<Vec<u8>> {
    let size = format!("{width}x{height}");
    let rate = fps.to_string();
    let mut args = vec![
        "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", &size, "-r", &rate, "-i", "-",
    ];
    args.extend_from_slice(codec_args);
    make_with_input(&args, ext, Some(rgb))
}

/// A triangle wave 0..=255 (no wrap-around edges).
fn tri(v: i64) -> u8 {
    let v = v.rem_euclid(510);
    (if v <= 255 { v } else { 510 - v }) as u8
}

/// Frame `t` of a clip of smooth moving gradients, `w` x `h` RGB bytes row by row (lossy
/// codecs keep them well at tiny sizes; the same formula made the embedded libx264 clips).
pub fn gradient_frame(w: u32, h: u32, t: i64) -> Vec<u8> {
    let mut out = Vec::with_capacity((w * h * 3) as usize);
    for y in 0..h as i64 {
        for x in 0..w as i64 {
            out.extend([
                tri(x * 3 + t * 12),
                tri(y * 4 + t * 7),
                tri((x + y) * 2 + 128 - t * 9),
            ]);
        }
    }
    out
}

/// Mean absolute difference per byte of two equally long frames (RGB bytes).
pub fn mean_abs_diff(a: &[u8], b: &[u8]) -> f64 {
    assert_eq!(a.len(), b.len(), "frames of different sizes");
    let sum: u64 = a.iter().zip(b).map(|(x, y)| x.abs_diff(*y) as u64).sum();
    sum as f64 / a.len() as f64
}
