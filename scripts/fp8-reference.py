#!/usr/bin/env python3
"""Golden logits of an FP8 block Qwen3-VL checkpoint computed by exactly its scheme, in PyTorch.

The scheme (Qwen's FP8 releases: `quant_method: fp8`, float8 e4m3fn weights, one
`weight_scale_inv` per block of `weight_block_size` = [rows, inputs]): each quantized
nn.Linear's weight is torch's own float8_e4m3fn -> float32 conversion of the file's bytes, times
its block's scale, in float32 (exact); the activations stay in floats (weight-only, as this
server runs it on CPUs without FP8 arithmetic). Every other tensor (embeddings, norms, head, the
vision tower) is the source checkpoint's, in float32.

Writes JSON: the FP8 file's sha256, the prompt ids, and a greedy run (full recompute each
step): its ids and the logits of every step.

  python scripts/fp8-reference.py CKPT_DIR FP8_DIR OUT.json [--steps 4]
Needs torch (>= 2.1, float8 dtypes), transformers (>= 4.57, Qwen3-VL), safetensors.
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_common import load_float_model, parse_args, write_golden  # noqa: E402


def main():
    a = parse_args("fp8")
    model = load_float_model(a.ckpt)
    bn, bk = json.load(open(f"{a.fp8}/config.json"))["quantization_config"]["weight_block_size"]
    path = f"{a.fp8}/model.safetensors"
    tensors = load_file(path)
    modules = dict(model.named_modules())
    quantized = 0
    for name, t in tensors.items():
        if t.dtype != torch.float8_e4m3fn:
            continue
        mod = modules[name[: -len(".weight")]]
        assert isinstance(mod, torch.nn.Linear) and mod.bias is None, name
        scale = tensors[name + "_scale_inv"].float()
        n, k = t.shape
        s = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
        with torch.no_grad():
            mod.weight.copy_(t.float() * s)
        quantized += 1
    write_golden(model, path, quantized, a.out, a.steps, "FP8 linears")


if __name__ == "__main__":
    main()
