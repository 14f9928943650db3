#!/usr/bin/env bash
# sixteenth session, device call 2: p2p put A/B (bd4af85 overlapping launch vs fb47f18), then gate p2p + proxy on bd4af85
set -u
W=$OUT/w; mkdir -p $W
pack() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/install.log 2>&1; tail -2 $W/install.log
nvidia-smi -L
export W
bash scripts/ab.sh run 2 sh -c 'timeout 120 python3 bench/p2p.py --gpu --runs 3 --max-mib 16 --puts-only --json $W/p2p_$AB_TAG.json > $W/p2p_$AB_TAG.log 2>&1; echo "== $AB_TAG"; grep -E "MiB|KiB|target|test " $W/p2p_$AB_TAG.log | tail -14; date +%T'
pack
GATE_STEPS="p2p proxy" OUT=$W/gate timeout 360 bash scripts/gpu-check.sh > $W/gate.log 2>&1; tail -45 $W/gate.log
pack
date +%T
