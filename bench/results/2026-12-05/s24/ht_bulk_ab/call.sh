set -u
W=$OUT/w; mkdir -p $W; export W
pack() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
date +%T
python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/install.log 2>&1
python3 scripts/gpu_warm.py > $W/warm.log 2>&1; tail -1 $W/warm.log; date +%T
timeout 120 python3 -m pytest -q -x tests/test_ep_ht_cuda.py > $W/ht_cuda.log 2>&1; tail -3 $W/ht_cuda.log; date +%T
pack
timeout 300 bash scripts/ab.sh run 2 sh -c 'CUDA_VISIBLE_DEVICES=0 timeout 80 python3 -m gpunet.device.testing.mps -- python3 bench/ep.py --gpu --ranks 2 --transport p2p --mode ht --ht-configs 48:16:128:16,64:32:128:16 --json $W/ht_$AB_TAG.json > $W/ht_$AB_TAG.log 2>&1; echo "== $AB_TAG rc=$? $(date +%T)"; grep -E "^ +2 +4096 +HT|gather|check" $W/ht_$AB_TAG.log | head -8'
pack; date +%T
