set -u
W=$OUT/w; mkdir -p $W
date +%T
GATE_STEPS="tests" OUT=$W timeout 330 bash scripts/gpu-check.sh > $OUT/gate.log 2>&1
echo "gate rc=$?"; date +%T
grep -E "PASSED|FAILED|ERROR" $W/cuda_tests.log | wc -l
grep -E "FAILED|ERROR" $W/cuda_tests.log | head
tail -25 $OUT/gate.log
tar czf $OUT/all.tgz -C $W . 2>/dev/null
