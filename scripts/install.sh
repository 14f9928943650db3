#!/usr/bin/env bash
# Installs everything gpunet and its tests need on a fresh Debian/Ubuntu machine (CPU only):
#   - libibverbs-dev: rdma-core's mlx5dv.h, the independent oracle for gpunet's wire format;
#   - g++: compiles the device code's HOST arm (the SIMT emulator) and the oracle programs;
#   - linux-headers-<version>-common: the kernel's linux/mlx5/mlx5_ifc.h, the oracle for the PRM
#     command layouts of gpunet/host/prm.py (tests/test_prm_oracle.py); the version in the name changes
#     over time, so the newest one apt knows is picked;
#   - python3-pyverbs: rdma-core's Python bindings (the real-NIC path; gpunet/host/verbs.py imports
#     Debian's build) and rdma-core's tests/mlx5_prm_structs.py, the oracle for the DevX fields
#     the kernel header leaves reserved;
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
  # Debian names the arch-independent headers linux-headers-<version>-common; Ubuntu
  # linux-headers-<version>-<abi>. Either holds include/linux/mlx5/mlx5_ifc.h.
  HEADERS=$(apt-cache search --names-only '^linux-headers-.*-common$' | awk '{print $1}' | sort -V | tail -n 1)
  [ -n "$HEADERS" ] || HEADERS=$(apt-cache search --names-only '^linux-headers-[0-9.]+-[0-9]+$' | awk '{print $1}' | sort -V | tail -n 1)
  if [ -z "$HEADERS" ]; then
    echo "install.sh: apt knows no linux-headers-<version>-common package; tests/test_prm_oracle.py needs one" >&2
    exit 1
  fi
  $SUDO apt-get install -y -qq --no-install-recommends libibverbs-dev g++ "$HEADERS" python3-pyverbs >/dev/null
  # Slim images exclude /usr/share/doc from packages (dpkg path-exclude): take rdma-core's PRM
  # structs (an oracle of tests/test_prm_oracle.py) straight from the python3-pyverbs .deb then.
  STRUCTS=usr/share/doc/rdma-core/tests/mlx5_prm_structs.py.gz
  if [ ! -e "/$STRUCTS" ]; then
    TMP=$(mktemp -d)
    (cd "$TMP" && apt-get download -qq python3-pyverbs >/dev/null)
    $SUDO mkdir -p /usr/local/share/gpunet/rdma-core-tests
    dpkg-deb --fsys-tarfile "$TMP"/python3-pyverbs_*.deb | tar -xO "./$STRUCTS" \
      | $SUDO tee /usr/local/share/gpunet/rdma-core-tests/mlx5_prm_structs.py.gz >/dev/null
    rm -rf "$TMP"
  fi
fi
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check torch==2.13.0
$PY -m pip install -q --disable-pip-version-check -e '.[test,plot]'
echo "gpunet installed: $($PY -c 'import gpunet; print(gpunet.__version__)')"
# Compile numba's disk caches and the HOST-arm kernels once here (~45 s on 2 cores), so the first
# demo or test run does not compile them in every rank process at once.
$PY -m gpunet warmup
