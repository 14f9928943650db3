set -u
W=$OUT/w; mkdir -p $W; export W
pack() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
date +%T
python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/install.log 2>&1
python3 scripts/gpu_warm.py > $W/warm.log 2>&1; tail -1 $W/warm.log
timeout 40 python3 _calls/pool_micro.py > $W/micro.log 2>&1; echo "micro rc=$?"; grep -E "pool|Error" $W/micro.log | tail -12
pack; date +%T
POOL_ARG="--recv-pool-mib 2048" AB_TAG=big1 bash _calls/one.sh
pack; date +%T
AB_TAG=auto1 bash _calls/one.sh
pack; date +%T
timeout 120 python3 -m gpunet.device.testing.mps -- python3 -m pytest -q -x tests/test_ep_ht_cuda.py -k "pool or graph" > $W/cuda.log 2>&1; echo "cuda tests rc=$?"; tail -3 $W/cuda.log
pack; date +%T
