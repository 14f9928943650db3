#!/usr/bin/env bash
# session 38, call 2 (warm): the CUDA HT tests again (the in-place round moved after the repeated
# round), then the gate's ep-ht step over p2p at 2 ranks
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT/g
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 200 python3 -m pytest -q tests/test_ep_ht_cuda.py > $OUT/g/cuda_tests.log 2>&1
echo "== cuda tests rc=$? $(tail -1 $OUT/g/cuda_tests.log)"
grep -B5 -A25 "^E  \|FAILED" $OUT/g/cuda_tests.log | head -40
GATE_STEPS="ep-ht" EP_TRANSPORTS=p2p EP_RANKS=2 timeout 300 bash scripts/gpu-check.sh > $OUT/g/gate.log 2>&1
echo "== gate rc=$?"
tar czf $OUT/all.tgz -C $OUT g
tail -30 $OUT/g/gate.log
