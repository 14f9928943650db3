set -u
W=$OUT/w; mkdir -p $W; export W
pack() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
date +%T
python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/install.log 2>&1
bash scripts/ab.sh run 3 bash _calls/one.sh > $W/ab.log 2>&1; grep -v "^ab.sh: swap" $W/ab.log | grep -E "==|HT (dispatch bf16|dispatch fp8|combine)" | grep -v "default"
pack; date +%T
GATE_STEPS=tests OUT=$W/gate timeout 330 bash scripts/gpu-check.sh > $W/gate.log 2>&1; tail -3 $W/gate.log
pack; date +%T
