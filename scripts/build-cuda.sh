#!/usr/bin/env bash
# Builds the `cuda` feature without a GPU: the toolkit from PyPI wheels (scripts/cuda-toolkit.sh),
# then the release binaries. `.ci/run` runs this on every run (the README's test command), so
# the GPU code always compiles. With --gpu-check it also builds the GPU check's test and bench
# binaries and packs them, stripped and xz-compressed (they share candle's PTX: ~320 MB
# become ~16 MB), into .gpu/bins.tar.xz beside the check's scripts (carry `.gpu`, at most
# 64 MiB; scripts/gpu-check.sh unpacks it on the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cuda-toolkit.sh
cargo build --release --features cuda --bins
[ "${1:-}" = "--gpu-check" ] || exit 0

# Test and bench executables: the file names cargo prints for them.
exes() {
  cargo "$@" --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])'
}
bins=target/gpu-bins
rm -rf "$bins" .gpu && mkdir -p "$bins" .gpu
cp target/release/vlm target/release/vision-service target/release/lm-service target/release/gateway "$bins/"
exes test --release --features cuda -p vlm-backends --test gpu_golden --test vision_parity --no-run |
  while read -r name path; do cp "$path" "$bins/$name"; done
exes bench --features cuda -p vlm-backends --bench steps --no-run |
  while read -r name path; do cp "$path" "$bins/$name"; done
strip "$bins"/*
# One xz stream with a dictionary wider than a binary: the copies of candle's PTX compress away.
tar -C "$bins" -cf - . | xz -9 --lzma2=dict=192MiB >.gpu/bins.tar.xz
cp scripts/gpu-check.sh scripts/ttft.py config/examples/one-gpu.yaml .gpu/
du -sh .gpu; ls -la .gpu
echo "carry .gpu (limit 64 MiB in all) and run: bash .gpu/gpu-check.sh"
