#!/usr/bin/env bash
# session 32, call 4 (the last device time): the direct dispatch after the compaction fast path,
# A/B x3 (2 ranks, alternated), logs packed after each run
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
echo "tree: $(cat _calls/HEAD)"
pack() { (cd $OUT && tar czf s32_4.tgz *.log *.json 2>/dev/null; rm -f *.png); }
for i in 1 2 3; do
  for v in direct msg; do
    d=1; [ $v = msg ] && d=0
    GPUNET_EP_LL_DIRECT=$d python3 -m gpunet.device.testing.mps -- timeout 120 python3 bench/ep.py --gpu --ranks 2 --transport p2p \
      --sweep 128 --tokens 128 --no-nccl --json $OUT/ep_${v}$i.json > $OUT/ep_${v}$i.log 2>&1
    echo "== $v$i rc=$?"
    grep -E "  dispatch bf16|  dispatch fp8|  combine bf16 \(|torch gather, all|FAIL" $OUT/ep_${v}$i.log | head -8
    pack
  done
done
(cd $OUT && rm -f *.log *.json)
