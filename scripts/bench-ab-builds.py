#!/usr/bin/env python3
"""Two (or more) builds of ours against each other: `vlm up` with no config from each build's
folder in turn, the same client and request kinds as `bench-vs-vllm.py`, alternated build by
build for `--rounds` rounds (each build restarted per round), medians printed per build.

    mkdir -p /tmp/old /tmp/new
    git stash; cargo build --release --bins; cp target/release/{vlm,vision-service,lm-service,gateway} /tmp/old/
    git stash pop; cargo build --release --bins; cp target/release/{vlm,vision-service,lm-service,gateway} /tmp/new/
    python3 scripts/bench-ab-builds.py --model DIR --build old=/tmp/old --build new=/tmp/new \\
        --kinds text,img512,conc8 --rounds 2

Each measured request uses a new seed (no prefix or embedding cache helps), after a warm-up
text request and with the machine idle first (as in `bench-vs-vllm.py`). Standard library only.
"""
import argparse
import collections
import importlib.util
import os
import types

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("bench", os.path.join(HERE, "bench-vs-vllm.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint every build loads")
    ap.add_argument("--build", action="append", required=True,
                    help="NAME=DIR: a folder holding vlm, vision-service, lm-service, gateway")
    ap.add_argument("--kinds", default="text,img512,conc8",
                    help="comma-separated: text, img512, img1024, conc8 (repeat to measure twice)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--http", default="127.0.0.1:18080")
    ap.add_argument("--grpc", default="127.0.0.1:18081")
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--settle-s", type=float, default=10)
    a = ap.parse_args()
    builds = [b.split("=", 1) for b in a.build]
    kinds = a.kinds.split(",")
    results = collections.defaultdict(list)
    for r in range(a.rounds):
        for name, folder in builds:
            opts = types.SimpleNamespace(vlm=os.path.join(folder, "vlm"), model=a.model,
                                         ours_http=a.http, ours_grpc=a.grpc,
                                         ready_timeout=a.ready_timeout)
            with open(f"/tmp/bench-ab-{name}.log", "w") as log:
                server = bench.start_ours(opts, name, None, log)
                try:
                    bench.run_kind(server, "text", 999)  # warm
                    bench.wait_idle(a.settle_s)
                    for j, kind in enumerate(kinds):
                        m = bench.run_kind(server, kind, 1000 + 100 * r + j)
                        bench.wait_idle(a.settle_s)
                        for metric, v in m.items():
                            results[(kind, metric, name)].append(v)
                        shown = {k: round(v, 3) for k, v in m.items() if v is not None}
                        print(f"round {r + 1} {name:8} {kind:8} {shown}", flush=True)
                finally:
                    server.stop()
    print()
    for (kind, metric, name), vals in sorted(results.items()):
        _, text = bench.summary(vals)
        print(f"{kind:8} {metric:14} {name:8} {text}")


if __name__ == "__main__":
    main()
