CUDA_VISIBLE_DEVICES=0 timeout 60 python3 -m gpunet.device.testing.mps -- \
  python3 bench/ep.py --gpu --ranks 2 --transport p2p --mode ht --ht-configs 64:48:128:16 \
  --json $W/ht_$AB_TAG.json > $W/ht_$AB_TAG.log 2>&1
echo "rc=$?"; grep -E "^ +2 +4096 +HT|torch gather" $W/ht_$AB_TAG.log
grep -E "^profile.*dispatch bf16 \(" $W/ht_$AB_TAG.log | grep -oE "rank [01]|send.move [0-9.]+|recv.move [0-9.]+|recv.idle [0-9.]+|kernel [0-9.]+|host [0-9.]+|gap [0-9.]+" | paste -sd' '
grep -E "^profile.*combine bf16 \(" $W/ht_$AB_TAG.log | grep -oE "rank [01]|host [0-9.]+|kernel [0-9.]+" | paste -sd' '
