#!/usr/bin/env bash
# session 39, call 1: main 691de4e (device code as gated on the H100 in session 38) on whatever
# card comes (asked: an H200): the gate's ep-ht step over p2p at 2 ranks, then the in-place combine
# bench: 3 runs, Configs 64:64:256:16 and 128:16:64:8, 2 ranks under MPS, p2p, default pool
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT/g
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
GATE_STEPS="ep-ht" EP_TRANSPORTS=p2p EP_RANKS=2 timeout 300 bash scripts/gpu-check.sh > $OUT/g/gate.log 2>&1
echo "== gate rc=$?"; tail -3 $OUT/g/gate.log
for i in 1 2 3; do
  python3 -m gpunet.device.testing.mps -- timeout 150 python3 bench/ep.py --gpu --mode ht --ranks 2 \
    --transport p2p --no-nccl --ht-configs 64:64:256:16,128:16:64:8 --json $OUT/g/H$i.json > $OUT/g/H$i.log 2>&1
  echo "== H$i rc=$? no-room: $(grep -c 'had no room' $OUT/g/H$i.log) $(grep -c FAIL $OUT/g/H$i.log) FAIL"
  tar czf $OUT/all.tgz -C $OUT g
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"] + "/g"
for i in (1, 2, 3):
    p = "%s/H%d.json" % (out, i)
    if not os.path.exists(p):
        continue
    d = json.load(open(p))
    rows = {r["op"]: r for r in d["rows"]}
    g = rows["torch gather (device), all ranks' rows"]["median_us"]
    print("H%d gather (device) %.1f us" % (i, g))
    for o in ("HT combine bf16 (device)", "HT combine bf16 ring (device)", "HT dispatch bf16 (device)",
              "HT dispatch fp8 (device)", "HT combine bf16", "HT combine bf16 ring", "HT dispatch bf16",
              "HT combine bf16 (default Config)"):
        r = rows.get(o)
        if r:
            print("   %-36s %-20s %7.1f us %5.2fx" % (o, r.get("config"), r["median_us"], r["median_us"] / g if "(device)" in o else r["vs_torch_gather"]))
PY
