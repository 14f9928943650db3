#!/usr/bin/env bash
# sixteenth session, device call 4: which part of bench/p2p.py --gpu faults (illegal address; call 3: new and old alike)
set -u
W=$OUT/w; mkdir -p $W
pack() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/install.log 2>&1; tail -2 $W/install.log
for part in pingpong sweep profile nic; do
  skip=$(echo sweep,profile,nic,pingpong | tr , '\n' | grep -v "^$part$" | paste -sd,)
  mib=1; [ $part = sweep ] && mib=64
  timeout 120 python3 bench/p2p.py --gpu --runs 3 --max-mib $mib --skip $skip --json $W/p2p_$part.json > $W/p2p_$part.log 2>&1
  echo "== $part (skip $skip) rc=$?"
  grep -E "target|test |mode [0-9]|ibgda|MiB  " $W/p2p_$part.log | tail -14
  grep -n -m1 -A14 "Traceback" $W/p2p_$part.log | head -16
  pack; date +%T
done
