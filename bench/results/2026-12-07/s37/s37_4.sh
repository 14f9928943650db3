#!/usr/bin/env bash
# session 37, call 4: HT Configs at 64 SMs alternated x3: A 64:48:128:16 (the bench's best so far),
# B 64:64:256:16 (call 1's sweep: fastest dispatch), C 64:48:256:16 (the ring alone); 2 ranks under
# MPS, p2p, default pool, DeepEP's HT workload; host-timed and device-timed rows
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT/g
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
for i in 1 2 3; do
  for v in A:64:48:128:16 B:64:64:256:16 C:64:48:256:16; do
    n=${v%%:*}; cf=${v#*:}
    python3 -m gpunet.device.testing.mps -- timeout 90 python3 bench/ep.py --gpu --mode ht --ranks 2 \
      --transport p2p --no-nccl --ht-configs $cf --json $OUT/g/$n$i.json > $OUT/g/$n$i.log 2>&1
    echo "== $n$i rc=$? no-room: $(grep -c 'had no room' $OUT/g/$n$i.log) $(grep -c FAIL $OUT/g/$n$i.log) FAIL"
  done
  tar czf $OUT/all.tgz -C $OUT g
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"] + "/g"
ops = ["HT dispatch bf16", "HT dispatch fp8", "HT combine bf16", "HT dispatch bf16 worst",
       "HT dispatch bf16 (device)", "HT dispatch fp8 (device)", "HT combine bf16 (device)",
       "HT dispatch bf16 worst (device)", "torch gather, all ranks' rows", "torch gather (device), all ranks' rows"]
print("%-34s %24s %24s %24s" % ("op", "A 64:48:128", "B 64:64:256", "C 64:48:256"))
for o in ops:
    cells = []
    for n in "ABC":
        v = []
        for i in (1, 2, 3):
            p = "%s/%s%d.json" % (out, n, i)
            if os.path.exists(p):
                v += [r["median_us"] for r in json.load(open(p))["rows"] if r["op"] == o]
        cells.append("/".join("%.1f" % x for x in v))
    print("%-34s %24s %24s %24s" % (o, *cells))
PY
