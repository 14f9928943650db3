set -u
W=$OUT/w; mkdir -p $W; export W
pack() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/install.log 2>&1
python3 -m pip install -q --no-deps _calls/line_profiler-*.whl >> $W/install.log 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; nproc; lscpu | grep "Model name"
python3 scripts/gpu_warm.py > $W/warm.log 2>&1; tail -1 $W/warm.log
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 bench/ep_host.py --mode ht --gpu --iters 300 --profile --json $W/host_ht.json > $W/host_ht.log 2>&1; echo "host rc=$?"; grep "per call" $W/host_ht.log
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 bench/ep_host.py --mode ll --gpu --iters 1000 --json $W/host_ll.json > $W/host_ll.log 2>&1; echo "host ll rc=$?"; grep "per call" $W/host_ll.log
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 _calls/lp_ht.py --gpu > $W/lp_stub.log 2>&1; echo "lp rc=$?"; tail -4 $W/lp_stub.log
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 _calls/lp_ht.py --gpu --real --iters 100 > $W/lp_real.log 2>&1; echo "lp real rc=$?"; tail -4 $W/lp_real.log
pack
for i in 1 2 3; do
  CUDA_VISIBLE_DEVICES=0 timeout 70 python3 -m gpunet.device.testing.mps -- \
    python3 bench/ep.py --gpu --ranks 2 --transport p2p --mode ht --ht-configs 64:48:128:16 \
    --json $W/ht$i.json > $W/ht$i.log 2>&1
  echo "== ht $i rc=$?"; grep -E "^ +2 +4096 +HT|torch gather" $W/ht$i.log
  grep -E "^profile" $W/ht$i.log | grep -oE "rank [01], [a-z0-9 ]+|host [0-9.]+|gap [0-9.]+|kernel [0-9.]+|notify [0-9.]+" | paste -sd' ' | sed 's/rank/\nrank/g'
done
pack
