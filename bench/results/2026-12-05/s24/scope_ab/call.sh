set -u
W=$OUT/w; mkdir -p $W
pack() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
date +%T
python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/install.log 2>&1
python3 scripts/gpu_warm.py > $W/warm.log 2>&1
export W
rm -rf _ab; cp -r _ab_pp _ab
timeout 250 bash scripts/ab.sh run 2 sh -c 'timeout 100 python3 bench/p2p.py --gpu --runs 3 --max-mib 1 --skip sweep,profile,nic --json $W/pp_$AB_TAG.json > $W/pp_$AB_TAG.log 2>&1; echo "== $AB_TAG rc=$?"; grep -A16 "ping-pong modes" $W/pp_$AB_TAG.log | head -18'
date +%T; pack
rm -rf _ab; cp -r _ab_ep _ab
timeout 220 bash scripts/ab.sh run 2 sh -c 'timeout 90 python3 -m gpunet.device.testing.mps -- python3 bench/ep_profile.py --gpu --ranks 2 --transport p2p --no-kineto --iters 20 --hold-us 300 --json $W/prof_$AB_TAG.json > $W/prof_$AB_TAG.log 2>&1; echo "== $AB_TAG rc=$?"'
python3 bench/ep_profile_ab.py new="$W/prof_new*.json" old="$W/prof_old*.json" 2>&1 | tail -30
pack; date +%T

