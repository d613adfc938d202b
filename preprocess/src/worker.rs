//! What FFmpeg parses (video files, AVIF images) is parsed in a child process, one per call,
//! so a fault in FFmpeg's parsers (which read attacker-supplied bytes) ends that request only,
//! never the service and its other requests; a child that hangs is killed at a deadline, its
//! address space is bounded, and its memory goes back to the system when it exits. Images the
//! `image` crate decodes (memory-safe Rust) stay in process.
//!
//! The child is the calling executable started with [`WORKER_FLAG`] (the gateway's and the
//! vision service's `main` hand it to [`serve_stdio`] before parsing flags). One request on
//! stdin, one answer on stdout, in a small binary framing of our own (both ends are this
//! file):
//!
//! - request: `op` (1 byte: 0 probe a video, 1 decode a video, 2 an image's size, 3 decode an
//!   image); for a video decode: max frame pixels (u64), decoder threads (u32), resized width
//!   and height (u32, u32), the frame count and the indices (u32 each); for an image decode:
//!   max pixels (u64); then the file's bytes to the end of the stream;
//! - answer: 0 and the result, or 1 and the error's text. A probe's result is the header
//!   ([`VideoInfo`]); a video decode's, the frame count, then each frame's width, height, time
//!   (f64) and RGB bytes; an image's size, width and height; an image decode's, one frame as a
//!   video's. Integers are little-endian; strings are a u32 length and UTF-8.
use crate::{DecodeLimits, DecodedVideo, PreprocessError, RgbImage, VideoInfo};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The first argument that makes a service executable a media worker.
pub const WORKER_FLAG: &str = "--media-worker";

/// Where FFmpeg parses files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MediaDecoding {
    /// In a child process of this executable, one per call (the service binaries' default).
    Isolated { exe: PathBuf },
    /// In the calling process (libraries and tests that embed a service).
    InProcess,
}

