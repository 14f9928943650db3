#!/usr/bin/env bash
# session 36, call 1: (a) the HT bench with the prelaunch (pre) vs without
# (GPUNET_EP_HT_PRELAUNCH=0; nopre), alternated x3 at Config 64:48:128:16, 2 ranks under MPS,
# p2p, receive pool, DeepEP's HT workload (each run checks its rows against the reference);
# (b) with the time left, the EP CUDA test files (HT first)
set -u
T0=$(date +%s)
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT/g
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
CF="64:48:128:16"
for i in 1 2 3; do
  for v in pre nopre; do
    t1=$(date +%s)
    GPUNET_EP_HT_PRELAUNCH=$([ $v = pre ] && echo 1 || echo 0) python3 -m gpunet.device.testing.mps -- \
      timeout 120 python3 bench/ep.py --gpu --mode ht --ranks 2 \
      --transport p2p --no-nccl --ht-configs $CF --json $OUT/ht_${v}$i.json > $OUT/ht_${v}$i.log 2>&1
    echo "== ${v}$i rc=$? $(( $(date +%s) - t1 )) s no-room: $(grep -c 'had no room' $OUT/ht_${v}$i.log)"
    grep -E "HT (dispatch|combine)|gather|check|FAIL" $OUT/ht_${v}$i.log | grep -v "default\|sweep" | cut -c1-140 | head -12
  done
  tar czf $OUT/all.tgz -C $OUT g $(cd $OUT && ls ht_*.json ht_*.log 2>/dev/null)
done
LEFT=$(( 570 - ($(date +%s) - T0) ))
echo "== tests with ${LEFT} s left"
if [ $LEFT -gt 60 ]; then
  timeout $LEFT python3 -m pytest -v -x tests/test_ep_ht_cuda.py tests/test_ep_cuda.py > $OUT/g/ep_cuda.log 2>&1
  echo "ep cuda tests rc=$?"
  grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/g/ep_cuda.log | tail -30
fi
tar czf $OUT/all.tgz -C $OUT g $(cd $OUT && ls ht_*.json ht_*.log 2>/dev/null)
