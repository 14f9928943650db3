#!/usr/bin/env bash
# session 37, calls 6-8 (run as one-line commands on the warm H200 after call 5; this file records
# them): HT Configs A 64:48:128:16 and B 64:64:256:16 alternated, one pair a call (n = "", 2, 3);
# 2 ranks under MPS, p2p, default pool, DeepEP's HT workload. Logs and JSON: call6/{A,B}{,2,3}.*
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT/g
for v in A${n:-}:64:48:128:16 B${n:-}:64:64:256:16; do
  n_=${v%%:*}; cf=${v#*:}
  python3 -m gpunet.device.testing.mps -- timeout 60 python3 bench/ep.py --gpu --mode ht --ranks 2 \
    --transport p2p --no-nccl --ht-configs $cf --json $OUT/g/$n_.json > $OUT/g/$n_.log 2>&1
  echo "$n_ rc=$? FAIL $(grep -c FAIL $OUT/g/$n_.log)"; grep -E "\(device\)" $OUT/g/$n_.log | cut -c1-110
done