impl MediaDecoding {
    pub fn describe(&self) -> String {
        match self {
            MediaDecoding::Isolated { exe } => format!("isolated (a child of {})", exe.display()),
            MediaDecoding::InProcess => "in process".into(),
        }
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum WorkerError {
    /// FFmpeg (or our checks) refused the file: the message as the decoder gave it.
    #[error("{0}")]
    Refused(String),
    #[error("the media decoder stopped on this file ({0}); the file is likely malformed")]
    Crashed(String),
    #[error("decoding took longer than {0:?}, the limit")]
    TimedOut(Duration),
    /// Starting or talking to the child failed: the server's fault, not the file's.
    #[error("the media worker failed: {0}")]
    Worker(String),
}

/// The child's deadline past the decode's own wall-time bound: time to start and to send.
const GRACE: Duration = Duration::from_secs(10);

/// The child's address space (RLIMIT_AS): a 4096x4096 frame, its decoder's reference
/// pictures and the resized output fit many times over; a file that makes FFmpeg allocate
/// past it fails its own request instead of pressing on the gateway's pod.
pub const WORKER_ADDRESS_SPACE: u64 = 4 << 30;

/// Reads the header of a video file.
pub fn probe(how: &MediaDecoding, bytes: &[u8]) -> Result<VideoInfo, WorkerError> {
    match how {
        MediaDecoding::InProcess => {
            crate::read_video_info(bytes).map_err(|e| WorkerError::Refused(e.to_string()))
        }
        MediaDecoding::Isolated { exe } => {
            let deadline = DecodeLimits::new(0).max_time + GRACE;
            let out = run(exe, &[0], bytes, deadline)?;
            read_info(&mut out.as_slice()).map_err(WorkerError::Worker)
        }
    }
}

/// Decodes the frames at `indices`, each resized to `size` as it comes out
/// ([`crate::decode_video_resized`]).
pub fn decode(
    how: &MediaDecoding,
    bytes: &[u8],
    indices: &[u32],
    limits: &DecodeLimits,
    size: (u32, u32),
) -> Result<DecodedVideo, WorkerError> {
    match how {
        MediaDecoding::InProcess => crate::decode_video_resized(bytes, indices, limits, size)
            .map_err(|e| WorkerError::Refused(e.to_string())),
        MediaDecoding::Isolated { exe } => {
            let mut head = vec![1u8];
            head.extend(limits.max_frame_pixels.to_le_bytes());
            head.extend(u32::try_from(limits.threads).unwrap_or(1).to_le_bytes());
            head.extend(size.0.to_le_bytes());
            head.extend(size.1.to_le_bytes());
            head.extend((indices.len() as u32).to_le_bytes());
            for i in indices {
                head.extend(i.to_le_bytes());
            }
            let out = run(exe, &head, bytes, limits.max_time + GRACE)?;
            read_frames(&mut out.as_slice()).map_err(WorkerError::Worker)
        }
    }
}

/// An image's displayed size from its header ([`crate::read_image_size`]): AVIF (FFmpeg's
/// demuxer) per `how`, every other format in process.
pub fn read_image_size(how: &MediaDecoding, bytes: &[u8]) -> Result<(u32, u32), PreprocessError> {
    match how {
        MediaDecoding::Isolated { exe } if crate::decode::is_avif(bytes) => {
            let out = run(exe, &[2], bytes, DecodeLimits::new(0).max_time + GRACE)
                .map_err(image_error)?;
            let r = &mut out.as_slice();
            let w = take(r).map(u32::from_le_bytes);
            let h = take(r).map(u32::from_le_bytes);
            w.and_then(|w| Ok((w, h?)))
                .map_err(|e| image_error(WorkerError::Worker(e)))
        }
        _ => crate::read_image_size(bytes),
    }
}

/// An image decoded to RGB ([`crate::decode_image`]): AVIF (FFmpeg's decoders) per `how`,
/// every other format in process.
pub fn decode_image(
    how: &MediaDecoding,
    bytes: &[u8],
    max_decode_pixels: u64,
) -> Result<RgbImage, PreprocessError> {
    match how {
        MediaDecoding::Isolated { exe } if crate::decode::is_avif(bytes) => {
            let mut head = vec![3u8];
            head.extend(max_decode_pixels.to_le_bytes());
            let out = run(exe, &head, bytes, DecodeLimits::new(0).max_time + GRACE)
                .map_err(image_error)?;
            let mut v = read_frames(&mut out.as_slice())
                .map_err(|e| image_error(WorkerError::Worker(e)))?;
            v.frames
                .pop()
                .ok_or_else(|| image_error(WorkerError::Worker("no image in the answer".into())))
        }
        _ => crate::decode_image(bytes, max_decode_pixels),
    }
}

/// The image paths report the caller's input errors as such; a worker that could not run says
/// so in the message.
fn image_error(e: WorkerError) -> PreprocessError {
    match e {
        WorkerError::Refused(m) => {
            PreprocessError(m.strip_prefix("invalid input: ").unwrap_or(&m).to_string())
        }
        e => PreprocessError::invalid(e.to_string()),
    }
}

/// Starts the child, sends `head` and `bytes`, and returns its result's bytes (after the
/// status byte). The child reads all its input before it writes, so writing everything and
/// then reading cannot deadlock.
fn run(exe: &Path, head: &[u8], bytes: &[u8], deadline: Duration) -> Result<Vec<u8>, WorkerError> {
    let op = ["probe", "decode", "image-size", "image"][head[0] as usize];
    let mut cmd = Command::new(exe);
    // SAFETY: setrlimit(2) only, which is async-signal-safe, between fork and exec.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: WORKER_ADDRESS_SPACE,
                rlim_max: WORKER_ADDRESS_SPACE,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .args([WORKER_FLAG, op])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| WorkerError::Worker(format!("starting {}: {e}", exe.display())))?;
    let pid = child.id();
    // The watchdog kills a child past its deadline; the read below then ends.
    let (done, watch) = mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if let Err(mpsc::RecvTimeoutError::Timeout) = watch.recv_timeout(deadline) {
            // SAFETY: kill(2) on our own child's pid, not yet reaped: nothing waits for it until
            // this thread is joined.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            return true;
        }
        false
    });
    let mut stdin = child.stdin.take().expect("piped");
    // A child that died early closes its end: the write fails, and its status says why.
    let _ = stdin.write_all(head).and_then(|()| stdin.write_all(bytes));
    drop(stdin);
    let mut out = Vec::new();
    // Ends when the child closes its output: it answered and is exiting, or it was killed.
    let _ = child.stdout.take().expect("piped").read_to_end(&mut out);
    let _ = done.send(());
    let killed = watchdog.join().unwrap_or(false);
    let status = reap(&mut child)
        .map_err(|e| WorkerError::Worker(format!("waiting for the worker: {e}")))?;
    if killed {
        return Err(WorkerError::TimedOut(deadline));
    }
    if !status.success() {
        use std::os::unix::process::ExitStatusExt;
        return Err(match status.signal() {
            Some(sig) => WorkerError::Crashed(format!("signal {sig}")),
            None => WorkerError::Worker(format!("the worker exited with {status}")),
        });
    }
    match out.first() {
        Some(0) => {
            out.drain(..1); // the status byte; the frames are not copied
            Ok(out)
        }
        Some(1) => Err(WorkerError::Refused(
            String::from_utf8_lossy(&out[1..]).into_owned(),
        )),
        _ => Err(WorkerError::Worker("the worker's answer is empty".into())),
    }
}

