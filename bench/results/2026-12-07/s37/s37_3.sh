#!/usr/bin/env bash
# session 37, call 3: the gate's EP steps on main babd938 (LL over p2p at 2 ranks; HT)
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT/g
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$OUT/g GATE_STEPS="ep ep-ht" EP_TRANSPORTS=p2p EP_RANKS=2 \
  timeout 420 bash scripts/gpu-check.sh > $OUT/g/gate_ep.log 2>&1
echo "gate rc=$?"
grep -E "^\| (EP|ep)|GATE" $OUT/g/gate_ep.log | cut -c1-260 | tail -40
tar czf $OUT/all.tgz -C $OUT g
