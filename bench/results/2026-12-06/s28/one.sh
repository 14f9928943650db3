CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m gpunet.device.testing.mps -- \
  python3 bench/ep.py --gpu --ranks 2 --transport p2p --mode ht --ht-configs 64:48:128:16 ${POOL_ARG:-} \
  --json $W/ht_$AB_TAG.json > $W/ht_$AB_TAG.log 2>&1
echo "== $AB_TAG rc=$?"; grep -E "^ +2 +4096 +HT|torch gather|receive pool|^test" $W/ht_$AB_TAG.log | grep -v default
grep -E "^profile" $W/ht_$AB_TAG.log | grep -oE "rank [01], [a-z0-9 ]+|host [0-9.]+|gap [0-9.]+|kernel [0-9.]+|notify [0-9.]+|send.first [0-9.]+" | paste -sd' ' | sed 's/rank/\nrank/g'
