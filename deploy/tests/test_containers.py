"""The deploy image for real: builds the `cpu` stage of deploy/docker/Dockerfile from the
prebuilt target/debug binaries (deploy/containers/build-local-image.sh) and runs the `cpu`
overlay's three pods as three containers on one podman network: each Deployment's command,
args and plain env from deploy/k8s/base, the ConfigMap's config (deploy/k8s/base/config.yaml)
at /etc/vlm/config.yaml, the generated-model component's checkpoint (`vlm make-model --preset
tiny --seed 0`, made here on the host) read-only at /models/tiny, the Services' names as
network aliases, and the pods' securityContext: uid/gid 10001, read-only root filesystem,
/tmp a tmpfs, no capabilities, no privilege escalation, the runtime's default seccomp filter.
Then checks the processes' ids and the mounts, and sends an OpenAI chat completion with an
image through the gateway's published HTTP port.

Needs podman, runc, netavark, mmdebstrap, PyYAML (bash deploy/ci-install.sh) and the binaries
(cargo test --workspace builds them). Run:  python3 -m pytest deploy/tests/test_containers.py -q
"""

from __future__ import annotations

import base64
import json
import os
import re
import resource
import struct
import subprocess
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
BASE = REPO / "deploy" / "k8s" / "base"
MODEL_COMPONENT = REPO / "deploy" / "k8s" / "components" / "generated-model"
PODMAN = str(REPO / "deploy" / "containers" / "podman.sh")
BUILD = str(REPO / "deploy" / "containers" / "build-local-image.sh")
BIN_DIR = Path(os.environ.get("VLM_BIN_DIR", REPO / "target" / "debug"))
IMAGE = "localhost/vlm:container-test"
LABEL = "vlm-container-test"  # on every container and network the test makes
UID = GID = 10001
CONFIG = "/etc/vlm/config.yaml"
# Deployment (= Service) name: container name in the pod, and the log line that says it serves.
COMPONENTS = {
    "vlm-vision": ("vision", "SERVING vlm.v1.Vision"),
    "vlm-lm": ("lm", "SERVING vlm.v1.Lm"),
    "vlm-gateway": ("gateway", "SERVING vlm.v1.Gateway"),
}
VISION, LM, GATEWAY = COMPONENTS
READY_TIMEOUT_S = 120
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    p = subprocess.run([PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {p.returncode}:\n{p.stdout}{p.stderr}")
    return p


def logs(name: str) -> str:
    p = podman("logs", name, check=False)
    return ANSI.sub("", p.stdout + p.stderr)


def remove_leftovers() -> None:
    """Containers and networks of an earlier run that was killed before it could clean up (its
    names end with its pid, and that process is gone); a run going on beside this one keeps its own."""

    def dead(name: str) -> bool:
        pid = int(name.rsplit("-", 1)[1])
        try:
            os.kill(pid, 0)
            return pid == os.getpid()
        except ProcessLookupError:
            return True
        except PermissionError:
            return False

    ids = podman("ps", "-a", "--filter", f"label={LABEL}", "--format", "{{.Names}}").stdout.split()
    if stale := [n for n in ids if dead(n)]:
        podman("rm", "-f", "-t", "0", *stale, check=False)
    nets = podman("network", "ls", "--filter", f"label={LABEL}", "--format", "{{.Name}}").stdout.split()
    if stale := [n for n in nets if dead(n)]:
        podman("network", "rm", "-f", *stale, check=False)


def ulimits() -> list[str]:
    # Rootful podman gives a container RLIMIT_NOFILE/NPROC of 1048576 unless told otherwise,
    # and raising a hard limit needs CAP_SYS_RESOURCE, which root lacks on these machines; so
    # ask for limits within the caller's own.
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile = 65536 if nofile == resource.RLIM_INFINITY else min(nofile, 65536)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", "nproc=4096:4096"]


def pod_container(deployment: str, directory: Path) -> dict:
    """The container of `deployment` in the Deployment (or patch) of `directory`."""
    for path in sorted(directory.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "Deployment" and doc["metadata"]["name"] == deployment:
                name = COMPONENTS[deployment][0]
                return next(c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == name)
    raise AssertionError(f"no Deployment {deployment} in {directory}")


def pod_env(deployment: str, container: str) -> dict[str, str]:
    """The container's env as the kubelet would set it: plain values, the downward API's pod
    name and namespace, $(VAR) expanded; optional ConfigMap keys (OpenTelemetry) left unset."""
    env: dict[str, str] = {}
    spec = pod_container(deployment, BASE).get("env", []) + pod_container(deployment, MODEL_COMPONENT).get("env", [])
    for e in spec:
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), str(e["value"]))
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[e["name"]] = container
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[e["name"]] = LABEL
    return env


def listen_port(args: list[str], flag: str) -> int:
    value = next(a.split("=", 1)[1] for a in args if a.startswith(flag + "="))
    return int(value.rsplit(":", 1)[1])


def png(w: int = 64, h: int = 48) -> bytes:
    rows = b"".join(b"\x00" + bytes(v for x in range(w) for v in (x * 4 % 256, y * 5 % 256, 128)) for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def http(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:  # not listening yet, reset, timed out
        return 0, repr(e)


def metric(text: str, name: str) -> float:
    """Sum of every series of `name` in a Prometheus exposition."""
    total, seen = 0.0, False
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            total, seen = total + float(m.group(2)), True
    assert seen, f"{name} not exported:\n{text}"
    return total


def host_port(name: str, port: int) -> str:
    out = podman("port", name, f"{port}/tcp").stdout.strip().splitlines()
    assert out, f"{name}: port {port} not published"
    return out[0]


def wait_running(name: str, deadline: float, ready) -> None:
    """Until ready(log text) holds; fails when the container exits or the deadline passes."""
    while True:
        text = logs(name)
        if ready(text):
            return
        state = podman("inspect", "-f", "{{.State.Running}} {{.State.ExitCode}}", name).stdout.split()
        assert state[0] == "true", f"{name} exited (code {state[1]}):\n{text}"
        assert time.monotonic() < deadline, f"{name} not ready in {READY_TIMEOUT_S} s:\n{text}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    pods = {d: pod_container(d, BASE) for d in COMPONENTS}
    for b in ("vlm", *(p["command"][0] for p in pods.values())):
        assert (BIN_DIR / b).is_file(), f"{BIN_DIR / b} missing: cargo test --workspace (or cargo build --bins) builds it"
    t0 = time.monotonic()
    b = subprocess.run([BUILD, IMAGE], capture_output=True, text=True, timeout=900)
    assert b.returncode == 0, f"{BUILD} failed:\n{b.stdout}{b.stderr}"
    build_s = time.monotonic() - t0

    tmp = tmp_path_factory.mktemp("containers")
    # The generated-model component's initContainer, run on the host: its checkpoint is
    # mounted read-only where VLM_MODEL points.
    patch = yaml.safe_load((MODEL_COMPONENT / "vision.yaml").read_text())
    init = next(c for c in patch["spec"]["template"]["spec"]["initContainers"] if c["name"] == "make-model")
    cmd = list(init["command"])
    model_path = cmd[cmd.index("--out") + 1]
    cmd[0], cmd[cmd.index("--out") + 1] = str(BIN_DIR / cmd[0]), str(tmp / "model")
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    # The ConfigMap's volume: a folder with config.yaml.
    etc = tmp / "etc-vlm"
    etc.mkdir()
    (etc / "config.yaml").write_text((BASE / "config.yaml").read_text())
    for d in (tmp / "model", etc):
        d.chmod(0o755)

    remove_leftovers()
    pid = os.getpid()
    net = f"vlm-ct-{pid}"
    podman("network", "create", "--label", LABEL, net)
    names = {d: f"{d}-{pid}" for d in COMPONENTS}
    # The metrics ports and the gateway's HTTP port, published on loopback only, on free ports.
    publish = {
        VISION: listen_port(pods[VISION]["args"], "--metrics-listen"),
        LM: listen_port(pods[LM]["args"], "--metrics-listen"),
        GATEWAY: listen_port(pods[GATEWAY]["args"], "--http-listen"),
    }
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for d in (VISION, LM, GATEWAY):
            if d == GATEWAY:  # started once both backends serve, as `vlm up` does
                for b in (VISION, LM):
                    wait_running(names[b], deadline, lambda t, b=b: COMPONENTS[b][1] in t)
            env = pod_env(d, names[d])
            assert env.get("VLM_MODEL") == model_path, env
            podman(
                "run", "-d", "--label", LABEL, "--name", names[d],
                "--network", net, "--network-alias", d, "-p", f"127.0.0.1::{publish[d]}",
                "--user", f"{UID}:{GID}", "--read-only", "--tmpfs", "/tmp",
                "--cap-drop=ALL", "--security-opt", "no-new-privileges", *ulimits(),
                "-v", f"{tmp / 'model'}:{model_path}:ro", "-v", f"{etc}:{Path(CONFIG).parent}:ro",
                *(f"--env={k}={v}" for k, v in env.items()),
                "--entrypoint", pods[d]["command"][0], IMAGE, *pods[d].get("args", []),
            )
        urls = {d: "http://" + host_port(names[d], publish[d]) for d in COMPONENTS}
        # The gateway is ready when it has a healthy LM and vision replica, found by name.
        wait_running(names[GATEWAY], deadline, lambda t: http(urls[GATEWAY] + "/health")[0] == 200)
        print(f"\nimage built in {build_s:.1f} s; three containers ready in {time.monotonic() - t0 - build_s:.1f} s")
        yield {"names": names, "urls": urls, "model": model_path}
    except BaseException:
        for n in names.values():
            print(f"----- {n} -----\n{logs(n)}")
        raise
    finally:
        podman("rm", "-f", "-t", "5", *names.values(), check=False)
        podman("network", "rm", "-f", net, check=False)


def cpu_stage() -> str:
    """The text of the Dockerfile's `cpu` stage (the last one)."""
    text = DOCKERFILE.read_text()
    return text[re.search(r"^FROM .* AS cpu$", text, re.M).start():]


def test_image_is_the_dockerfiles_cpu_stage(stack):
    stage = cpu_stage()
    cfg = json.loads(podman("image", "inspect", IMAGE).stdout)[0]["Config"]
    assert cfg["User"] == re.search(r"^USER (\S+)$", stage, re.M).group(1) == f"{UID}:{GID}"
    assert cfg["Cmd"] == json.loads(re.search(r"^CMD (\[.*\])$", stage, re.M).group(1))
    exposed = re.search(r"^EXPOSE (.+)$", stage, re.M).group(1).split()
    assert sorted(cfg["ExposedPorts"]) == sorted(f"{p}/tcp" for p in exposed)
    # The stage's own RUN made the user and installed the CA bundle; its COPY put the binaries
    # on PATH; its CMD runs as that user under the same restrictions as the services.
    history = podman("history", "--no-trunc", "--format", "{{.CreatedBy}}", IMAGE).stdout
    assert "useradd --uid 10001 --gid 10001" in history and "ca-certificates" in history, history
    bins = re.search(r'^ARG BINARIES="([^"]+)"', DOCKERFILE.read_text(), re.M).group(1).split()
    probe = "id -u; id -g; id -un; test -s /etc/ssl/certs/ca-certificates.crt && echo certs; ls /usr/local/bin"
    p = podman("run", "--rm", "--read-only", "--cap-drop=ALL", *ulimits(), IMAGE, "sh", "-c", probe)
    lines = p.stdout.split()
    assert lines[:4] == [str(UID), str(GID), "vlm", "certs"], p.stdout
    assert set(bins) <= set(lines[4:]), p.stdout
    p = podman("run", "--rm", "--read-only", "--cap-drop=ALL", *ulimits(), IMAGE)  # CMD: vlm --help
    assert "Split Qwen3-VL serving" in p.stdout, p.stdout + p.stderr


def test_each_service_runs_as_10001_without_privileges(stack):
    for d, name in stack["names"].items():
        info = json.loads(podman("inspect", name).stdout)[0]
        assert info["Config"]["User"] == f"{UID}:{GID}"
        assert info["HostConfig"]["ReadonlyRootfs"] is True
        pid = info["State"]["Pid"]
        assert os.readlink(f"/proc/{pid}/exe") == "/usr/local/bin/" + pod_container(d, BASE)["command"][0]
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        assert len(tasks) > 1  # the services' worker threads, checked one by one
        for task in tasks:
            status = dict(l.split(":", 1) for l in (task / "status").read_text().splitlines() if ":" in l)
            # real, effective, saved and filesystem ids
            assert status["Uid"].split() == [str(UID)] * 4, (name, task.name, status["Uid"])
            assert status["Gid"].split() == [str(GID)] * 4, (name, task.name, status["Gid"])
            assert status["Groups"].split() == [str(GID)], (name, status["Groups"])
            for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
                assert int(status[cap], 16) == 0, (name, cap, status[cap])
            assert status["NoNewPrivs"].strip() == "1", name
            assert status["Seccomp"].strip() == "2", name  # podman's default seccomp filter


def test_root_filesystem_is_read_only(stack):
    model = stack["model"]
    for name in stack["names"].values():
        pid = podman("inspect", "-f", "{{.State.Pid}}", name).stdout.strip()
        mounts = {f[4]: f[5].split(",") for f in (l.split() for l in Path(f"/proc/{pid}/mountinfo").read_text().splitlines())}
        assert "ro" in mounts["/"], (name, mounts["/"])
        assert "ro" in mounts[model] and "ro" in mounts[str(Path(CONFIG).parent)], name
        # Even root in the container (it owns /, so no capability is needed) cannot write:
        # the refusal is the read-only mount's, not a permission's.
        for path in ("/probe", "/usr/local/bin/probe", f"{model}/probe"):
            p = podman("exec", "--user", "0", name, "touch", path, check=False)
            assert p.returncode != 0 and "Read-only file system" in p.stderr, (name, path, p.stderr)
        # ... while the service's user writes to /tmp (the tmpfs), so exec itself works.
        p = podman("exec", name, "sh", "-c", "echo ok > /tmp/probe && cat /tmp/probe && id -u")
        assert p.stdout.split() == ["ok", str(UID)], p.stdout + p.stderr
        # The container layer holds nothing but the mount points the runtime made for the volumes.
        changed = [l.split(None, 1)[1] for l in podman("diff", name).stdout.splitlines() if l.strip()]
        stray = [c for c in changed if not any(m == c or m.startswith(c.rstrip("/") + "/") for m in mounts)]
        assert not stray, f"{name} changed its root filesystem: {stray}"


def test_chat_completion_through_the_three_containers(stack):
    urls = stack["urls"]
    status, body = http(urls[GATEWAY] + "/health")
    assert status == 200, body
    image = "data:image/png;base64," + base64.b64encode(png()).decode()
    request = {
        "model": "tiny", "max_tokens": 8, "min_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Describe the image"},
            {"type": "image_url", "image_url": {"url": image}}]}],
    }
    status, body = http(urls[GATEWAY] + "/v1/chat/completions", request)
    assert status == 200, body
    r = json.loads(body)
    assert r["object"] == "chat.completion", r
    choice = r["choices"][0]
    assert choice["finish_reason"] == "length" and isinstance(choice["message"]["content"], str), r
    assert choice["message"]["content"], r
    assert r["usage"]["completion_tokens"] == 8 and r["usage"]["prompt_tokens"] > 8, r
    # Each part did its share: the image went through the vision container, the tokens came
    # from the LM container.
    assert metric(http(urls[VISION] + "/metrics")[1], "vlm_vision_images_total") >= 1
    assert metric(http(urls[LM] + "/metrics")[1], "vlm_lm_generated_tokens_total") >= 8
    assert metric(http(urls[GATEWAY] + "/metrics")[1], "vlm_gateway_completion_tokens_total") >= 8
