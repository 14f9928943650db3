#!/usr/bin/env bash
# session 32, call 2: per-phase profile A/B (direct vs messages), 2 ranks; then 4 ranks bench A/B
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
echo "tree: $(cat _calls/HEAD)"
for i in 1 2; do
  for v in direct msg; do
    pool=-1; [ $v = msg ] && pool=0
    python3 -m gpunet.device.testing.mps -- timeout 200 python3 bench/ep_profile.py --gpu --ranks 2 --transport p2p \
      --no-kineto --iters 20 --hold-us 300 --recv-pool-mib $pool --json $OUT/prof_${v}$i.json > $OUT/prof_${v}$i.log 2>&1
    echo "== prof $v$i rc=$?"
    grep -E "^op |^dispatch bf16|^combine bf16|check:" $OUT/prof_${v}$i.log | head -8
  done
done
for v in direct msg; do
  pool=-1; [ $v = msg ] && pool=0
  python3 -m gpunet.device.testing.mps -- timeout 200 python3 bench/ep.py --gpu --ranks 4 --transport p2p \
    --sweep 128 --tokens 128 --no-nccl --recv-pool-mib $pool --json $OUT/ep4_${v}.json > $OUT/ep4_${v}.log 2>&1
  echo "== ep4 $v rc=$?"
  grep -E "BF16 dispatch:|  dispatch bf16|  dispatch fp8|  combine bf16|torch gather, all|PASS|FAIL" $OUT/ep4_${v}.log | head -14
done
