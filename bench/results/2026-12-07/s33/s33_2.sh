#!/usr/bin/env bash
# session 33, call 2: the HT bench, main (combine-row tag check, descriptor revoke, header op
# counter) vs 3c9969e's ht.cuh, alternated, 2 ranks under MPS over p2p
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
cp gpunet/device/include/gpunet/ep/ht.cuh _calls/ht_new.cuh
for i in 1 2; do
  for v in new old; do
    cp _calls/ht_$v.cuh gpunet/device/include/gpunet/ep/ht.cuh
    t1=$(date +%s)
    python3 -m gpunet.device.testing.mps -- timeout 150 python3 bench/ep.py --gpu --mode ht --ranks 2 \
      --transport p2p --no-nccl --json $OUT/ht_${v}$i.json > $OUT/ht_${v}$i.log 2>&1
    echo "== $v$i rc=$? $(( $(date +%s) - t1 )) s"
    grep -E "dispatch|combine|gather|PASS|FAIL" $OUT/ht_${v}$i.log | head -12
  done
done
cp _calls/ht_new.cuh gpunet/device/include/gpunet/ep/ht.cuh
tar czf $OUT/all.tgz -C $OUT $(cd $OUT && ls ht_*.json ht_*.log 2>/dev/null)
