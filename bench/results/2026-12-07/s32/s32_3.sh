#!/usr/bin/env bash
# session 32, call 3: the direct dispatch after the compaction fast path: CUDA test, A/B x3 (2 ranks),
# one profile pair, 4 ranks one pair
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
echo "tree: $(cat _calls/HEAD)"
timeout 200 python3 -m pytest -q -x tests/test_p2p_cuda.py -k "ep_direct" 2>&1 | tail -2
for i in 1 2 3; do
  for v in direct msg; do
    pool=-1; [ $v = msg ] && pool=0
    python3 -m gpunet.device.testing.mps -- timeout 120 python3 bench/ep.py --gpu --ranks 2 --transport p2p \
      --sweep 128 --tokens 128 --no-nccl --recv-pool-mib $pool --json $OUT/ep_${v}$i.json > $OUT/ep_${v}$i.log 2>&1
    echo "== $v$i rc=$?"
    grep -E "  dispatch bf16|  dispatch fp8|  combine bf16 \(|torch gather, all|FAIL" $OUT/ep_${v}$i.log | head -8
  done
done
for v in direct msg; do
  pool=-1; [ $v = msg ] && pool=0
  python3 -m gpunet.device.testing.mps -- timeout 120 python3 bench/ep_profile.py --gpu --ranks 2 --transport p2p \
    --no-kineto --iters 20 --hold-us 300 --recv-pool-mib $pool --json $OUT/prof_${v}.json > $OUT/prof_${v}.log 2>&1
  echo "== prof $v rc=$?"; grep -E "^op |^dispatch|check:" $OUT/prof_${v}.log | head -6
done
for v in direct msg; do
  pool=-1; [ $v = msg ] && pool=0
  python3 -m gpunet.device.testing.mps -- timeout 150 python3 bench/ep.py --gpu --ranks 4 --transport p2p \
    --sweep 128 --tokens 128 --no-nccl --recv-pool-mib $pool --json $OUT/ep4_${v}.json > $OUT/ep4_${v}.log 2>&1
  echo "== ep4 $v rc=$?"; grep -E "  dispatch bf16|  dispatch fp8|  combine bf16 \(|torch gather, all|FAIL" $OUT/ep4_${v}.log | head -8
done
(cd $OUT && tar czf s32_3.tgz *.log *.json && rm -f *.log *.json *.png)
