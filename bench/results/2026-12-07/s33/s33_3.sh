#!/usr/bin/env bash
# session 33, call 3: a third pair of each A/B: HT main vs 3c9969e's ht.cuh; LL direct vs messages
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
cp gpunet/device/include/gpunet/ep/ht.cuh _calls/ht_new.cuh
for v in new old; do
  cp _calls/ht_$v.cuh gpunet/device/include/gpunet/ep/ht.cuh
  python3 -m gpunet.device.testing.mps -- timeout 150 python3 bench/ep.py --gpu --mode ht --ranks 2 \
    --transport p2p --no-nccl --json $OUT/ht_${v}3.json > $OUT/ht_${v}3.log 2>&1
  echo "== ht ${v}3 rc=$?"; grep -E "\(device\)|^test" $OUT/ht_${v}3.log
done
cp _calls/ht_new.cuh gpunet/device/include/gpunet/ep/ht.cuh
for v in direct msg; do
  pool=-1; [ $v = msg ] && pool=0
  GPUNET_EP_LL_DIRECT=$([ $v = direct ] && echo 1 || echo 0) python3 -m gpunet.device.testing.mps -- \
    timeout 100 python3 bench/ep.py --gpu --ranks 2 --transport p2p --sweep 128 --tokens 128 --no-nccl \
    --recv-pool-mib $pool --json $OUT/ep_${v}3.json > $OUT/ep_${v}3.log 2>&1
  echo "== ll ${v}3 rc=$?"; grep -E "\(device\)|torch gather|^test" $OUT/ep_${v}3.log | head -8
done
tar czf $OUT/all.tgz -C $OUT $(cd $OUT && ls *.json *.log 2>/dev/null)
