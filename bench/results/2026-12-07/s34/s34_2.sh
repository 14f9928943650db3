#!/usr/bin/env bash
# session 34, call 2: the gate's CUDA tests on this tree (the revoke helper, the merged combine
# check, the HT dispatch's one int32 allocation), then the HT bench with its pool (in place) vs no
# pool (rings) alternated x3, then the LL dispatch direct vs messages x2 with the bench holding one
# result at a time; 2 ranks under MPS, p2p, DeepEP's workloads
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT/g
echo "tree: $(git rev-parse --short HEAD) + $(git status --short | grep -v _calls | wc -l) changed"
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$OUT/g GATE_STEPS=tests timeout 300 bash scripts/gpu-check.sh 2>&1 | tail -6
tar czf $OUT/all.tgz -C $OUT g
CF="64:48:128:16,128:16:64:8,64:16:128:16"
for i in 1 2 3; do
  for v in pool ring; do
    mib=-1; [ $v = ring ] && mib=0
    t1=$(date +%s)
    python3 -m gpunet.device.testing.mps -- timeout 120 python3 bench/ep.py --gpu --mode ht --ranks 2 \
      --transport p2p --no-nccl --ht-configs $CF --recv-pool-mib $mib --json $OUT/ht_${v}$i.json > $OUT/ht_${v}$i.log 2>&1
    echo "== ${v}$i rc=$? $(( $(date +%s) - t1 )) s no-room: $(grep -c 'had no room' $OUT/ht_${v}$i.log)"
    grep -E "\(device\)|gather \(dev" $OUT/ht_${v}$i.log | cut -c1-120 | head -5
  done
done
tar czf $OUT/all.tgz -C $OUT g $(cd $OUT && ls ht_*.json ht_*.log 2>/dev/null)
for i in 1 2; do
  for v in direct msg; do
    pool=-1; [ $v = msg ] && pool=0
    t1=$(date +%s)
    GPUNET_EP_LL_DIRECT=$([ $v = direct ] && echo 1 || echo 0) python3 -m gpunet.device.testing.mps -- \
      timeout 100 python3 bench/ep.py --gpu --ranks 2 --transport p2p --sweep 128 --tokens 128 --no-nccl \
      --recv-pool-mib $pool --json $OUT/ep_${v}$i.json > $OUT/ep_${v}$i.log 2>&1
    echo "== $v$i rc=$? $(( $(date +%s) - t1 )) s no-room: $(grep -c 'had no room' $OUT/ep_${v}$i.log)"
    grep -E "BF16 dispatch:|\(device\)|gather \(dev" $OUT/ep_${v}$i.log | cut -c1-120 | head -6
  done
  tar czf $OUT/all.tgz -C $OUT g $(cd $OUT && ls ht_*.json ht_*.log ep_*.json ep_*.log 2>/dev/null)
done
