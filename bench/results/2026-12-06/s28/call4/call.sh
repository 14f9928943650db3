set -u
W=$OUT/w; mkdir -p $W; export W
pack() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
date +%T
GATE_STEPS="ep-ht p2p proxy post order doctor" EP_TRANSPORTS=p2p OUT=$W/gate timeout 280 bash scripts/gpu-check.sh > $W/gate.log 2>&1; tail -32 $W/gate.log
pack; date +%T
