#!/usr/bin/env python3
"""Golden logits of a W8A8 Qwen3-VL checkpoint computed by exactly its scheme, in PyTorch.

The scheme (compressed-tensors `int-quantized`, as vLLM's `CompressedTensorsW8A8Int8` runs it
with dynamic per-token activations): each quantized nn.Linear's weight is the file's int8
values with one scale per output row; its input rows are quantized at run time, one symmetric
scale per row (vLLM's `dynamic_scaled_int8_quant`: scale = max|x| / 127, q =
round_half_even(x * (127 / max|x|)), clamped to [-128, 127]); the integer sums are exact
(int64 here) and the result is sum * (row scale * channel scale) in float32. Every other
tensor (embeddings, norms, head, the vision tower) is the source checkpoint's, in float32.

Writes JSON: the W8A8 file's sha256, the prompt ids, and a greedy run (full recompute each
step): its ids and the logits of every step.

  python scripts/w8a8-reference.py CKPT_DIR W8A8_DIR OUT.json [--steps 4]
Needs torch, transformers (>= 4.57, Qwen3-VL), safetensors.
"""
import os
import sys
import types

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_common import load_float_model, parse_args, write_golden  # noqa: E402


def w8a8_forward(self, x):
    shape = x.shape
    x = x.reshape(-1, shape[-1]).float()
    amax = x.abs().amax(dim=1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(x * inv).clamp(-128, 127).to(torch.int64)  # torch.round: half to even
    scale = amax / 127.0
    acc = q @ self.w8_values.to(torch.int64).T
    out = acc.to(torch.int32).to(torch.float32) * (scale * self.w8_scales.reshape(1, -1))
    return out.reshape(*shape[:-1], -1)


def main():
    a = parse_args("w8a8")
    model = load_float_model(a.ckpt)
    path = f"{a.w8a8}/model.safetensors"
    tensors = load_file(path)
    modules = dict(model.named_modules())
    quantized = 0
    for name, t in tensors.items():
        if t.dtype != torch.int8:
            continue
        mod = modules[name[: -len(".weight")]]
        assert isinstance(mod, torch.nn.Linear) and mod.bias is None, name
        mod.w8_values = t
        mod.w8_scales = tensors[name + "_scale"].float().reshape(-1)
        mod.forward = types.MethodType(w8a8_forward, mod)
        quantized += 1
    write_golden(model, path, quantized, a.out, a.steps, "int8 linears")


if __name__ == "__main__":
    main()
