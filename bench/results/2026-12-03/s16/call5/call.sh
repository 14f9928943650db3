#!/usr/bin/env bash
# sixteenth session, device call 5: load_const forms (0 __ldg, 1 pure asm, 2 volatile asm): post rate;
# the ping-pong (which faulted with the pure asm); then the gate's CUDA tests on the safe form that posts faster
set -u
W=$OUT/w; mkdir -p $W
pack() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/install.log 2>&1; tail -2 $W/install.log
for m in 0 1 2 0 2; do
  timeout 100 python3 bench/device_post.py --define GPUNET_LOAD_CONST_MODE=$m --cq collapsed --qps 1 --warps 1,32 --post-modes serial,batched --serial-warps 1 --skip store,e2e,ordering --repeat 3 --json $W/post_m$m.$RANDOM.json > $W/post_m$m.log 2>&1
  echo "== load_const mode $m"; grep "^| post, sink" $W/post_m$m.log
done
pack; date +%T
timeout 100 python3 bench/p2p.py --gpu --runs 3 --max-mib 1 --skip sweep,profile,nic --json $W/p2p_pp_m0.json > $W/p2p_pp_m0.log 2>&1; echo "ping-pong (mode 0) rc=$?"
grep -E "target|test |mode [0-9]" $W/p2p_pp_m0.log | tail -14; grep -n -m1 -A8 Traceback $W/p2p_pp_m0.log | head -10
pack; date +%T
best=$(python3 - "$W" <<'PY'
import json, glob, statistics, sys
r = {}
for f in glob.glob(sys.argv[1] + "/post_m*.json"):
    m = f.split("post_m")[1][0]
    for row in json.load(open(f))["rows"]:
        if row.get("row") == "post, sink" and row["warps"] == 1 and row["post_mode"] == "serial":
            r.setdefault(m, []).append(row["mwqes"])
print({k: sorted(v) for k, v in r.items()}, file=sys.stderr)
print("2" if statistics.median(r.get("2", [0])) > statistics.median(r.get("0", [0])) else "0")
PY
)
echo "safe form chosen for the gate: mode $best"
sed -i "s/#define GPUNET_LOAD_CONST_MODE 0/#define GPUNET_LOAD_CONST_MODE $best/" device/include/gpunet/arch.cuh
grep -n "define GPUNET_LOAD_CONST_MODE" device/include/gpunet/arch.cuh
GATE_STEPS=tests OUT=$W/gate timeout 300 bash scripts/gpu-check.sh > $W/gate.log 2>&1; tail -8 $W/gate.log
pack; date +%T
