#!/usr/bin/env bash
# Builds llama.cpp's llama-server and llama-quantize for the side-by-side bench (issue 46),
# from the llama-cpp-python source package on PyPI (0.3.36 vendors a llama.cpp that knows
# Qwen3-VL), and prints where they are. Not on CI's path.
#
#   bash scripts/build-llama-cpp.sh /work/llama       # ~6-10 min on 2 cores
set -euo pipefail
dir=${1:-/work/llama}
version=0.3.36
mkdir -p "$dir"
cd "$dir"
command -v cmake >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q cmake
[ -f "llama_cpp_python-$version.tar.gz" ] ||
  pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d .
[ -d "llama_cpp_python-$version" ] || tar xzf "llama_cpp_python-$version.tar.gz"
cd "llama_cpp_python-$version/vendor/llama.cpp"
cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target llama-server llama-quantize -j "$(nproc)"
echo "llama.cpp: $PWD (bin: $PWD/build/bin; gguf-py: $PWD/gguf-py; converter: $PWD/convert_hf_to_gguf.py)"
