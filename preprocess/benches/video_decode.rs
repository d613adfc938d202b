//! Decode time and peak memory of one video file as the gateway samples it (Qwen3-VL's fps
//! rule): `read_video_info`, the sampled indices, `decode_video_frames` of those. Prints one
//! JSON line; `scripts/bench-video-loader.py` runs it next to vLLM's loader on the same files,
//! one process per file so the peak is that file's.
//!
//!   VLM_BENCH_VIDEO=clip.mp4 [VLM_BENCH_FPS=2] [VLM_BENCH_MAX_FRAMES=768] [VLM_BENCH_THREADS=2] \
//!     [VLM_BENCH_RESIZE=1] \
//!     cargo bench -p vlm-preprocess --bench video_decode
use std::time::Instant;
use vlm_config::video::{sample_indices, Sampling, VideoGeometry, VideoProcessorConfig};

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The process's peak resident set (VmHWM), in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn main() {
    let Ok(path) = std::env::var("VLM_BENCH_VIDEO") else {
        eprintln!("set VLM_BENCH_VIDEO to a video file");
        return;
    };
    let fps: f64 = env_or("VLM_BENCH_FPS", 2.0);
    let cfg = VideoProcessorConfig {
        max_frames: env_or("VLM_BENCH_MAX_FRAMES", 768),
        ..VideoProcessorConfig::default()
    };
    let bytes = std::fs::read(&path).expect("reading the video");
    let baseline = peak_rss();
    let t = Instant::now();
    let info = vlm_preprocess::read_video_info(&bytes).expect("a video");
    let indices =
        sample_indices(info.frames, info.fps, Sampling::Fps(fps), &cfg).expect("sampling");
    // The gateway's default (`--video-decode-threads`).
    let limits = vlm_preprocess::DecodeLimits {
        threads: env_or("VLM_BENCH_THREADS", 2),
        ..vlm_preprocess::DecodeLimits::new(u64::MAX)
    };
    // VLM_BENCH_RESIZE=1: as the gateway does, each frame resized to the processor's size as
    // it is decoded (`decode_video_resized`).
    let frames = if env_or("VLM_BENCH_RESIZE", 0u8) == 1 {
        let geo = VideoGeometry::plan(
            info.width,
            info.height,
            info.frames,
            info.fps,
            Sampling::Fps(fps),
            &cfg,
        )
        .expect("planning");
        let size = (geo.resized_width, geo.resized_height);
        vlm_preprocess::decode_video_resized(&bytes, &indices, &limits, size)
    } else {
        vlm_preprocess::decode_video(&bytes, &indices, &limits)
    }
    .expect("decoding")
    .frames;
    let seconds = t.elapsed().as_secs_f64();
    println!(
        "{{\"file\": {path:?}, \"seconds\": {seconds:.3}, \"frames\": {}, \"of\": {}, \"threads\": {}, \
         \"width\": {}, \"height\": {}, \"out\": \"{}x{}\", \"peak_rss_bytes\": {}, \"file_bytes\": {}, \
         \"baseline_rss_bytes\": {baseline}}}",
        frames.len(),
        info.frames,
        limits.threads,
        info.width,
        info.height,
        frames[0].width(),
        frames[0].height(),
        peak_rss(),
        bytes.len()
    );
}
