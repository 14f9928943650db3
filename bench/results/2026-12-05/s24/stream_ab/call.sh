# twenty-third session, device call 2: the streamed LL dispatch and combine (branch ep-ll-stream) on
# the H200: tests/test_ep_cuda.py on the branch, then its profile as "new" against main 69402fe as
# "old", runs alternated in one lease (bench/ep_profile.py, 2 ranks under MPS, p2p, DeepEP's LL
# workload)
set -u
W=$OUT/w; mkdir -p $W
pack() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
date +%T
python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/install.log 2>&1
python3 scripts/gpu_warm.py > $W/warm.log 2>&1; tail -1 $W/warm.log; date +%T
timeout 150 python3 -m pytest -q -rs tests/test_ep_cuda.py > $W/ep_cuda.log 2>&1; tail -3 $W/ep_cuda.log; date +%T
pack
export W
timeout 330 bash scripts/ab.sh run 2 sh -c 'timeout 100 python3 -m gpunet.device.testing.mps -- python3 bench/ep_profile.py --gpu --ranks 2 --transport p2p --no-kineto --iters 20 --hold-us 300 --json $W/prof_$AB_TAG.json > $W/prof_$AB_TAG.log 2>&1; echo "== $AB_TAG rc=$? $(date +%T)"; grep -E "^dispatch|^combine|^check" $W/prof_$AB_TAG.log | head -8'
python3 bench/ep_profile_ab.py new="$W/prof_new*.json" old="$W/prof_old*.json" 2>&1 | tail -30
pack; date +%T

