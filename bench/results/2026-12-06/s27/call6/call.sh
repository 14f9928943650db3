set -u
W=$OUT/w; mkdir -p $W; export W
pack() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/install.log 2>&1
python3 scripts/gpu_warm.py > $W/warm.log 2>&1; tail -1 $W/warm.log
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -x tests/test_ep_ht_cuda.py tests/test_p2p_cuda.py -k "ht or ep" > $W/cuda.log 2>&1; echo "cuda ht tests rc=$?"; tail -1 $W/cuda.log
pack
bash scripts/ab.sh run 3 bash _calls/one.sh > $W/ab.log 2>&1; grep -v "^ab.sh: swap" $W/ab.log | grep -E "===|HT (dispatch bf16|dispatch fp8|combine)|^rank" | grep -v "default"
pack
