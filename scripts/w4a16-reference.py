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
import argparse
import hashlib
import json

import torch
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from safetensors.torch import load_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("w4a16")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    torch.manual_seed(0)
    from transformers import Qwen3VLForConditionalGeneration
    model = Qwen3VLForConditionalGeneration.from_pretrained(a.ckpt, dtype=torch.float32).eval()
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
        w = q * scale.repeat_interleave(group, dim=1)
        with torch.no_grad():
            mod.weight.copy_(w)
        quantized += 1
    vocab = model.config.text_config.vocab_size
    g = torch.Generator().manual_seed(1234)
    prompt = torch.randint(0, min(vocab, 990), (1, 24), generator=g)
    ids, steps = prompt, []
    with torch.no_grad():
        for _ in range(a.steps):
            logits = model(input_ids=ids).logits[0, -1].float()
            steps.append(logits.tolist())
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    sha = hashlib.sha256(open(path, "rb").read()).hexdigest()
    json.dump({"safetensors_sha256": sha, "quantized_linears": quantized,
               "input_ids": prompt[0].tolist(),
               "greedy_ids": ids[0, prompt.shape[1]:].tolist(), "step_logits": steps},
              open(a.out, "w"))
    print(f"{a.out}: {quantized} 4-bit linears, greedy {ids[0, prompt.shape[1]:].tolist()}")


if __name__ == "__main__":
    main()
