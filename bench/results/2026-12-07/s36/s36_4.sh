#!/usr/bin/env bash
# session 36, call 4: the host's share of an HT call on the GPU machine's CPU (bench/ep_host.py
# --mode ht --gpu: launches stubbed), ep/_pool.packed before (5d6...: slice + two views a part,
# _calls/_pool_old.py) and after (one as_strided a part), alternated x3
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT/g
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
cp gpunet/ep/_pool.py /tmp/_pool_new.py
for i in 1 2 3; do
  for v in old new; do
    if [ $v = old ]; then cp _calls/_pool_old.py gpunet/ep/_pool.py; else cp /tmp/_pool_new.py gpunet/ep/_pool.py; fi
    timeout 120 python3 bench/ep_host.py --mode ht --gpu --iters 500 --json $OUT/g/host_${v}$i.json > $OUT/g/host_${v}$i.log 2>&1
    echo "== ${v}$i rc=$?"; grep -E "per call" $OUT/g/host_${v}$i.log
  done
done
cp /tmp/_pool_new.py gpunet/ep/_pool.py
tar czf $OUT/all.tgz -C $OUT g
