#!/usr/bin/env bash
# The CUDA toolkit for building the `cuda` feature on a machine with no GPU and no system CUDA:
# nvcc, headers and the link-time libraries from PyPI wheels, plus a libcuda stub made from
# cuda.h (the wheels ship no driver library).
#
#   source scripts/cuda-toolkit.sh          # installs once, then exports the build environment
#   cargo build --release --features cuda --bins
#
# 13.0 because the H200 machines this is checked on run driver 580: a newer nvcc writes PTX that
# driver refuses. The stub directory goes on the library path here only (for the link and the
# CPU-side tests of the cuda build); on a GPU machine the driver's own libcuda.so.1 is used and
# the stub must never be on its path (scripts/gpu-check.sh does not put it there).
# Sourced, it leaves the caller's shell options as they were: the install runs in a subshell.

VLM_CUDA_DIR="${VLM_CUDA_DIR:-/opt/vlm-cuda}"
WHEELS=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
  nvidia-cuda-nvrtc==13.0.88
  nvidia-curand==10.4.0.35
  nvidia-cublas==13.0.2.14
)
stamp="$VLM_CUDA_DIR/.installed"
want="${WHEELS[*]}"

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then (
  set -euo pipefail
  echo "cuda-toolkit: installing ${WHEELS[*]} into $VLM_CUDA_DIR" >&2
  rm -rf "$VLM_CUDA_DIR"
  mkdir -p "$VLM_CUDA_DIR"
  python3 -m pip install -q --no-deps --no-compile --disable-pip-version-check \
    --target "$VLM_CUDA_DIR/site" "${WHEELS[@]}"
  root="$VLM_CUDA_DIR/site/nvidia/cu13"
  [ -d "$root" ] || root="$(dirname "$(find "$VLM_CUDA_DIR/site" -name nvcc -path '*/bin/*' | head -1)")/.."
  root="$(cd "$root" && pwd)"
  ln -sfn "$root" "$VLM_CUDA_DIR/cuda"
  cuda="$VLM_CUDA_DIR/cuda"
  chmod +x "$cuda"/bin/* "$cuda"/nvvm/bin/* 2>/dev/null || true
  # The toolkit's usual layout: lib64 beside lib, unversioned names for the linker.
  [ -e "$cuda/lib64" ] || ln -sfn lib "$cuda/lib64"
  for so in "$cuda"/lib/lib*.so.*; do
    base="${so%%.so.*}.so"
    [ -e "$base" ] || ln -sfn "$(basename "$so")" "$base"
  done
  # libcuda stub: every cu* entry point cuda.h declares (after its _v2 renames, hence the
  # preprocessor), each returning CUDA_ERROR_NO_DEVICE (100), soname libcuda.so.1 as the driver.
  mkdir -p "$VLM_CUDA_DIR/stub"
  cc -E -P -I "$cuda/include" "$cuda/include/cuda.h" 2>/dev/null |
    grep -oE '\bCUresult +(CUDAAPI +)?cu[A-Za-z0-9_]+ *\(' |
    sed -E 's/.*(cu[A-Za-z0-9_]+) *\(/\1/' | sort -u |
    awk '{ printf "int %s(void) { return 100; }\n", $1 }' >"$VLM_CUDA_DIR/stub/cuda_stub.c"
  [ -s "$VLM_CUDA_DIR/stub/cuda_stub.c" ] || { echo "cuda-toolkit: no entry points found in cuda.h" >&2; exit 1; }
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$VLM_CUDA_DIR/stub/libcuda.so.1" \
    "$VLM_CUDA_DIR/stub/cuda_stub.c"
  ln -sfn libcuda.so.1 "$VLM_CUDA_DIR/stub/libcuda.so"
  echo "$want" >"$stamp"
) || { echo "cuda-toolkit: install failed" >&2; return 1 2>/dev/null || exit 1; }
fi

cuda="$VLM_CUDA_DIR/cuda"
export CUDA_HOME="$cuda" CUDA_PATH="$cuda" CUDA_ROOT="$cuda"
export PATH="$cuda/bin:$PATH"
export LIBRARY_PATH="$cuda/lib:$VLM_CUDA_DIR/stub${LIBRARY_PATH:+:$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$cuda/lib:$VLM_CUDA_DIR/stub${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# candle-kernels and this repo's kernels: Hopper (H100/H200).
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export NVCC_CCBIN="${NVCC_CCBIN:-$(command -v g++ || command -v c++)}"
nvcc --version | tail -2 >&2
