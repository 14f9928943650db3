#!/usr/bin/env bash
# session 37, call 2: the gate's other steps on main (the last run of proxy / post / order / ep /
# p2p / doctor was session 31's; the device code has changed since only in ht.cuh F_HT_PRE); ep (LL bench) left out for the budget
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT/g
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$OUT/g GATE_STEPS="proxy post order doctor p2p" \
  timeout 470 bash scripts/gpu-check.sh > $OUT/g/gate_rest.log 2>&1
echo "gate rc=$?"
grep -E "^=== |GATE|NOT met|FAIL" $OUT/g/gate_rest.log | tail -40
tail -25 $OUT/g/gate_rest.log
tar czf $OUT/all.tgz -C $OUT g
