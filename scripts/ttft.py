#!/usr/bin/env python3
"""Time to first token through the OpenAI-compatible API, Python standard library only (the GPU
machine has no extra packages): streams chat completions with one WxH image (a PNG made here;
--size 0: text only) and prints the median seconds to the first content chunk and to the end,
over --rounds.

    python3 scripts/ttft.py --url http://127.0.0.1:8080 --size 512 --rounds 5
"""
import argparse
import base64
import json
import statistics
import struct
import time
import urllib.request
import zlib


def png(w, h):
    """An RGB gradient as PNG bytes."""
    rows = b"".join(
        b"\x00" + bytes(((x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), (x ^ y) & 255)[c]
                        for x in range(w) for c in range(3))
        for y in range(h))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows, 6)) + chunk(b"IEND", b""))


def one(url, model, image, max_tokens):
    content = [{"type": "text", "text": "Describe the image."}]
    if image:
        content.insert(0, {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}})
    body = json.dumps({"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": content}]}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[5:])
            delta = (ev.get("choices") or [{}])[0].get("delta", {})
            # The gateway's first chunk comes with the first token (role + content, which may
            # be "" for a token that ends inside a UTF-8 sequence).
            if first is None and "content" in delta:
                first = time.perf_counter() - t0
    return first, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default="")
    ap.add_argument("--size", type=int, default=512, help="image side in pixels; 0 = text only")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    model = a.model or json.load(urllib.request.urlopen(a.url + "/v1/models"))["data"][0]["id"]
    image = base64.b64encode(png(a.size, a.size)).decode() if a.size else None
    one(a.url, model, image, 4)  # warm-up
    runs = [one(a.url, model, image, a.max_tokens) for _ in range(a.rounds)]
    ttft = [r[0] for r in runs if r[0] is not None]
    what = f"image {a.size}x{a.size}" if a.size else "text"
    if not ttft:
        raise SystemExit(f"{what}: no content chunk in {a.rounds} rounds")
    print(f"{what}: TTFT median {statistics.median(ttft):.3f} s "
          f"[{min(ttft):.3f}-{max(ttft):.3f}], total median {statistics.median(r[1] for r in runs):.3f} s "
          f"({a.rounds} rounds, {a.max_tokens} tokens)")


if __name__ == "__main__":
    main()
