#!/usr/bin/env bash
# session 40, call 2: each HT role a call of its own (spill branch a3af771, in _calls/new) against
# main cb4c094 (this tree). (1) from _calls/new: the gate's CUDA tests (GATE_STEPS=tests; installs
# the new tree editable) and its ep-ht step over p2p at 2 ranks; (2) the HT bench x 3, alternating
# per run base (this tree, PYTHONPATH) and new (installed); Configs 20:48:256:16 (no Config's),
# 64:64:256:16, 128:16:64:8; 2 ranks under MPS, p2p, default pool.
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT/g
ROOT=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
cd _calls/new
OUT=$OUT/g/tests GATE_STEPS=tests timeout 300 bash scripts/gpu-check.sh > $OUT/g/gate_tests.log 2>&1
echo "== tests gate rc=$?"; grep -E "passed|failed" $OUT/g/gate_tests.log | tail -2; tail -1 $OUT/g/gate_tests.log
OUT=$OUT/g/ht GATE_STEPS="ep-ht" EP_TRANSPORTS=p2p EP_RANKS=2 timeout 150 bash scripts/gpu-check.sh > $OUT/g/gate_ht.log 2>&1
echo "== ep-ht gate rc=$?"; tail -1 $OUT/g/gate_ht.log
tar czf $OUT/all.tgz -C $OUT g
CFG=20:48:256:16,64:64:256:16,128:16:64:8
for i in 1 2 3; do
  (cd $ROOT && PYTHONPATH=$ROOT python3 -m gpunet.device.testing.mps -- timeout 120 python3 bench/ep.py --gpu --mode ht \
    --ranks 2 --transport p2p --no-nccl --ht-configs $CFG --json $OUT/g/B$i.json > $OUT/g/B$i.log 2>&1)
  echo "== B$i rc=$? $(grep -c FAIL $OUT/g/B$i.log) FAIL"
  python3 -m gpunet.device.testing.mps -- timeout 120 python3 bench/ep.py --gpu --mode ht \
    --ranks 2 --transport p2p --no-nccl --ht-configs $CFG --json $OUT/g/N$i.json > $OUT/g/N$i.log 2>&1
  echo "== N$i rc=$? $(grep -c FAIL $OUT/g/N$i.log) FAIL"
  tar czf $OUT/all.tgz -C $OUT g
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"] + "/g"
want = [("sweep combine bf16", [20, 48, 256, 16]), ("sweep combine bf16", [64, 64, 256, 16]),
        ("sweep combine bf16", [128, 16, 64, 8]), ("sweep dispatch bf16", [64, 64, 256, 16]),
        ("HT combine bf16 (default Config)", None),
        ("HT combine bf16 (device)", None), ("HT combine bf16 ring (device)", None),
        ("HT dispatch bf16 (device)", None), ("HT dispatch fp8 (device)", None),
        ("HT dispatch bf16", None), ("torch gather (device), all ranks' rows", None)]
print("%-40s %-28s %-28s" % ("median us, runs 1/2/3", "B main cb4c094", "N calls a3af771"))
for op, cfg in want:
    cells = []
    for n in "BN":
        v = []
        for i in (1, 2, 3):
            p = "%s/%s%d.json" % (out, n, i)
            if os.path.exists(p):
                v += ["%.1f%s" % (r["median_us"], "" if cfg else "@" + ":".join(map(str, r.get("config") or [])))
                      for r in json.load(open(p))["rows"] if r["op"] == op and (cfg is None or r.get("config") == cfg)]
        cells.append("/".join(v))
    print("%-40s %-28s %-28s" % (op[:32] + (" " + ":".join(map(str, cfg)) if cfg else ""), cells[0], cells[1]))
PY
