#!/usr/bin/env python3
"""Video loading side by side: our FFmpeg path (`preprocess/benches/video_decode.rs`) and vLLM's
Qwen3-VL loader (`Qwen3VLVideoBackend.load_bytes`, OpenCV) on the same files, the same fps-2
sampling (up to 768 frames, vLLM's ceiling), one process per file and loader, alternating,
rounds in a row; ours with the gateway's 2 decoder threads, vLLM's with OpenCV's min(cores, 16).
"ours, resized as decoded" is the gateway's path: each frame resized to the processor's size
as it comes out (vLLM's loader returns source-size frames; its processor resizes later).
Prints decode time and peak RSS per run, then the ranges.

    python3 scripts/bench-video-loader.py --vllm-python /work/vllm-venv/bin/python [--rounds 3]

Files (made once by the ffmpeg CLI into --dir): a 1080p 60 s H.264 clip at 30 fps and a
10-minute 640x360 H.264 clip at 30 fps (18,000 frames). Run on a quiet machine: `cargo bench`
builds the bench binary first.
"""
import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FILES = {
    "1080p-60s.mp4": "testsrc2=size=1920x1080:rate=30:duration=60",
    "360p-10min.mp4": "testsrc2=size=640x360:rate=30:duration=600",
}

VLLM = r"""
import json, resource, sys, time
from vllm.multimodal.video import Qwen3VLVideoBackend
data = open(sys.argv[1], "rb").read()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t = time.perf_counter()
frames, meta = Qwen3VLVideoBackend.load_bytes(data, fps=2)
s = time.perf_counter() - t
print(json.dumps({"seconds": round(s, 3), "frames": int(frames.shape[0]), "of": meta["total_num_frames"],
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "baseline_rss_bytes": base}))
"""


def make(path, src):
    if os.path.exists(path):
        return
    subprocess.run(["ffmpeg", "-y", "-nostdin", "-loglevel", "error", "-f", "lavfi", "-i", src,
                    "-c:v", "libx264", "-preset", "veryfast", "-pix_fmt", "yuv420p", path], check=True)


def ours(path, threads, resize):
    env = dict(os.environ, VLM_BENCH_VIDEO=path, VLM_BENCH_FPS="2", VLM_BENCH_MAX_FRAMES="768",
               VLM_BENCH_THREADS=str(threads), VLM_BENCH_RESIZE=str(int(resize)))
    out = subprocess.run(["cargo", "bench", "-q", "-p", "vlm-preprocess", "--bench", "video_decode"],
                         cwd=REPO, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def vllm(python, path):
    out = subprocess.run([python, "-c", VLLM, path], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--dir", default="/tmp/vlm-bench-video")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="our decoder threads (the gateway's default)")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    for name, src in FILES.items():
        make(os.path.join(a.dir, name), src)
    subprocess.run(["cargo", "bench", "-q", "-p", "vlm-preprocess", "--bench", "video_decode", "--no-run"],
                   cwd=REPO, check=True)
    runs = {}
    for r in range(a.rounds):
        for name in FILES:
            path = os.path.join(a.dir, name)
            for who, fn in (("ours", lambda: ours(path, a.threads, False)),
                            ("vllm", lambda: vllm(a.vllm_python, path)),
                            ("ours, resized as decoded", lambda: ours(path, a.threads, True))):
                got = fn()
                runs.setdefault((name, who), []).append(got)
                print(f"round {r} {name} {who}: {got['seconds']:.2f} s, {got['frames']} of {got['of']} frames, "
                      f"peak RSS {got['peak_rss_bytes'] / 2**20:.0f} MiB "
                      f"(before decoding {got['baseline_rss_bytes'] / 2**20:.0f})", flush=True)
    print("\n| file | loader | decode s (min-max) | peak RSS MiB (min-max) | RSS added by decoding MiB |")
    print("|---|---|---|---|---|")
    for (name, who), rs in runs.items():
        s = [x["seconds"] for x in rs]
        p = [x["peak_rss_bytes"] / 2**20 for x in rs]
        d = [(x["peak_rss_bytes"] - x["baseline_rss_bytes"]) / 2**20 for x in rs]
        print(f"| {name} | {who} | {min(s):.2f}-{max(s):.2f} | {min(p):.0f}-{max(p):.0f} | {min(d):.0f}-{max(d):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
