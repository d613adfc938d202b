"""What the bench scripts share (standard library only): one streamed OpenAI chat completion
over plain HTTP, and a PNG writer for request images."""
import json
import random
import struct
import time
import urllib.error
import urllib.request
import zlib


def stream_chat(http, body, timeout=3600, who="server"):
    """POSTs `body` (a dict; `stream` is turned on, with usage) to http://HTTP/v1/chat/completions.
    Returns (t0, pieces, usage): the perf_counter time the request was sent, each content delta
    as (perf_counter time, text), and the final usage object ({} if none came)."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    req = urllib.request.Request(f"http://{http}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    pieces, usage = [], {}
    try:
        r = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise SystemExit(f"{who}: HTTP {e.code}: {e.read().decode()[:500]}")
    with r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for c in ev.get("choices", []):
                piece = c.get("delta", {}).get("content")
                if piece:
                    pieces.append((time.perf_counter(), piece))
            if ev.get("usage"):
                usage = ev["usage"]
    return t0, pieces, usage


def png(w, h, seed=0):
    """An RGB PNG with structure (not flat), different for each seed."""
    rng = random.Random(seed)
    a, b, c = rng.randrange(1, 97), rng.randrange(1, 89), rng.randrange(256)
    rows = bytearray()
    for y in range(h):
        rows.append(0)  # filter: none
        for x in range(w):
            v = (x * a) ^ (y * b) ^ ((x * y) >> 4)
            rows += bytes(((v + c) & 255, (v >> 3) & 255, (x + y + c) & 255))

    def chunk(tag, data):
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(bytes(rows), 6)) + chunk(b"IEND", b""))
