#!/usr/bin/env bash
# session 38, call 1: the in-place combine (ht.cuh F_HT_PULL) on the GPU: the CUDA HT tests, then
# 3 runs at Config 64:64:256:16, 2 ranks under MPS, p2p, default pool, DeepEP's HT workload: the
# combine of recv_x (in the pool: in place) and of its copy in torch memory (the rings) in each run
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT/g
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 240 python3 -m pytest -q -x tests/test_ep_ht_cuda.py > $OUT/g/cuda_tests.log 2>&1
echo "== cuda tests rc=$? $(tail -1 $OUT/g/cuda_tests.log)"
for i in 1 2 3; do
  for v in P:1; do
    n=${v%%:*}; pull=${v#*:}
    GPUNET_EP_HT_PULL=$pull python3 -m gpunet.device.testing.mps -- timeout 120 python3 bench/ep.py --gpu --mode ht \
      --ranks 2 --transport p2p --no-nccl --ht-configs 64:64:256:16 --json $OUT/g/$n$i.json > $OUT/g/$n$i.log 2>&1
    echo "== $n$i rc=$? no-room: $(grep -c 'had no room' $OUT/g/$n$i.log) $(grep -c FAIL $OUT/g/$n$i.log) FAIL"
  done
  tar czf $OUT/all.tgz -C $OUT g
done
grep -B2 -A30 "FAILED\|Error" $OUT/g/cuda_tests.log | tail -40
python3 - <<'PY'
import json, os
out = os.environ["OUT"] + "/g"
ops = ["HT dispatch bf16", "HT combine bf16", "HT combine bf16 ring", "HT dispatch bf16 (device)",
       "HT combine bf16 (device)", "HT combine bf16 ring (device)",
       "HT dispatch fp8 (device)", "torch gather, all ranks' rows", "torch gather (device), all ranks' rows"]
print("%-40s %28s" % ("op (median us, runs 1/2/3)", "P"))
for o in ops:
    cells = []
    for n in "P":
        v = []
        for i in (1, 2, 3):
            p = "%s/%s%d.json" % (out, n, i)
            if os.path.exists(p):
                v += [r["median_us"] for r in json.load(open(p))["rows"] if r["op"] == o]
        cells.append("/".join("%.1f" % x for x in v))
    print("%-40s %28s" % (o, *cells))
for n in "P":
    for i in (1, 2, 3):
        p = "%s/%s%d.json" % (out, n, i)
        if not os.path.exists(p):
            continue
        rows = {r["op"]: r["median_us"] for r in json.load(open(p))["rows"]}
        g = rows.get("torch gather (device), all ranks' rows")
        c = rows.get("HT combine bf16 (device)")
        cr = rows.get("HT combine bf16 ring (device)")
        if g and c and cr:
            print("%s%d combine (device) / gather = %.2fx; ring %.2fx; in place / ring %.2f"
                  % (n, i, c / g, cr / g, c / cr))
PY
