"""What the vlm binaries accept and serve (flags, env vars, ports, metrics, config keys), and
the helpers that render deploy/k8s and find objects and settings in it. Read by the cross-object
checks of vlm_manifests.py and manifest_tls.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterable

import yaml

DEPLOY = Path(__file__).resolve().parent.parent
K8S = DEPLOY / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())

# --------------------------------------------------------------------------- the contract
# What the binaries accept (flag, env var, default) and serve. Each flag is also an env var;
# clap's precedence: flag, then env var, then default.
SERVICES: dict[str, dict[str, Any]] = {
    "gateway": {
        "binary": "gateway",
        "grpc": ("--listen", "VLM_GATEWAY_LISTEN", "0.0.0.0:50051"),
        # The gateway serves /metrics on its HTTP port.
        "metrics": ("--http-listen", "VLM_GATEWAY_HTTP_LISTEN", "0.0.0.0:8080"),
        "metrics_port_name": "http",
        "device": None,
        "config_part": None,
    },
    "vision": {
        "binary": "vision-service",
        "grpc": ("--listen", "VLM_VISION_LISTEN", "0.0.0.0:50061"),
        "metrics": ("--metrics-listen", "VLM_VISION_METRICS_LISTEN", "0.0.0.0:9461"),
        "metrics_port_name": "metrics",
        "device": ("--device", "VLM_VISION_DEVICE"),
        "config_part": "visual",
    },
    "lm": {
        "binary": "lm-service",
        "grpc": ("--listen", "VLM_LM_LISTEN", "0.0.0.0:50062"),
        "metrics": ("--metrics-listen", "VLM_LM_METRICS_LISTEN", "0.0.0.0:9462"),
        "metrics_port_name": "metrics",
        "device": ("--device", "VLM_LM_DEVICE"),
        "config_part": "top",
    },
}
MODEL = ("--model", "VLM_MODEL")
CONFIG = ("--config", "VLM_CONFIG")
GATEWAY_UPSTREAMS = {"vision": ("--vision", "VLM_VISION_ADDRS"), "lm": ("--lm", "VLM_LM_ADDRS")}
# The LM pulls embeddings only from the vision replicas it is given.
LM_UPSTREAMS = {"vision": ("--vision", "VLM_LM_VISION")}
BINARIES = {"vision-service", "lm-service", "gateway", "vlm"}
DRAIN_SECONDS = 60
RUN_AS_USER = 10001

# Extended resources that count as a pod's devices; without any, a device is a CPU core.
DEVICE_RESOURCES = ("nvidia.com/gpu", "rebellions.ai/ATOM", "rebellions.ai/npu")

# The Prometheus metric names the services export (one scheme for all three).
KNOWN_METRICS = {
    # vision
    "vlm_vision_encode_seconds", "vlm_vision_images_total", "vlm_vision_padding_fraction",
    "vlm_vision_queue_depth", "vlm_vision_images_in_flight", "vlm_vision_requests_total",
    "vlm_vision_spread_images_total", "vlm_vision_embed_cache_total", "vlm_vision_embed_cache_bytes",
    # lm
    "vlm_lm_time_to_first_token_seconds", "vlm_lm_time_per_output_token_seconds",
    "vlm_lm_running", "vlm_lm_waiting", "vlm_lm_kv_blocks_used", "vlm_lm_kv_blocks_free",
    "vlm_lm_decode_steps_total", "vlm_lm_preemptions_total",
    "vlm_lm_prefix_cache_prompt_tokens_total", "vlm_lm_prefix_cache_hit_tokens_total",
    "vlm_lm_kv_blocks_cached",
    "vlm_lm_embedding_cache_hits_total", "vlm_lm_embedding_cache_misses_total",
    "vlm_lm_generated_tokens_total",
    # gateway
    "vlm_gateway_requests_total", "vlm_gateway_queue_depth", "vlm_gateway_in_flight",
    "vlm_gateway_admission_refusals_total", "vlm_gateway_time_to_first_token_seconds",
    "vlm_gateway_request_duration_seconds", "vlm_gateway_prompt_tokens_total",
    "vlm_gateway_completion_tokens_total", "vlm_gateway_cached_prompt_tokens_total",
    "vlm_gateway_lm_routes_total",
}
HISTOGRAMS = {
    "vlm_vision_encode_seconds", "vlm_vision_padding_fraction",
    "vlm_lm_time_to_first_token_seconds", "vlm_lm_time_per_output_token_seconds",
    "vlm_gateway_time_to_first_token_seconds", "vlm_gateway_request_duration_seconds",
}
# The custom metric each backend HPA follows (CPU is the fallback next to it).
HPA_CUSTOM_METRIC = {"vision": "vlm_vision_queue_depth", "lm": "vlm_lm_waiting"}

# The nested config (top level = LM, `visual` = ViT). Older spellings are accepted.
TOP_KEYS = {
    "max_seq_len", "kvcache_partition_len", "kvcache_num_blocks", "batch_size",
    "decoder_batch_sizes", "prefill_chunk_size", "num_devices", "device", "create_runtimes",
    "dtype", "kernels", "prefix_caching", "kv_cache_dtype", "visual", "tensor_parallel_size",
}
VISUAL_KEYS = {
    "max_seq_len", "num_devices", "device", "create_runtimes", "min_pixels", "max_pixels",
    "oversize", "dtype", "kernels", "max_seq_lens", "tensor_parallel_size",
}
DTYPES = {"f32", "float32", "f16", "float16", "half", "bf16", "bfloat16"}
PATCH_PIXELS = 16 * 16


# --------------------------------------------------------------------------- rendering
def find_kustomize() -> list[str]:
    """The command that renders a kustomization dir (the dir is appended)."""
    candidates = []
    if os.environ.get("KUBECTL"):
        candidates.append(os.environ["KUBECTL"])
    candidates.append(str(DEPLOY / ".tools" / "kubectl" / "bin" / "kubectl"))
    if shutil.which("kubectl"):
        candidates.append(shutil.which("kubectl"))
    for kubectl in candidates:
        if os.access(kubectl, os.X_OK):
            return [kubectl, "kustomize"]
    if shutil.which("kustomize"):
        return [shutil.which("kustomize"), "build"]
    raise RuntimeError(
        "no kubectl or kustomize found: run `bash deploy/ci-install.sh` "
        "(it installs a pinned kubectl into deploy/.tools/kubectl), or set KUBECTL"
    )


def render(path: Path) -> list[dict]:
    cmd = find_kustomize() + [str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def kustomize_version() -> str:
    cmd = find_kustomize()
    args = [cmd[0], "version", "--client"] if cmd[1] == "kustomize" else [cmd[0], "version"]
    return subprocess.run(args, capture_output=True, text=True, timeout=60).stdout.strip()


# --------------------------------------------------------------------------- lookups
def objects(docs: Iterable[dict], kind: str) -> list[dict]:
    return [d for d in docs if d.get("kind") == kind]


def by_name(docs: Iterable[dict], kind: str, name: str) -> dict | None:
    for d in objects(docs, kind):
        if d["metadata"]["name"] == name:
            return d
    return None


def component(obj: dict) -> str | None:
    return obj.get("metadata", {}).get("labels", {}).get("app.kubernetes.io/component")


def deployments(docs: list[dict]) -> dict[str, dict]:
    """component -> Deployment (by pod template label)."""
    out = {}
    for d in objects(docs, "Deployment"):
        c = d["spec"]["template"]["metadata"].get("labels", {}).get("app.kubernetes.io/component")
        out[c] = d
    return out


def main_container(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]["containers"][0]


def pod_spec(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]


def setting(container: dict, flag: str, env: str | None, default: str | None = None) -> str | None:
    """The value a clap flag gets in this container: flag (either spelling), env, default."""
    args = list(container.get("command", [])[1:]) + list(container.get("args", []))
    value = None
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            value = a[len(flag) + 1:]
        elif a == flag and i + 1 < len(args):
            value = args[i + 1]
    if value is not None:
        return value
    if env:
        for e in container.get("env", []):
            if e["name"] == env and "value" in e:
                return e["value"]
    return default


def port_of(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])
