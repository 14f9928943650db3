#!/usr/bin/env bash
# session-6 call 2 (temporary): the mixed-world CUDA test after e5a1ad7, then EP HT over p2p with a wider Config sweep
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
timeout 200 python3 -m pytest -q tests/test_p2p_cuda.py -k mixed 2>&1 | tail -4
OUT=$OUT EP_TRANSPORTS=p2p EP_RANKS=2 EP_BENCH_PREFIX=ep_ht_gpu \
  EP_BENCH_ARGS="--mode ht --ht-configs 48:8:128:8,64:16:128:16,64:32:128:16,64:16:64:16,64:8:48:16,64:32:96:16,128:8:48:8,128:16:64:8" \
  timeout 420 bash bench/ep_gpu.sh 2>&1 | grep -v "^\[" | tail -70