/// Waits for a child that closed its output; one still there a second later is killed.
fn reap(child: &mut std::process::Child) -> std::io::Result<std::process::ExitStatus> {
    let until = std::time::Instant::now() + Duration::from_secs(1);
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if std::time::Instant::now() >= until {
            let _ = child.kill();
            return child.wait();
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The child's side: one request from stdin, its answer on stdout. Returns the exit code.
pub fn serve_stdio() -> i32 {
    let mut input = Vec::new();
    if std::io::stdin().lock().read_to_end(&mut input).is_err() {
        return 2;
    }
    let answer = match answer(&input) {
        Ok(result) => [vec![0u8], result].concat(),
        Err(message) => [vec![1u8], message.into_bytes()].concat(),
    };
    let mut out = std::io::stdout().lock();
    if out.write_all(&answer).and_then(|()| out.flush()).is_err() {
        return 2;
    }
    0
}

fn answer(input: &[u8]) -> Result<Vec<u8>, String> {
    let (op, mut rest) = input.split_first().ok_or("an empty request")?;
    match op {
        0 => {
            let info = crate::read_video_info(rest).map_err(|e| e.to_string())?;
            Ok(write_info(&info))
        }
        1 => {
            let max_frame_pixels = u64::from_le_bytes(take(&mut rest)?);
            let threads = u32::from_le_bytes(take(&mut rest)?) as usize;
            let size = (
                u32::from_le_bytes(take(&mut rest)?),
                u32::from_le_bytes(take(&mut rest)?),
            );
            let n = u32::from_le_bytes(take(&mut rest)?) as usize;
            let indices = (0..n)
                .map(|_| take(&mut rest).map(u32::from_le_bytes))
                .collect::<Result<Vec<u32>, String>>()?;
            let limits = DecodeLimits {
                threads,
                ..DecodeLimits::new(max_frame_pixels)
            };
            let video = crate::decode_video_resized(rest, &indices, &limits, size)
                .map_err(|e| e.to_string())?;
            Ok(write_frames(&video))
        }
        2 => {
            let (w, h) = crate::read_image_size(rest).map_err(|e| e.to_string())?;
            Ok([w.to_le_bytes(), h.to_le_bytes()].concat())
        }
        3 => {
            let max_pixels = u64::from_le_bytes(take(&mut rest)?);
            let img = crate::decode_image(rest, max_pixels).map_err(|e| e.to_string())?;
            Ok(write_frames(&DecodedVideo {
                frames: vec![img],
                times_s: vec![0.0],
            }))
        }
        _ => Err(format!("unknown operation {op}")),
    }
}

fn take<const N: usize>(r: &mut &[u8]) -> Result<[u8; N], String> {
    if r.len() < N {
        return Err("a truncated message".into());
    }
    let (a, b) = r.split_at(N);
    *r = b;
    Ok(a.try_into().expect("N bytes"))
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u32).to_le_bytes());
    out.extend(s.as_bytes());
}

fn take_str(r: &mut &[u8]) -> Result<String, String> {
    let n = u32::from_le_bytes(take(r)?) as usize;
    if r.len() < n {
        return Err("a truncated string".into());
    }
    let (a, b) = r.split_at(n);
    *r = b;
    String::from_utf8(a.to_vec()).map_err(|e| e.to_string())
}

