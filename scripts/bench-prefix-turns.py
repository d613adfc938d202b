#!/usr/bin/env python3
"""Time to first token of a conversation's two turns with an image, prefix caching on vs off,
measured as a user sees it: through the gateway's OpenAI HTTP API of a real `vlm up`.

For each setting (prefix_caching true, then false) it starts `vlm up` on CONFIG with that key
set, sends turn 1 (a 1024x1024 image and a question, streamed) and turn 2 (the same
conversation, turn 1's answer, a follow-up question), records each turn's TTFT (request sent ->
first content chunk), the answer and `usage.prompt_tokens_details.cached_tokens`, then stops
the system. Both settings must give the same answers (greedy). Standard library only.

    cargo build --release -p vlm-cli -p vlm-gateway -p vlm-lm-service -p vlm-vision-service
    python3 scripts/bench-prefix-turns.py --model DIR [--config FILE] [--vlm target/release/vlm]

Without --config it writes one for the 2B checkpoint: bf16, KV blocks of 256 tokens (the
granularity the cache shares at), ViT buckets up to 4096 patches (a 1024x1024 image).
"""
import argparse
import base64
import json
import os
import subprocess
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import png, stream_chat  # noqa: E402

DEFAULT_CONFIG = """\
dtype: bf16
visual:
  dtype: bf16
  max_seq_len: [1024, 4096]
  num_devices: 1
  device: [0]
max_seq_len: 4096
kvcache_partition_len: 256
kvcache_num_blocks: 48
batch_size: 1
decoder_batch_sizes: [1]
prefill_chunk_size: 256
num_devices: 1
device: [1]
"""


def start(vlm, model, config, http):
    p = subprocess.Popen(
        [vlm, "up", "--model", model, "--config", config, "--http-listen", http,
         "--listen", "127.0.0.1:15051", "--ready-timeout-s", "1200"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in p.stdout:
        if line.startswith("ready"):
            return p
    raise SystemExit(f"vlm up exited with {p.wait()} before it was ready")


def stop(p):
    p.terminate()
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()


def served_model(http):
    with urllib.request.urlopen(f"http://{http}/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def chat(http, messages, max_tokens):
    """One streamed request: (ttft seconds, text, cached tokens, prompt tokens)."""
    t0, pieces, usage = stream_chat(http, {
        "model": served_model(http), "messages": messages, "max_tokens": max_tokens,
        "temperature": 0,
    }, timeout=1800)
    ttft = pieces[0][0] - t0 if pieces else None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ttft, "".join(p for _, p in pieces), cached, usage.get("prompt_tokens", 0)


def conversation(http, image, max_tokens):
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    turn1 = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "Describe this image in detail."}]}]
    t1 = chat(http, turn1, max_tokens)
    turn2 = turn1 + [
        {"role": "assistant", "content": t1[1]},
        {"role": "user", "content": "What colours stand out most, and where are they?"}]
    t2 = chat(http, turn2, max_tokens)
    return t1, t2


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--config")
    ap.add_argument("--vlm", default="target/release/vlm")
    ap.add_argument("--http", default="127.0.0.1:18080")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--size", type=int, default=1024)
    a = ap.parse_args()
    base = open(a.config).read() if a.config else DEFAULT_CONFIG
    image = png(a.size, a.size)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for on in (True, False):
            cfg = os.path.join(tmp, f"prefix-{on}.yaml")
            with open(cfg, "w") as f:
                f.write(base + f"prefix_caching: {'true' if on else 'false'}\n")
            p = start(a.vlm, a.model, cfg, a.http)
            try:
                results[on] = conversation(a.http, image, a.max_tokens)
            finally:
                stop(p)
            (t1, t2) = results[on]
            print(f"prefix_caching={on}: turn 1 TTFT {t1[0]:.3f} s ({t1[3]} prompt tokens, "
                  f"{t1[2]} cached); turn 2 TTFT {t2[0]:.3f} s ({t2[3]} prompt tokens, "
                  f"{t2[2]} cached); turn 2 / turn 1 = {t2[0] / t1[0]:.3f}", flush=True)
    on, off = results[True], results[False]
    same = on[0][1] == off[0][1] and on[1][1] == off[1][1]
    print(f"turn 2 TTFT, cache on / off: {on[1][0] / off[1][0]:.3f}")
    print(f"answers identical with the cache on and off: {same}")
    if not same:
        print(f"on:  {on[0][1]!r} / {on[1][1]!r}\noff: {off[0][1]!r} / {off[1][1]!r}")
        sys.exit(1)


if __name__ == "__main__":
    main()
