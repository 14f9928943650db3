#!/usr/bin/env bash
# session 33, call 4: does the HT bench's receive pool run out (its default size: 10 calls' rows +
# 64 MiB), and is the dispatch faster with a pool that does not? default vs 4096 MiB, alternated
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
for i in 1 2; do
  for v in dflt big; do
    mib=-1; [ $v = big ] && mib=4096
    python3 -m gpunet.device.testing.mps -- timeout 120 python3 bench/ep.py --gpu --mode ht --ranks 2 \
      --transport p2p --no-nccl --recv-pool-mib $mib --json $OUT/pool_${v}$i.json > $OUT/pool_${v}$i.log 2>&1
    echo "== ${v}$i rc=$? no-room warnings: $(grep -c 'had no room' $OUT/pool_${v}$i.log)"
    grep -E "\(device\)|^test|receive pool:" $OUT/pool_${v}$i.log | cut -c1-160 | head -7
  done
done
tar czf $OUT/all.tgz -C $OUT $(cd $OUT && ls *.json *.log 2>/dev/null)