fn write_info(i: &VideoInfo) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend(i.width.to_le_bytes());
    out.extend(i.height.to_le_bytes());
    out.extend(i.frames.to_le_bytes());
    out.extend(i.fps.unwrap_or(f64::NAN).to_le_bytes());
    out.extend(i.duration_s.to_le_bytes());
    out.extend(i.rotation.to_le_bytes());
    put_str(&mut out, &i.codec);
    put_str(&mut out, &i.container);
    out
}

fn read_info(r: &mut &[u8]) -> Result<VideoInfo, String> {
    let width = u32::from_le_bytes(take(r)?);
    let height = u32::from_le_bytes(take(r)?);
    let frames = u32::from_le_bytes(take(r)?);
    let fps = f64::from_le_bytes(take(r)?);
    let duration_s = f64::from_le_bytes(take(r)?);
    let rotation = u32::from_le_bytes(take(r)?);
    Ok(VideoInfo {
        width,
        height,
        frames,
        fps: (!fps.is_nan()).then_some(fps),
        codec: take_str(r)?,
        duration_s,
        container: take_str(r)?,
        rotation,
    })
}

fn write_frames(v: &DecodedVideo) -> Vec<u8> {
    let bytes: usize = v.frames.iter().map(|f| f.as_raw().len() + 16).sum();
    let mut out = Vec::with_capacity(4 + bytes);
    out.extend((v.frames.len() as u32).to_le_bytes());
    for (f, t) in v.frames.iter().zip(&v.times_s) {
        out.extend(f.width().to_le_bytes());
        out.extend(f.height().to_le_bytes());
        out.extend(t.to_le_bytes());
        out.extend(f.as_raw());
    }
    out
}

fn read_frames(r: &mut &[u8]) -> Result<DecodedVideo, String> {
    let n = u32::from_le_bytes(take(r)?) as usize;
    let mut v = DecodedVideo::default();
    for _ in 0..n {
        let w = u32::from_le_bytes(take(r)?);
        let h = u32::from_le_bytes(take(r)?);
        let t = f64::from_le_bytes(take(r)?);
        let len = w as usize * h as usize * 3;
        if r.len() < len {
            return Err("a truncated frame".into());
        }
        let (px, rest) = r.split_at(len);
        *r = rest;
        v.frames
            .push(RgbImage::from_raw(w, h, px.to_vec()).ok_or("a frame of the wrong size")?);
        v.times_s.push(t);
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_and_frames_survive_the_framing() {
        let info = VideoInfo {
            width: 64,
            height: 48,
            frames: 9,
            fps: None,
            codec: "hevc (Main)".into(),
            duration_s: 1.5,
            container: "mov,mp4,m4a,3gp,3g2,mj2".into(),
            rotation: 90,
        };
        assert_eq!(read_info(&mut write_info(&info).as_slice()).unwrap(), info);
        let v = DecodedVideo {
            frames: vec![
                RgbImage::from_fn(3, 2, |x, y| image::Rgb([x as u8, y as u8, 7])),
                RgbImage::new(1, 1),
            ],
            times_s: vec![0.0, 0.25],
        };
        let bytes = write_frames(&v);
        assert_eq!(read_frames(&mut bytes.as_slice()).unwrap(), v);
        assert!(read_frames(&mut &bytes[..bytes.len() - 1]).is_err());
    }

    /// The child's side of the image operations answers what the in-process calls give.
    #[test]
    fn the_image_operations_answer_as_in_process() {
        let avif = std::fs::read(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/lossy420.avif"),
        )
        .unwrap();
        let size = answer(&[&[2u8][..], &avif].concat()).unwrap();
        let (w, h) = crate::read_image_size(&avif).unwrap();
        assert_eq!(size, [w.to_le_bytes(), h.to_le_bytes()].concat());
        let mut head = vec![3u8];
        head.extend((1u64 << 24).to_le_bytes());
        let frames = answer(&[&head[..], &avif].concat()).unwrap();
        let got = read_frames(&mut frames.as_slice()).unwrap();
        assert_eq!(
            got.frames,
            vec![crate::decode_image(&avif, 1 << 24).unwrap()]
        );
        // Refusals come back as text, as the in-process error says them.
        let mut tiny = vec![3u8];
        tiny.extend(16u64.to_le_bytes());
        let e = answer(&[&tiny[..], &avif].concat()).unwrap_err();
        assert!(e.contains("over the decode limit of 16 pixels"), "{e}");
    }
}
