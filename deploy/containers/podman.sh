#!/usr/bin/env bash
# podman with the settings that build-local-image.sh and deploy/tests/test_containers.py use:
#   - its own image store (--root) under $VLM_CONTAINERS_STATE (default /var/tmp/vlm-containers),
#     so that the locally made `debian:<release>-slim` base never shadows a real one in the
#     machine's own store, and old test images are pruned without touching anything else;
#   - runc (VLM_OCI_RUNTIME overrides it): Debian's crun refuses the hybrid cgroup layout of
#     these machines (v1 controllers plus a cgroup2 mount holding a controller);
#   - netavark with aardvark-dns, so containers on one network find each other by name
#     (Debian's podman ships a CNI config and would otherwise pick CNI, which has no DNS);
#   - events to a file (no journald here).
# Use it as podman:  deploy/containers/podman.sh images
set -euo pipefail

state="${VLM_CONTAINERS_STATE:-/var/tmp/vlm-containers}"
run="${VLM_CONTAINERS_RUN:-/run/vlm-containers}"
if ! command -v podman >/dev/null 2>&1; then
    echo "podman.sh: podman not found (bash deploy/ci-install.sh installs it)" >&2
    exit 127
fi
mkdir -p "$state" "$run"
exec podman \
    --root "$state/storage" \
    --runroot "$run/storage" \
    --tmpdir "$run/libpod" \
    --runtime "${VLM_OCI_RUNTIME:-runc}" \
    --network-backend netavark \
    --events-backend file \
    --cgroup-manager cgroupfs \
    "$@"
