#!/usr/bin/env bash
# The GPU check, run on a GPU machine from the repository root with the binaries that
# `scripts/build-cuda.sh --gpu-check` packed into .gpu/ here (nothing is built there; carry
# `.gpu` and run `bash .gpu/gpu-check.sh`):
#   1. golden parity on the fixtures on the GPU: the CUDA backend's greedy decode and padded
#      batches (f32, tolerance 1e-4) and bf16 weights (1.5e-2), and the ViT buckets on the GPU
#      (candle and cuda backends) against the exact forward;
#   2. the seam's steps on the random 2B checkpoint (made there: `vlm make-model`): prefill 1k
#      tokens, decode at 1/8/32/64 streams, the ViT per bucket;
#   3. the three services on one GPU with `vlm up` (config/examples/one-gpu.yaml) and text and
#      image TTFT through the OpenAI API (scripts/ttft.py, standard library only).
# Each step has its own time limit (timeout), so one that hangs costs its limit and the rest
# still run; the limits add up to 570 s, inside the device tool's 600 s a command (never run on
# a GPU yet: no duration measured). The toolkit's libcuda stub is never on the path
# here: the driver's libcuda.so.1 is used; cuBLAS/cuRAND/NVRTC come from the image's wheels.
set -uo pipefail
cd "$(dirname "$0")/.."
G=.gpu
B=/tmp/vlm-gpu-bins
OUT="${OUT:-/tmp/gpu-check}"
mkdir -p "$OUT" "$B"
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" $G/bins.tar.xz "$B" ||
  { echo "cannot unpack $G/bins.tar.xz"; exit 1; }
# The test binaries were built elsewhere: the fixtures are this checkout's.
export VLM_MODEL_FIXTURES="$PWD/fixtures"
libs=$(python3 - <<'PY'
import glob, os, site, sys
dirs = set()
for sp in site.getsitepackages() + [site.getusersitepackages()]:
    for so in glob.glob(os.path.join(sp, "nvidia", "**", "lib*.so*"), recursive=True):
        dirs.add(os.path.dirname(so))
print(":".join(sorted(dirs)))
PY
)
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.free --format=csv | tee "$OUT/gpu.txt"
status=0

echo "== 1. golden parity on the GPU (at ${SECONDS} s)"
(cd backends && timeout 120 $B/gpu_golden --test-threads=1 --nocapture) 2>&1 | tee "$OUT/gpu_golden.txt" || status=1
(cd backends && timeout 90 $B/vision_parity --test-threads=1) 2>&1 | tee "$OUT/vision_parity.txt" || status=1

echo "== 2. the 2B steps (at ${SECONDS} s)"
CKPT=/tmp/qwen3-vl-2b
[ -f "$CKPT/config.json" ] || timeout 60 $B/vlm make-model --preset qwen3-vl-2b --out "$CKPT" >/dev/null
VLM_BENCH_MODEL=$CKPT timeout 120 $B/steps --backend cuda --dtype bf16 --prefill 1024 --batches 1,8,32,64 \
  --context 1024 --buckets 1024,4096,16384 --steps 20 2>&1 | tee "$OUT/steps.txt" || status=1

echo "== 3. vlm up on one GPU, text and image TTFT through the API (at ${SECONDS} s)"
$B/vlm up --model "$CKPT" --config $G/one-gpu.yaml --no-restart >"$OUT/up.log" 2>&1 &
up=$!
for _ in $(seq 1 90); do
  curl -sf http://127.0.0.1:8080/health >/dev/null 2>&1 && break
  kill -0 $up 2>/dev/null || break
  sleep 1
done
if curl -sf http://127.0.0.1:8080/health >/dev/null 2>&1; then
  for size in 0 512 1024; do
    timeout 30 python3 $G/ttft.py --size "$size" --rounds 5 2>&1 | tee -a "$OUT/ttft.txt" || status=1
  done
else
  echo "vlm up did not become healthy; the end of its log:"; tail -40 "$OUT/up.log"; status=1
fi
kill $up 2>/dev/null; wait $up 2>/dev/null
grep -E "cuda LM loaded|kvcache_num_blocks|Info" "$OUT/up.log" | head -5
echo "gpu-check: $([ $status = 0 ] && echo passed || echo FAILED) in ${SECONDS} s"
exit $status
