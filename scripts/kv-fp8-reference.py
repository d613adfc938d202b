#!/usr/bin/env python3
"""Golden logits of a Qwen3-VL checkpoint run with an FP8 E4M3 KV cache, in PyTorch.

The scheme (`kv_cache_dtype: fp8_e4m3`, vLLM's `--kv-cache-dtype fp8` with its default scales
of 1.0): every key (after the k norm and the rotary embedding) and every value an attention
layer caches is stored as float8_e4m3fn, saturated at +-448, and read back as float32; the rest
of the model runs in float32. Here transformers' eager attention gets the keys and values
converted by torch's own float8_e4m3fn cast (round to nearest even) before it attends.

Writes JSON: the checkpoint's sha256, the prompt ids, and a greedy run (full recompute each
step): its ids and the logits of every step.

  python scripts/kv-fp8-reference.py CKPT_DIR OUT.json [--steps 4]
Needs torch (>= 2.1, float8 dtypes), transformers (>= 4.57, Qwen3-VL), safetensors.
"""
import argparse
import os
import sys

import torch
import transformers.models.qwen3_vl.modeling_qwen3_vl as qwen3_vl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_common import write_golden  # noqa: E402

E4M3_MAX = 448.0


def fp8(t):
    """t through an FP8 E4M3 cache: saturated, rounded to nearest even, widened back."""
    return t.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(t.dtype)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    eager = qwen3_vl.eager_attention_forward

    def attention_over_fp8_cache(module, query, key, value, *args, **kwargs):
        return eager(module, query, fp8(key), fp8(value), *args, **kwargs)

    # The text attention looks the function up in its module at each call.
    qwen3_vl.eager_attention_forward = attention_over_fp8_cache
    torch.manual_seed(0)
    model = qwen3_vl.Qwen3VLForConditionalGeneration.from_pretrained(
        a.ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    layers = model.config.text_config.num_hidden_layers
    write_golden(model, f"{a.ckpt}/model.safetensors", layers, a.out, a.steps,
                 "attention layers over an FP8 KV cache")


if __name__ == "__main__":
    main()
