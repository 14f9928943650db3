#!/usr/bin/env bash
# session 33, call 1: the gate's CUDA tests on main (the first GPU run of sessions 32-33's device
# changes), then two alternated pairs of the LL dispatch, direct (with the compaction fast path,
# 2888501, never measured) vs messages; 2 ranks under MPS, DeepEP's workload
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT/g
echo "tree: $(cat _calls/HEAD)"
OUT=$OUT/g GATE_STEPS=tests timeout 300 bash scripts/gpu-check.sh 2>&1 | tail -25
for i in 1 2; do
  for v in direct msg; do
    pool=-1; [ $v = msg ] && pool=0
    t1=$(date +%s)
    GPUNET_EP_LL_DIRECT=$([ $v = direct ] && echo 1 || echo 0) python3 -m gpunet.device.testing.mps -- \
      timeout 100 python3 bench/ep.py --gpu --ranks 2 --transport p2p --sweep 128 --tokens 128 --no-nccl \
      --recv-pool-mib $pool --json $OUT/ep_${v}$i.json > $OUT/ep_${v}$i.log 2>&1
    echo "== $v$i rc=$? $(( $(date +%s) - t1 )) s"
    grep -E "BF16 dispatch:|  dispatch bf16|  dispatch fp8|  combine bf16|torch gather, all|PASS|FAIL" $OUT/ep_${v}$i.log | head -10
  done
done
tar czf $OUT/all.tgz -C $OUT g $(cd $OUT && ls ep_*.json ep_*.log 2>/dev/null)
