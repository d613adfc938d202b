#!/usr/bin/env python3
"""Decode inter-token latency of running streams while a long prompt prefills, for each
`--prefill-tokens-while-decoding` value (issue 45's fairness row): `vlm up --model DIR` with the
LM's budget set through its environment variable, the settings alternated round by round.

    python3 scripts/bench-itl-prefill.py --vlm target/release/vlm --model DIR \\
        --budgets 0,128 --streams 2 --long-words 1400 --rounds 2

Per round: `--streams` short streaming requests (`--ignore-eos`-style: max_tokens with
ignore_eos) start decoding; once each has its first tokens, one long prompt (`--long-words`
words, ~1.3 tokens a word with Qwen's tokenizer) is sent with max_tokens 1. Reported: the
streams' largest gap between tokens while the long prompt was in flight, their median gap
before it came, and the long prompt's time to first token. Standard library only.
"""
import argparse
import json
import os
import statistics
import subprocess
import threading
import time

import bench_common


def words(n, seed):
    base = ("river stone lantern orbit velvet copper meadow signal harbor thistle quartz ember "
            "willow prism canyon falcon").split()
    return " ".join(base[(i * 7 + seed * 13) % len(base)] + str((i * seed) % 97) for i in range(n))


def run_round(a, budget, seed, log):
    env = dict(os.environ, VLM_LM_PREFILL_TOKENS_WHILE_DECODING=str(budget))
    s = bench_common.Server(f"budget {budget}", a.http)
    s.proc = subprocess.Popen(
        [a.vlm, "up", "--model", a.model, "--http-listen", a.http, "--listen", a.grpc,
         "--ready-timeout-s", str(a.ready_timeout)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        s.wait_ready(a.ready_timeout)
        # Warm-up (first request paths, allocator).
        bench_common.stream_chat(a.http, {"model": s.model, "max_tokens": 4,
                                          "messages": [{"role": "user", "content": "hi"}]})
        results = [None] * a.streams
        started = threading.Barrier(a.streams + 1)

        def stream(i):
            body = {"model": s.model, "max_tokens": a.stream_tokens, "ignore_eos": True,
                    "seed": seed * 100 + i,
                    "messages": [{"role": "user", "content": words(30, seed * 10 + i)}]}
            waited = [False]

            def on_piece():
                if not waited[0]:
                    waited[0] = True
                    started.wait()
            results[i] = stream_pieces(a.http, body, on_piece)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(a.streams)]
        for t in threads:
            t.start()
        started.wait()
        time.sleep(a.settle_s)  # a few decode steps of the streams alone
        long_body = {"model": s.model, "max_tokens": 1,
                     "messages": [{"role": "user", "content": words(a.long_words, seed)}]}
        t_long, pieces, usage = bench_common.stream_chat(a.http, long_body)
        t_long_end = pieces[0][0] if pieces else time.perf_counter()
        for t in threads:
            t.join()
        during, before = [], []
        for times in results:
            gaps = [(t1, t1 - t0) for t0, t1 in zip(times, times[1:])]
            during += [g for t1, g in gaps if t_long < t1 <= t_long_end + g]
            before += [g for t1, g in gaps if t1 <= t_long]
        return {
            "ttft_long": t_long_end - t_long,
            "long_tokens": usage.get("prompt_tokens"),
            "max_gap_during": max(during) if during else None,
            "median_gap_before": statistics.median(before) if before else None,
        }
    finally:
        s.stop()


def stream_pieces(http, body, on_piece):
    """The perf_counter time of each content delta of a streamed chat completion."""
    import urllib.request
    body = dict(body, stream=True)
    req = urllib.request.Request(f"http://{http}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    times = []
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if any(c.get("delta", {}).get("content") for c in ev.get("choices", [])):
                times.append(time.perf_counter())
                on_piece()
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vlm", default="target/release/vlm")
    ap.add_argument("--model", required=True)
    ap.add_argument("--budgets", default="0,128",
                    help="comma-separated --prefill-tokens-while-decoding values (0: chunk size)")
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--stream-tokens", type=int, default=400)
    ap.add_argument("--long-words", type=int, default=1400)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settle-s", type=float, default=3)
    ap.add_argument("--http", default="127.0.0.1:18090")
    ap.add_argument("--grpc", default="127.0.0.1:18091")
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--log", default="/tmp/bench-itl-prefill.log")
    a = ap.parse_args()
    budgets = [int(b) for b in a.budgets.split(",")]
    got = {b: [] for b in budgets}
    with open(a.log, "w") as log:
        for r in range(a.rounds):
            for b in budgets:
                res = run_round(a, b, seed=r + 1, log=log)
                got[b].append(res)
                print(f"round {r + 1} budget {b}: {json.dumps(res)}", flush=True)
    print("| budget while decoding | long prompt tokens | its TTFT s | streams' max gap during "
          "it s | median gap before s |")
    print("|---|---|---|---|---|")
    for b in budgets:
        rs = got[b]
        fmt = lambda k: " / ".join(f"{x[k]:.2f}" if x[k] is not None else "-" for x in rs)
        print(f"| {b or 'chunk size'} | {rs[0]['long_tokens']} | {fmt('ttft_long')} | "
              f"{fmt('max_gap_during')} | {fmt('median_gap_before')} |")


if __name__ == "__main__":
    main()
