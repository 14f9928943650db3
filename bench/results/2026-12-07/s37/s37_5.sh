#!/usr/bin/env bash
# session 37, call 5: main 27f325c (the 2-rank default Configs with chunk 48): the HT bench once
# at 64:64:256:16, whose "(default Config)" rows run get_dispatch_config(2) / get_combine_config(2)
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT/g
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -m gpunet.device.testing.mps -- timeout 150 python3 bench/ep.py --gpu --mode ht --ranks 2 \
  --transport p2p --no-nccl --ht-configs 64:64:256:16 --json $OUT/g/d1.json > $OUT/g/d1.log 2>&1
echo "rc=$? no-room: $(grep -c 'had no room' $OUT/g/d1.log) FAIL: $(grep -c FAIL $OUT/g/d1.log)"
grep -E "^ *2 +4096" $OUT/g/d1.log | grep -v sweep | cut -c1-130
tar czf $OUT/all.tgz -C $OUT g
