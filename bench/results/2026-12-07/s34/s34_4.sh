#!/usr/bin/env bash
# session 34, call 4 (H200): the HT bench with its loops holding one dispatch's output (the pool no longer
# runs out): receive pool (default size, in-place stores) vs no pool (--recv-pool-mib 0, the
# rings), alternated, 3 Configs (the best ones of session 33's sweeps), 2 ranks under MPS, p2p
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name --format=csv,noheader
CF="64:48:128:16,128:16:64:8,64:16:128:16"
for i in 1 2 3; do
  for v in pool ring; do
    mib=-1; [ $v = ring ] && mib=0
    t1=$(date +%s)
    python3 -m gpunet.device.testing.mps -- timeout 170 python3 bench/ep.py --gpu --mode ht --ranks 2 \
      --transport p2p --no-nccl --ht-configs $CF --recv-pool-mib $mib --json $OUT/ht_${v}$i.json > $OUT/ht_${v}$i.log 2>&1
    echo "== ${v}$i rc=$? $(( $(date +%s) - t1 )) s no-room: $(grep -c 'had no room' $OUT/ht_${v}$i.log)"
    grep -E "\(device\)|gather|receive pool" $OUT/ht_${v}$i.log | cut -c1-150 | head -7
    tar czf $OUT/all.tgz -C $OUT $(cd $OUT && ls ht_*.json ht_*.log 2>/dev/null)
  done
done
