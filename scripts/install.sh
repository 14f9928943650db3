#!/usr/bin/env bash
# Installs everything gpunet and its tests need on a fresh Debian/Ubuntu machine (CPU only):
#   - libibverbs-dev: rdma-core's mlx5dv.h, the independent oracle for gpunet's wire format;
#   - g++: compiles the device code's HOST arm (the SIMT emulator) and the oracle programs;
#   - CPU torch, pinned: a bare `torch` would pull a multi-GB CUDA build;
#   - gpunet itself, editable, with its test extra (pytest, hypothesis) and matplotlib (the demo's
#     PNG plot).
# Set GPUNET_SKIP_APT=1 to skip the apt step (no root, or already installed).
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if [ "${GPUNET_SKIP_APT:-0}" != "1" ]; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends libibverbs-dev g++ >/dev/null
fi
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check torch==2.13.0
$PY -m pip install -q --disable-pip-version-check -e '.[test,plot]'
echo "gpunet installed: $($PY -c 'import gpunet; print(gpunet.__version__)')"
