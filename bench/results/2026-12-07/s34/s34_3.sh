#!/usr/bin/env bash
# session 34, call 3: the gate's CUDA tests on this tree (the HT dispatch's receive tensors and
# its four int32 work tensors each from one allocation, _pool.packed), then the HT bench with the
# pool, this tree ("new") vs 153822b's buffer.py and _pool.py ("old": one allocation per
# tensor), alternated x3 at Config 64:48:128:16; 2 ranks under MPS, p2p, DeepEP's HT workload
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT/g
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$OUT/g GATE_STEPS=tests timeout 300 bash scripts/gpu-check.sh 2>&1 | tail -4
tar czf $OUT/all.tgz -C $OUT g
cp gpunet/ep/buffer.py _calls/new_buffer.py; cp gpunet/ep/_pool.py _calls/new__pool.py
for i in 1 2 3; do
  for v in new old; do
    cp _calls/${v}_buffer.py gpunet/ep/buffer.py; cp _calls/${v}__pool.py gpunet/ep/_pool.py
    t1=$(date +%s)
    python3 -m gpunet.device.testing.mps -- timeout 100 python3 bench/ep.py --gpu --mode ht --ranks 2 \
      --transport p2p --no-nccl --ht-configs 64:48:128:16 --json $OUT/ht_${v}$i.json > $OUT/ht_${v}$i.log 2>&1
    echo "== ${v}$i rc=$? $(( $(date +%s) - t1 )) s no-room: $(grep -c 'had no room' $OUT/ht_${v}$i.log)"
    grep -E "HT (dispatch|combine)|gather" $OUT/ht_${v}$i.log | grep -v "default\|sweep" | cut -c1-120 | head -9
  done
  tar czf $OUT/all.tgz -C $OUT g $(cd $OUT && ls ht_*.json ht_*.log 2>/dev/null)
done
cp _calls/new_buffer.py gpunet/ep/buffer.py; cp _calls/new__pool.py gpunet/ep/_pool.py
