#!/usr/bin/env bash
# session 32, call 1: CUDA tests of the direct LL dispatch, then the A/B direct vs messages
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi -L
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
git_head=$(cat _calls/HEAD 2>/dev/null); echo "tree: $git_head"
t0=$(date +%s)
[ -n "${SKIP_TESTS:-}" ] || timeout 420 python3 -m pytest -q -x tests/test_p2p_cuda.py -k "ep_direct or ep_dispatch_and_combine_over_p2p" tests/test_ep_cuda.py 2>&1 | tail -6
echo "tests took $(( $(date +%s) - t0 )) s"
for i in 1 2 3; do
  for v in direct msg; do
    pool=-1; [ $v = msg ] && pool=0
    t1=$(date +%s)
    python3 -m gpunet.device.testing.mps -- timeout 240 python3 bench/ep.py --gpu --ranks 2 --transport p2p \
      --sweep 128 --tokens 128 --no-nccl --recv-pool-mib $pool --json $OUT/ep_${v}$i.json > $OUT/ep_${v}$i.log 2>&1
    echo "== $v$i rc=$? $(( $(date +%s) - t1 )) s"
    grep -E "BF16 dispatch:|  dispatch bf16|  dispatch fp8|  combine bf16|torch gather, all|PASS|FAIL" $OUT/ep_${v}$i.log | head -14
  done
done
