set -u
W=$OUT/w; mkdir -p $W
pack() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
date +%T
rm -rf _ab _ab_pp _ab_ep
python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/install.log 2>&1
GATE_STEPS="ep p2p ep-ht" EP_TRANSPORTS=p2p EP_RANKS=2,4 OUT=$W/gate timeout 560 bash scripts/gpu-check.sh > $W/gate.log 2>&1
tail -45 $W/gate.log
pack; date +%T
