#!/usr/bin/env bash
# sixteenth session, device call 1: post rate A/B (ae9bb25 load_const vs 3144d6c), phases, gate post+order
set -u
W=$OUT/w; mkdir -p $W
pack() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/install.log 2>&1; tail -2 $W/install.log
nvidia-smi -L
export W
bash scripts/ab.sh run 3 sh -c 'timeout 150 python3 bench/device_post.py --cq collapsed --qps 1 --warps 1,32 --post-modes serial,batched --serial-warps 1,32 --skip store,e2e,ordering --repeat 3 --json $W/post_$AB_TAG.json > $W/post_$AB_TAG.log 2>&1; echo "== $AB_TAG"; grep -E "^\|? *[0-9]+ +\|? *[0-9]+ " $W/post_$AB_TAG.log | head; tail -6 $W/post_$AB_TAG.log; date +%T'
pack
timeout 120 python3 bench/device_post.py --phases --cq collapsed --qps 1 --warps 1 --post-modes serial --serial-warps 1 --skip store,e2e,ordering --repeat 3 --json $W/phases_new.json > $W/phases_new.log 2>&1; tail -25 $W/phases_new.log
pack
date +%T
GATE_STEPS="post order" OUT=$W/gate timeout 330 bash scripts/gpu-check.sh > $W/gate.log 2>&1; tail -30 $W/gate.log
pack
date +%T
