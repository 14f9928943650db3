#!/usr/bin/env bash
# session 40, call 1: the GPU gate on main cb4c094 (the split in-place combine's first gate):
# GATE_STEPS=tests, then GATE_STEPS=ep-ht over p2p at 2 ranks
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT/g
nvidia-smi --query-gpu=name --format=csv,noheader
git log --oneline -1 2>/dev/null || true
OUT=$OUT/g/tests GATE_STEPS=tests timeout 330 bash scripts/gpu-check.sh > $OUT/g/gate_tests.log 2>&1
echo "== tests gate rc=$?"; grep -E "passed|failed" $OUT/g/gate_tests.log | tail -3; tail -2 $OUT/g/gate_tests.log
tar czf $OUT/all.tgz -C $OUT g
OUT=$OUT/g/ht GATE_STEPS="ep-ht" EP_TRANSPORTS=p2p EP_RANKS=2 timeout 200 bash scripts/gpu-check.sh > $OUT/g/gate_ht.log 2>&1
echo "== ep-ht gate rc=$?"; tail -14 $OUT/g/gate_ht.log
tar czf $OUT/all.tgz -C $OUT g
