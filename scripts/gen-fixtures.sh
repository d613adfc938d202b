#!/usr/bin/env bash
# Regenerate the golden fixtures under fixtures/ (Qwen3-VL parity tests of the model crate).
#
#   scripts/gen-fixtures.sh
#
# Environment:
#   REF_PY      python of the reference venv (default ~/.cache/qwen3-vl-reference/bin/python;
#               make it with: bash ../shared/reference/install-reference-env.sh)
#   SHARED_REF  folder holding golden.py and configs/ (default: <repo>/../shared/reference)
#   THREADS     torch threads per run (default 2; results can differ in the last ulp with another value)
#   KEEP_TMP=1  keep the raw per-run outputs (printed path)
#
# Single-image cases: shared/reference/golden.py, called as-is. Two images in one prompt:
# fixtures/gen_multi.py. Each run rebuilds its checkpoint from (config, seed 0);
# fixture_tools.py assemble checks the copies are byte-identical and keeps one per checkpoint.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
SHARED_REF=${SHARED_REF:-$SCRIPT_DIR/../../shared/reference}
SHARED_REF=$(cd "$SHARED_REF" && pwd)
REF_PY=${REF_PY:-$HOME/.cache/qwen3-vl-reference/bin/python}
THREADS=${THREADS:-2}
FIX=$REPO/fixtures
GOLDEN=$SHARED_REF/golden.py
TOOLS=$FIX/fixture_tools.py

[ -x "$REF_PY" ] || { echo "reference python not found: $REF_PY (run $SHARED_REF/install-reference-env.sh or set REF_PY)" >&2; exit 1; }
[ -f "$GOLDEN" ] || { echo "golden.py not found in $SHARED_REF (set SHARED_REF)" >&2; exit 1; }

TMP=$(mktemp -d "${TMPDIR:-/tmp}/qwen3vl-fixtures.XXXXXX")
if [ "${KEEP_TMP:-0}" != 1 ]; then trap 'rm -rf "$TMP"' EXIT; else echo "raw outputs kept in $TMP"; fi
RUNS=$TMP/runs
export SHARED_REF PYTHONHASHSEED=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

"$REF_PY" -c 'import torch, transformers, torchvision; print("torch", torch.__version__, "transformers", transformers.__version__, "torchvision", torchvision.__version__)'

# ---- clean the generated parts (sources gen_multi.py / fixture_tools.py stay) ----
rm -rf "$FIX/configs" "$FIX/tiny" "$FIX/tiny_untied_ds1" "$FIX/index.json" "$FIX/README.md"
mkdir -p "$FIX"

# ---- configs and input images ----
"$REF_PY" "$TOOLS" configs "$SHARED_REF" "$FIX"
"$REF_PY" "$TOOLS" inputs "$TMP/inputs"
CFG_TIED=$FIX/configs/tiny.json
CFG_UNTIED=$FIX/configs/tiny_untied_ds1.json

golden() {  # golden CKPT CASE CONFIG [golden.py args...]
  local ck=$1 case=$2 cfg=$3; shift 3
  echo "== $ck/$case"
  "$REF_PY" "$GOLDEN" --config "$cfg" --seed 0 --threads "$THREADS" --backend auto --max-new-tokens 8 \
    --out "$RUNS/$ck/$case" "$@" 2>&1 | grep -v -e 'it/s\]' -e '^Writing model' -e '^Loading weights' || true
  [ -f "$RUNS/$ck/$case/golden.safetensors" ] || { echo "golden.py failed for $ck/$case" >&2; exit 1; }
}

# ---- checkpoint "tiny": tied embeddings, deepstack [0, 2] ----
# synthetic 100x75 -> upscaled by min_pixels to 224x320
golden tiny synth_100x75 "$CFG_TIED"
# JPEG 400x176 -> 192x384 (round-half-to-even on both axes, no min/max rescale)
golden tiny jpeg_400x176 "$CFG_TIED" --image "$TMP/inputs/nonsquare_400x176.jpg"
# two images of different sizes in one prompt
echo "== tiny/two_images"
"$REF_PY" "$FIX/gen_multi.py" --config "$CFG_TIED" --seed 0 --threads "$THREADS" --backend auto --max-new-tokens 8 \
  --out "$RUNS/tiny/two_images" --image synthetic:100x75 --image "$TMP/inputs/nonsquare_400x176.jpg" \
  --prefix-len 5 --middle-len 6 --suffix-len 4 2>&1 | grep -v -e 'it/s\]' -e '^Writing model' -e '^Loading weights' || true
[ -f "$RUNS/tiny/two_images/golden.safetensors" ] || { echo "gen_multi.py failed" >&2; exit 1; }

# ---- checkpoint "tiny_untied_ds1": untied lm_head, deepstack [1] ----
# RGBA 256x256 with transparency: exactly min_pixels, no resize; alpha composited onto white
# (prefix/suffix 8/8: the default 5/4 prompt has a greedy step with top1-top2 gap 0.009; 8/8 has >= 0.067)
golden tiny_untied_ds1 rgba_256x256 "$CFG_UNTIED" --image "$TMP/inputs/rgba_256x256.png" --prefix-len 8 --suffix-len 8
# long prompt (> 256 tokens, for chunked prefill): 200 + [vs + 70 pads + ve] + 100 = 372 tokens
golden tiny_untied_ds1 long_prompt "$CFG_UNTIED" --prefix-len 200 --suffix-len 100

# ---- assemble: dedupe checkpoints, prune tensors, index.json, README.md ----
"$REF_PY" "$TOOLS" assemble "$RUNS" "$FIX" \
  tiny/synth_100x75 tiny/jpeg_400x176 tiny/two_images \
  tiny_untied_ds1/rgba_256x256 tiny_untied_ds1/long_prompt
# ---- video cases: gen_video.py loads the tiny/ checkpoint (not rebuilt), writes tiny/video_*/ and the README's
#      "Video cases" section (generated with transformers 5.19: /work/vllm-venv/bin/python fixtures/gen_video.py;
#      video_mp4 needs PyAV with libx264 in $REF_PY, else it is skipped) ----
echo "== tiny/video_*"
"$REF_PY" "$FIX/gen_video.py" --threads "$THREADS" 2>&1 | grep -v -e 'it/s\]' -e '^Loading weights' || true
[ -f "$FIX/tiny/video_downscaled/golden.safetensors" ] || { echo "gen_video.py failed" >&2; exit 1; }
chmod -R u+rwX,go+rX "$FIX"
du -sh "$FIX"
