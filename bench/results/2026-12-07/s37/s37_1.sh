#!/usr/bin/env bash
# session 37, call 1 (planned in session 36 as call 5): the HT Configs a caller gets without asking (get_dispatch_config(2) /
# get_combine_config(2): Buffer.num_sms = 20 SMs, DeepEP's chunk / ring) against other chunk /
# ring pairs at the same 20 SMs (16 warps, CUDA_HT_WARPS), 3 runs of one sweep, 2 ranks under MPS,
# p2p, the default receive pool, DeepEP's HT workload; plus three 64/128-SM Configs with a 256-token ring (the combine: does a larger ring cut the sender's wait for credit?)
set -u
T0=$(date +%s)
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT/g
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
CF="20:24:256:16,20:10:256:16,20:32:256:16,20:48:128:16,20:32:128:16,20:48:256:16,64:32:256:16,64:64:256:16,128:16:256:8"
for i in 1 2 3; do
  t1=$(date +%s)
  python3 -m gpunet.device.testing.mps -- \
    timeout 110 python3 bench/ep.py --gpu --mode ht --ranks 2 \
    --transport p2p --no-nccl --ht-configs $CF --json $OUT/g/sw$i.json > $OUT/g/sw$i.log 2>&1
  echo "== sweep$i rc=$? $(( $(date +%s) - t1 )) s no-room: $(grep -c 'had no room' $OUT/g/sw$i.log)"
  grep -E "FAIL|check" $OUT/g/sw$i.log | head -5
  tar czf $OUT/all.tgz -C $OUT g
done
python3 - <<'PY'
import json, os, statistics
out = os.environ["OUT"] + "/g"
runs = [json.load(open("%s/sw%d.json" % (out, i))) for i in (1, 2, 3) if os.path.exists("%s/sw%d.json" % (out, i))]
g = {}
for d in runs:
    for r in d["rows"]:
        if r["op"].startswith("sweep "):
            g.setdefault((tuple(r["config"]), r["op"][6:]), []).append(r["median_us"])
        if r["op"] == "torch gather, all ranks' rows":
            g.setdefault(("gather", ""), []).append(r["median_us"])
print("gather", g.get(("gather", "")))
ops = ["dispatch bf16", "dispatch fp8", "combine bf16", "dispatch bf16 worst"]
print("%-20s" % "config" + "".join("%26s" % o for o in ops))
for c in sorted({k[0] for k in g if k[0] != "gather"}):
    print("%-20s" % (c,) + "".join("%26s" % "/".join("%.0f" % v for v in g.get((c, o), [])) for o in ops))
PY

# then the gate's CUDA tests on this tree (HEAD babd938: 8c00e19's host code never ran on a GPU)
LEFT=$(( 580 - ($(date +%s) - T0) ))
echo "== gate tests with ${LEFT} s left"
if [ $LEFT -gt 150 ]; then
  OUT=$OUT/g GATE_STEPS=tests timeout $LEFT bash scripts/gpu-check.sh > $OUT/g/gate_tests.log 2>&1
  echo "gate rc=$?"; grep -E "passed|failed|GATE" $OUT/g/gate_tests.log | tail -4
fi
tar czf $OUT/all.tgz -C $OUT g
