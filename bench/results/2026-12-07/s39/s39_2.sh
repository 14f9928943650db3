#!/usr/bin/env bash
# session 39, call 2: the split in-place combine (tree 1bc9b24). (1) the CUDA HT tests on the new tree;
# (2) the HT bench x 3, alternating per run: base (4490767, the tree before the split, from
# _calls/base) and new (split on) (trimmed for the budget: no split-off variant, no gate step); Configs 20:48:256:16 (the default's),
# 64:64:256:16, 128:16:64:8; 2 ranks under MPS, p2p, default pool.
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT/g
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 200 python3 -m pytest -q tests/test_ep_ht_cuda.py > $OUT/g/cuda_tests.log 2>&1
echo "== cuda tests rc=$? $(tail -1 $OUT/g/cuda_tests.log)"
grep -B5 -A25 "^E  \|FAILED" $OUT/g/cuda_tests.log | head -30
CFG=20:48:256:16,64:64:256:16,128:16:64:8
ROOT=$PWD
for i in 1 2 3; do
  (cd _calls/base && PYTHONPATH=$PWD python3 -c "import gpunet; print('base gpunet', gpunet.__file__)" && \
   PYTHONPATH=$PWD python3 -m gpunet.device.testing.mps -- timeout 150 python3 bench/ep.py --gpu --mode ht --ranks 2 \
    --transport p2p --no-nccl --ht-configs $CFG --json $OUT/g/B$i.json > $OUT/g/B$i.log 2>&1)
  echo "== B$i rc=$? $(grep -c FAIL $OUT/g/B$i.log) FAIL"
  for v in N:1; do
    n=${v%%:*}; sp=${v#*:}
    GPUNET_EP_HT_SPLIT=$sp python3 -m gpunet.device.testing.mps -- timeout 150 python3 bench/ep.py --gpu --mode ht \
      --ranks 2 --transport p2p --no-nccl --ht-configs $CFG --json $OUT/g/$n$i.json > $OUT/g/$n$i.log 2>&1
    echo "== $n$i rc=$? $(grep -c FAIL $OUT/g/$n$i.log) FAIL"
  done
  tar czf $OUT/all.tgz -C $OUT g
done
tar czf $OUT/all.tgz -C $OUT g
python3 - <<'PY'
import json, os
out = os.environ["OUT"] + "/g"
want = [("sweep combine bf16", [20, 48, 256, 16]), ("sweep combine bf16", [64, 64, 256, 16]),
        ("sweep combine bf16", [128, 16, 64, 8]), ("HT combine bf16 (default Config)", None),
        ("HT combine bf16 (device)", None), ("HT combine bf16 ring (device)", None),
        ("HT dispatch bf16 (device)", None), ("torch gather (device), all ranks' rows", None)]
print("%-44s %-22s %-22s %-22s" % ("median us, runs 1/2/3", "B base 4490767", "N split on", "S split off"))
for op, cfg in want:
    cells = []
    for n in "BNS":
        v = []
        for i in (1, 2, 3):
            p = "%s/%s%d.json" % (out, n, i)
            if os.path.exists(p):
                v += ["%.1f" % r["median_us"] for r in json.load(open(p))["rows"]
                      if r["op"] == op and (cfg is None or r.get("config") == cfg)]
        cells.append("/".join(v))
    print("%-44s %-22s %-22s %-22s" % (op + ("" if cfg is None else " %s" % cfg), *cells))
PY
