set -u
W=$OUT/w; mkdir -p $W; export W
pack() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/install.log 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m pytest -q -x tests/test_ep_ht_cuda.py tests/test_p2p_cuda.py -k "ht or ep" > $W/cuda.log 2>&1; echo "cuda ht tests rc=$?"; tail -1 $W/cuda.log
pack
CUDA_VISIBLE_DEVICES=0 timeout 40 python3 -m gpunet.device.testing.mps -- \
  python3 bench/ep.py --gpu --ranks 2 --transport p2p --mode ht --ht-configs 64:48:128:16 \
  --json $W/ht.json > $W/ht.log 2>&1; echo "ht rc=$?"; grep -E "^ +2 +4096 +HT|torch gather|^test" $W/ht.log
pack
