"""What the bench scripts share (standard library only): a server process started and stopped
as a group and waited on until it can answer, one streamed OpenAI chat completion over plain
HTTP, and a PNG writer for request images."""
import json
import os
import random
import signal
import subprocess
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


class Server:
    def __init__(self, name, http):
        self.name, self.http, self.proc, self.model = name, http, None, None

    def wait_ready(self, timeout):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode} while starting")
            try:
                # /health is 200 only once the server can answer (our gateway lists its
                # model before its LM and vision replicas are healthy).
                urllib.request.urlopen(f"http://{self.http}/health", timeout=5).close()
                with urllib.request.urlopen(f"http://{self.http}/v1/models", timeout=5) as r:
                    self.model = json.load(r)["data"][0]["id"]
                    return
            except (OSError, urllib.error.URLError, KeyError, IndexError, ValueError):
                time.sleep(2)
        raise SystemExit(f"{self.name} not ready within {timeout} s")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def vllm_env(vllm_python, kv_gib, cores):
    """The environment vLLM's CPU server runs in: its KV cache size (GiB), the cores its OpenMP
    threads bind to, and the LD_PRELOAD of tcmalloc and the venv's libiomp5 its CPU docs ask for.
    """
    env = dict(os.environ)
    venv_lib = os.path.join(os.path.dirname(os.path.dirname(vllm_python)), "lib")
    preload = [p for p in ("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                           os.path.join(venv_lib, "libiomp5.so")) if os.path.exists(p)]
    env.update({"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": cores,
                "LD_PRELOAD": ":".join(preload), "VLLM_TARGET_DEVICE": "cpu"})
    return env
