#!/usr/bin/env bash
# sixteenth session, device call 3: why the full bench/p2p.py failed in call 2 (new = bd4af85), then GATE_STEPS=tests
set -u
W=$OUT/w; mkdir -p $W
pack() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/install.log 2>&1; tail -2 $W/install.log
nvidia-smi -L
swap() { (cd _ab/$1 && find . -type f) | while read -r f; do f=${f#./}; cp "_ab/$1/$f" "$f"; done; }
timeout 150 python3 bench/p2p.py --gpu --runs 3 --puts-only --json $W/p2p_po256.json > $W/p2p_po256.log 2>&1; echo "puts-only 256 MiB rc=$?"
grep -E "MiB|KiB|target|test " $W/p2p_po256.log | tail -14; grep -n -m3 -A25 "Traceback" $W/p2p_po256.log | head -60
pack; date +%T
timeout 200 python3 bench/p2p.py --gpu --runs 3 --json $W/p2p_full_new.json > $W/p2p_full_new.log 2>&1; rc=$?; echo "full new rc=$rc"
grep -E "MiB|KiB|target|test |mode " $W/p2p_full_new.log | tail -30
if grep -q "FAIL" $W/p2p_full_new.log; then
  grep -n -m2 -B3 -A30 "Traceback" $W/p2p_full_new.log | head -90
  swap old
  timeout 200 python3 bench/p2p.py --gpu --runs 3 --json $W/p2p_full_old.json > $W/p2p_full_old.log 2>&1; echo "full old rc=$?"
  grep -E "MiB|KiB|target|test " $W/p2p_full_old.log | tail -16
  grep -n -m1 -A20 "Traceback" $W/p2p_full_old.log | head -30
  swap new
fi
pack; date +%T
GATE_STEPS=tests OUT=$W/gate timeout 330 bash scripts/gpu-check.sh > $W/gate.log 2>&1; tail -22 $W/gate.log
pack; date +%T
