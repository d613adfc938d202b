#!/usr/bin/env python3
"""Golden logits of a W4A16 Qwen3-VL checkpoint computed by exactly its scheme, in PyTorch.

The scheme (compressed-tensors `pack-quantized`, symmetric int4 per group, as vLLM's
`CompressedTensorsWNA16` runs it): each quantized nn.Linear's weight is the file's 4-bit values,
unpacked by compressed-tensors' own `unpack_from_int32`, times the scale of its output row and
group of `group_size` inputs, in float32 (exact: a bf16 scale times a 4-bit integer); the
activations stay in floats. Every other tensor (embeddings, norms, head, the vision tower) is
the source checkpoint's, in float32.

Writes JSON: the W4A16 file's sha256, the prompt ids, and a greedy run (full recompute each
step): its ids and the logits of every step.

  python scripts/w4a16-reference.py CKPT_DIR W4A16_DIR OUT.json [--steps 4]
Needs torch, transformers (>= 4.57, Qwen3-VL), safetensors, compressed-tensors.
"""
import os
import sys

import torch
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_common import load_float_model, parse_args, write_golden  # noqa: E402


def main():
    a = parse_args("w4a16")
    model = load_float_model(a.ckpt)
    path = f"{a.w4a16}/model.safetensors"
    tensors = load_file(path)
    modules = dict(model.named_modules())
    quantized = 0
    for name, t in tensors.items():
        if not name.endswith(".weight_packed"):
            continue
        prefix = name[: -len(".weight_packed")]
        mod = modules[prefix]
        assert isinstance(mod, torch.nn.Linear) and mod.bias is None, name
        shape = torch.Size(tensors[prefix + ".weight_shape"].tolist())
        q = unpack_from_int32(t, 4, shape).float()  # -8..7
        scale = tensors[prefix + ".weight_scale"].float()
        group = shape[1] // scale.shape[1]
        with torch.no_grad():
            mod.weight.copy_(q * scale.repeat_interleave(group, dim=1))
        quantized += 1
    write_golden(model, path, quantized, a.out, a.steps, "4-bit linears")


if __name__ == "__main__":
    main()
