#!/usr/bin/env bash
# Every GPU figure in bench/RESULTS.md, in one batch on an NVIDIA H200 machine (the device tool's
# `run`: the repo is copied there, gpunet is not installed, nothing can be downloaded).
# Output: tables on stdout, JSON and logs under $OUT (default bench/out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT" /tmp/pk/gpunet
# gpunet as installed: gpunet/, host/ -> gpunet.host, device/ -> gpunet.device
for f in gpunet/*; do ln -sf "$PWD/$f" /tmp/pk/gpunet/; done
ln -sfn "$PWD/host" /tmp/pk/gpunet/host
ln -sfn "$PWD/device" /tmp/pk/gpunet/device
export PYTHONPATH=/tmp/pk:$PWD/tests PYTHONUNBUFFERED=1
nvidia-smi -L
step() { echo "=== $* ==="; }
step "device post rate (default protocol)"
python3 bench/device_post.py --cq both --qps 1,32 --batches 256 --warps 1,32,132,264 \
    --json "$OUT/device_post.json" > "$OUT/device_post.log" 2>&1; tail -32 "$OUT/device_post.log"
step "device post rate with post_warp_k (8 WQEs per lane per post)"
python3 bench/device_post.py --cq both --qps 8,32 --batches 256 --warps 132,264 --per-lane 8 \
    --skip store,e2e,ordering --json "$OUT/dp_perlane8.json" > "$OUT/dp_perlane8.log" 2>&1
tail -12 "$OUT/dp_perlane8.log"
step "proxy GPU round trip"
python3 bench/proxy.py --gpu --json "$OUT/proxy_gpu.json" 2>&1 | tail -8
step "device post rate (GPUNET_PUBLISH_GPU_SCOPE variant)"
python3 bench/device_post.py --cq collapsed --qps 1,32 --batches 256 --warps 32,132,264 \
    --skip store,e2e --define GPUNET_PUBLISH_GPU_SCOPE --json "$OUT/device_post_gpuscope.json" \
    > "$OUT/device_post_gpuscope.log" 2>&1; tail -16 "$OUT/device_post_gpuscope.log"
step "soft NIC on this host's CPU"
python3 bench/softnic.py --json "$OUT/softnic.json" 2>&1 | tail -14
step "proxy on this host's CPU"
python3 bench/proxy.py --json "$OUT/proxy_cpu.json" 2>&1 | tail -10
step "Python API on CUDA"
timeout 240 python3 -P -m pytest -q -x tests/test_api_cuda.py 2>&1 | tail -3
