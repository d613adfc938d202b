//! Video bytes as a request carries them, through FFmpeg (every container and codec the
//! gateway allows): `read_video_info` (the gateway's plan) then `decode_video_frames` of the
//! first frames under a pixel limit and the default packet and time bounds. Never a crash
//! (FFmpeg runs in this process: a fault in it or in our bindings aborts the fuzzer), never
//! over the limit, and the frames asked for are the frames returned, at the planned size.
#![no_main]
use libfuzzer_sys::fuzz_target;

const MAX_PIXELS: u64 = 1 << 18;

fuzz_target!(|bytes: &[u8]| {
    let Ok(info) = vlm_preprocess::read_video_info(bytes) else {
        return;
    };
    let indices: Vec<u32> = (0..info.frames.min(6)).collect();
    if let Ok(frames) = vlm_preprocess::decode_video_frames(bytes, &indices, MAX_PIXELS) {
        assert_eq!(frames.len(), indices.len());
        for f in &frames {
            assert!(f.width() as u64 * f.height() as u64 <= MAX_PIXELS);
            assert_eq!(f.dimensions(), (info.width, info.height), "{info:?}");
        }
    }
});
