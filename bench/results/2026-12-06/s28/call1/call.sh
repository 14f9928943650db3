set -u
W=$OUT/w; mkdir -p $W; export W
pack() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
date +%T; nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/install.log 2>&1
python3 scripts/gpu_warm.py > $W/warm.log 2>&1; tail -1 $W/warm.log
timeout 170 python3 -m gpunet.device.testing.mps -- python3 -m pytest -q -x tests/test_ep_ht_cuda.py tests/test_p2p_cuda.py -k "ht or ep" > $W/cuda.log 2>&1; echo "cuda tests rc=$?"; tail -3 $W/cuda.log
pack; date +%T
AB_TAG=new0 bash _calls/one.sh
pack; date +%T
for p in 0 1024; do timeout 45 python3 bench/ep_host.py --mode ht --gpu --iters 100 --recv-pool-mib $p > $W/host_pool$p.log 2>&1; echo "ep_host pool=$p rc=$?"; grep "per call" $W/host_pool$p.log; done
pack; date +%T
bash scripts/ab.sh run 1 bash _calls/one.sh > $W/ab.log 2>&1; grep -v "^ab.sh: swap" $W/ab.log | grep -E "==|HT (dispatch bf16|dispatch fp8|combine)|^rank" | grep -v "default"
pack; date +%T
