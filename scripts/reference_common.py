"""What the quantized-scheme reference scripts share (`*-reference.py`): the float model, the
prompt, a greedy run with full recompute each step, and the golden JSON of a checkpoint file.
"""
import argparse
import hashlib
import json

import torch


def parse_args(quantized):
    """CKPT_DIR, the quantized file or directory (named `quantized`), OUT.json, --steps."""
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument(quantized)
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=4)
    return ap.parse_args()


def load_float_model(ckpt):
    """transformers' Qwen3-VL of `ckpt` in float32, eval mode (seeded)."""
    torch.manual_seed(0)
    from transformers import Qwen3VLForConditionalGeneration
    return Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


def prompt_ids(model):
    """The 24 prompt ids every golden uses (seed 1234, below the tiny vocabularies' specials)."""
    vocab = model.config.text_config.vocab_size
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, min(vocab, 990), (1, 24), generator=g)


def greedy(model, prompt, steps):
    """(generated ids, logits of every step) of a greedy run, full recompute each step."""
    ids, logits_per_step = prompt, []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=ids).logits[0, -1].float()
            logits_per_step.append(logits.tolist())
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, prompt.shape[1]:].tolist(), logits_per_step


def write_golden(model, path, quantized, out, steps, what):
    """Runs the greedy golden of `model` (its linears already the scheme's) and writes it with
    the sha256 of the checkpoint file at `path`."""
    prompt = prompt_ids(model)
    ids, logits = greedy(model, prompt, steps)
    sha = hashlib.sha256(open(path, "rb").read()).hexdigest()
    json.dump({"safetensors_sha256": sha, "quantized_linears": quantized,
               "input_ids": prompt[0].tolist(), "greedy_ids": ids, "step_logits": logits},
              open(out, "w"))
    print(f"{out}: {quantized} {what}, greedy {ids}")
