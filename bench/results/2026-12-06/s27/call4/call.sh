set -u
W=$OUT/w; mkdir -p $W; export W
pack() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/install.log 2>&1
python3 scripts/gpu_warm.py > $W/warm.log 2>&1; tail -1 $W/warm.log
# the default Configs (get_dispatch_config / get_combine_config at 2 ranks: (20, 24, 256), (20, 10, 256);
# CUDA_HT_WARPS 8) next to variants at 20 SMs and the sweep's best
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m gpunet.device.testing.mps -- \
  python3 bench/ep.py --gpu --ranks 2 --transport p2p --mode ht \
  --ht-configs 20:24:256:8,20:10:256:8,20:24:256:16,20:48:128:16,20:32:256:16,32:48:128:16,64:48:128:16 \
  --json $W/ht_sweep.json > $W/ht_sweep.log 2>&1
echo "sweep rc=$?"; grep -E "sweep|HT|gather" $W/ht_sweep.log | grep -v "^target"
pack
for i in 1 2 3; do
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m gpunet.device.testing.mps -- \
    python3 bench/ep.py --gpu --ranks 2 --transport p2p --json $W/ll$i.json > $W/ll$i.log 2>&1
  echo "== ll $i rc=$?"; grep -E "^ +2 +128 |^target|^test" $W/ll$i.log | head -14
  pack
done
