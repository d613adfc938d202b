#!/usr/bin/env bash
# Converts a Qwen3-VL checkpoint directory to GGUF with llama.cpp's own tools, the way users get
# their files: convert_hf_to_gguf.py (LM in bf16, `--mmproj` vision tower in bf16), then
# llama-quantize to Q8_0 and Q4_K_M. The checkpoint needs Qwen's real tokenizer (the converter
# recognises the pre-tokenizer by hashing its output). Not on CI's path.
#
#   bash scripts/llama-cpp-gguf.sh LLAMA_CPP_DIR CHECKPOINT OUT_DIR [PYTHON]
#   (LLAMA_CPP_DIR as printed by scripts/build-llama-cpp.sh; PYTHON with torch and
#    transformers, e.g. vLLM's venv)
set -euo pipefail
llama=$1
ckpt=$2
out=$3
py=${4:-python3}
mkdir -p "$out"
export PYTHONPATH="$llama/gguf-py${PYTHONPATH:+:$PYTHONPATH}"
[ -f "$out/lm-bf16.gguf" ] ||
  "$py" "$llama/convert_hf_to_gguf.py" "$ckpt" --outtype bf16 --outfile "$out/lm-bf16.gguf"
[ -f "$out/mmproj-bf16.gguf" ] ||
  "$py" "$llama/convert_hf_to_gguf.py" "$ckpt" --outtype bf16 --mmproj --outfile "$out/mmproj-bf16.gguf"
for q in Q8_0 Q4_K_M; do
  f="$out/lm-$(echo "$q" | tr 'A-Z' 'a-z').gguf"
  [ -f "$f" ] || "$llama/build/bin/llama-quantize" "$out/lm-bf16.gguf" "$f" "$q" "$(nproc)"
done
ls -la "$out"
