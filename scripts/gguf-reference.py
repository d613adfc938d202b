#!/usr/bin/env python3
"""Golden logits of a GGUF Qwen3-VL LM computed by exactly its quantization scheme, in PyTorch.

Weights: every LM tensor of the GGUF file dequantized by llama.cpp's own reference code
(`gguf.quants.dequantize` of the `gguf` package), loaded into transformers'
Qwen3VLForConditionalGeneration built from the source checkpoint directory (config.json).
Activations: the server's products (candle's port of ggml-cpu's `mul_mat`) quantize each input
row to the weight type's dot partner before the integer dot products: Q8_K rows (blocks of 256,
`quantize_row_q8_K_ref`: iscale = -127 / max (signed max by |x|), q = clamp(round(iscale * x)),
d = 1 / iscale) for the k-quants, and Q8_0 rows (blocks of 32, `quantize_row_q8_0_ref`: d =
amax / 127, q = round(x / d), d stored as fp16) for Q8_0 weights -- except on x86 with VNNI,
where candle's repacked Q8_0 kernel takes Q8_K rows too (when k % 256 == 0 and n % 16 == 0).
Rounding is half away from zero as candle's (`f32::round`; ggml's Q8_K uses half-to-even,
which differs only on exact ties). A forward pre-hook on each quantized nn.Linear does the
same, so the reference is the scheme, not float weights.

Writes JSON: the file's sha256, the prompt ids, and per activation variant (`q8_0_act`: Q8_0
weights take Q8_0 rows, AVX2-only CPUs; `q8_k_act`: they take Q8_K rows, VNNI CPUs) a greedy
run (full recompute each step): its ids and the logits of every step.

  python scripts/gguf-reference.py CKPT_DIR LM.gguf OUT.json [--steps 4]
Needs torch, transformers (>= 4.57, Qwen3-VL), gguf.
"""
import hashlib
import json
import os
import sys

import numpy as np
import torch
from gguf import GGUFReader, GGMLQuantizationType as T
from gguf.quants import dequantize

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_common import greedy, load_float_model, parse_args, prompt_ids  # noqa: E402

LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
Q8_0_PARTNER = {T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1}
Q8_K_PARTNER = {T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K}


def hf_name(name):
    if name == "token_embd.weight":
        return "model.language_model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.language_model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    _, i, module, param = name.split(".")
    return f"model.language_model.layers.{i}.{LAYER[module]}.{param}"


def round_away(x):
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def q8_0_rows(x):
    b = x.reshape(-1, 32)
    amax = b.abs().amax(dim=1, keepdim=True)
    d = amax / 127
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    d16 = d.to(torch.float16).to(torch.float32)
    return (round_away(b * inv) * d16).reshape(x.shape)


def q8_k_rows(x):
    b = x.reshape(-1, 256)
    idx = b.abs().argmax(dim=1, keepdim=True)
    mx = torch.gather(b, 1, idx)
    iscale = torch.where(mx != 0, -127.0 / mx, torch.zeros_like(mx))
    q = torch.clamp(round_away(iscale * b), min=-128, max=127)
    d = torch.where(iscale != 0, 1.0 / iscale, torch.zeros_like(iscale))
    return (q * d).reshape(x.shape)


def main():
    a = parse_args("gguf")
    model = load_float_model(a.ckpt)
    state = model.state_dict()
    reader = GGUFReader(a.gguf)
    kinds = {}
    with torch.no_grad():
        for t in reader.tensors:
            hf = hf_name(t.name)
            w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
            state[hf].copy_(w.reshape(state[hf].shape))
            kinds[hf] = t.tensor_type
    if "lm_head.weight" not in kinds:  # tied: the head is token_embd
        kinds["lm_head.weight"] = kinds["model.language_model.embed_tokens.weight"]
    prompt = prompt_ids(model)
    variants = {}
    for variant in ("q8_0_act", "q8_k_act"):
        hooks = []
        for name, mod in model.named_modules():
            kind = kinds.get(name + ".weight")
            if not isinstance(mod, torch.nn.Linear) or kind is None:
                continue
            n, k = mod.weight.shape
            q8k = kind in Q8_K_PARTNER or (
                kind == T.Q8_0 and variant == "q8_k_act" and k % 256 == 0 and n % 16 == 0)
            fn = q8_k_rows if q8k else q8_0_rows
            hooks.append(mod.register_forward_pre_hook(lambda m, args, fn=fn: (fn(args[0]),)))
        ids, steps = greedy(model, prompt, a.steps)
        for h in hooks:
            h.remove()
        variants[variant] = {"greedy_ids": ids, "step_logits": steps}
    sha = hashlib.sha256(open(a.gguf, "rb").read()).hexdigest()
    types = sorted({T(k).name for k in kinds.values()})
    json.dump({"gguf_sha256": sha, "tensor_types": types, "input_ids": prompt[0].tolist(),
               "variants": variants}, open(a.out, "w"))
    print(f"{a.out}: {types}, greedy " + ", ".join(
        f"{v}: {r['greedy_ids']}" for v, r in variants.items()))


if __name__ == "__main__":
    main()
