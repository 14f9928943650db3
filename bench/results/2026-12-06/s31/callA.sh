# call A: the gate on main (CUDA tests, then every step but the LL ep), then the HT guess A/B x3
source _calls/pin.sh; source _calls/head.sh
GATE_STEPS=tests OUT=$W/gate_tests timeout 330 bash scripts/gpu-check.sh > $W/gate_tests.log 2>&1; echo "tests rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $W/gate_tests.log | tail -8; tail -1 $W/gate_tests.log
pack
GATE_STEPS="proxy post order ep-ht doctor p2p" OUT=$W/gate_rest timeout 200 bash scripts/gpu-check.sh > $W/gate_rest.log 2>&1; echo "rest rc=$?"
awk '/=== summary/ {f=1} f' $W/gate_rest.log | tail -40
pack
AB_DIR=_ab_ht timeout 150 bash scripts/ab.sh run 3 bash bench/results/2026-12-06/s28/one.sh > $W/ab_ht.log 2>&1; echo "ab ht rc=$?"; cut -c1-200 $W/ab_ht.log | tail -50
pack
