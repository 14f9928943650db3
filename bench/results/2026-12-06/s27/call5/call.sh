set -u
W=$OUT/w; mkdir -p $W; export W
pack() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/install.log 2>&1
python3 scripts/gpu_warm.py > $W/warm.log 2>&1; tail -1 $W/warm.log
for i in 1 2 3; do
  CUDA_VISIBLE_DEVICES=0 timeout 90 python3 -m gpunet.device.testing.mps -- \
    python3 bench/ep.py --gpu --ranks 2 --transport p2p --mode ht --ht-configs 64:48:128:16 \
    --json $W/ht$i.json > $W/ht$i.log 2>&1
  echo "== ht $i rc=$?"; grep -E "^ +2 +4096 +HT|torch gather|^test" $W/ht$i.log
  pack
done
GATE_STEPS=tests OUT=$W/gate timeout 300 bash scripts/gpu-check.sh > $W/gate.log 2>&1; echo "gate rc=$?"; tail -2 $W/gate.log; grep -E "passed|failed" $W/gate/cuda_tests.log 2>/dev/null | tail -1
pack
