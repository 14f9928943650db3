#!/usr/bin/env bash
# bench/ep.py on the GPU machine: 2 and 4 ranks sharing GPU 0 under a private MPS daemon (without
# MPS the driver time-slices the rank processes: a cross-process round trip took 4.5 ms instead of
# 0.73 us, FACTS.md), then, when the machine has 2+ GPUs, one rank per GPU with the NCCL rows.
#
#   bash bench/ep_gpu.sh                 (OUT=dir: where the JSON / PNG / logs go; default bench/out)
#   bash bench/ep_gpu.sh profile         bench/ep_profile.py instead (per-phase times, host vs
#                                        kernel): 2 ranks over p2p, then over the soft NIC (ibgda); extra
#                                        arguments in EP_PROFILE_ARGS (e.g. "--blocks 64")
#
# Each 1-GPU run gets its own private MPS daemon (python3 -m gpunet.device.testing.mps --: fresh
# pipe and log folders, stopped when the command ends, whatever happens; it changes no GPU
# setting; a daemon that does not start fails the run instead of timing time-sliced ranks). The
# JSON files also land in bench/results/<date>/.
# scripts/gpu-check.sh runs this and reads the "gate" rows of $OUT/ep_*.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
DATE=$(date +%F)
RES=bench/results/$DATE
mkdir -p "$RES"
EXTRA=${EP_BENCH_ARGS:-}            # e.g. "--sweep 128 --iters 20" for a quicker run, "--mode ht"
PREFIX=${EP_BENCH_PREFIX:-ep_gpu}    # file names: $OUT/${PREFIX}_1gpu.json ... (ep_ht_gpu for --mode ht)
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${NGPU:-0}" -lt 1 ]; then
  echo "bench/ep_gpu.sh needs an NVIDIA GPU (nvidia-smi lists none)" >&2
  exit 2
fi
rc=0

# --- ranks sharing one GPU, each run under a private MPS daemon ---------------------------------
MPSRUN="python3 -m gpunet.device.testing.mps --"
MPS="MPS (private daemon per run)"
if [ "${1:-}" = "profile" ]; then
  PARGS=${EP_PROFILE_ARGS:-}
  # p2p: the default grid and 32 blocks (the default before ll_grid), each rank's stream held
  # before every timed call so the ranks start together (--hold-us); then the soft NIC, default
  # grid (ibgda by name: "auto" on CUDA is p2p between ranks of one node)
  for run in "p2p 320 --blocks 0,32 --hold-us 300" "ibgda 220"; do
    set -- $run
    tr=$1 lim=$2
    shift 2
    echo "=== EP profile: 2 ranks on GPU 0, transport $tr, $MPS ==="
    CUDA_VISIBLE_DEVICES=0 $MPSRUN timeout $lim python3 bench/ep_profile.py --gpu --ranks 2 --transport $tr \
        "$@" $PARGS --json "$OUT/ep_profile_$tr.json" 2>&1 | tee "$OUT/ep_profile_$tr.log"
    rc=$(( rc | ${PIPESTATUS[0]} ))
  done
  cp "$OUT"/ep_profile_*.json "$RES"/ 2>/dev/null || true
  exit $rc
fi
# EP_RANKS (default 2,4) and EP_TRANSPORTS (default "ibgda p2p") narrow the 1-GPU runs, e.g. for
# a gate call with little device time left: EP_RANKS=2 EP_TRANSPORTS=p2p
RANKS=${EP_RANKS:-2,4}
for tr in ${EP_TRANSPORTS:-ibgda p2p}; do
  # ibgda: the soft NIC, asked for by name ("auto" on CUDA is p2p between ranks of one node); the
  # heaps are device memory, which its engine copies through the CUDA runtime; p2p: the heaps
  # opened by CUDA IPC, the kernels store into the peers'. File names: the soft NIC's have no
  # suffix (ep_gpu_1gpu.json), the others end in _<transport>.
  sfx=$([ "$tr" = ibgda ] && echo "" || echo "_$tr")
  echo "=== EP bench: ranks $RANKS on GPU 0, transport $tr, $MPS ==="
  CUDA_VISIBLE_DEVICES=0 $MPSRUN python3 bench/ep.py --gpu --ranks "$RANKS" --transport "$tr" $EXTRA \
      --json "$OUT/${PREFIX}_1gpu$sfx.json" --plot "$OUT/${PREFIX}_1gpu$sfx.png" 2>&1 \
      | tee "$OUT/${PREFIX}_1gpu$sfx.log"
  rc=$(( rc | ${PIPESTATUS[0]} ))
done

# --- one rank per GPU, with NCCL all_to_all_single in the same run --------------------------------
if [ "$NGPU" -ge 2 ]; then
  echo "=== EP bench: $NGPU ranks, one per GPU, over the soft NIC (ibgda), NCCL rows ==="
  python3 bench/ep.py --gpu --ranks "$NGPU" --transport ibgda $EXTRA \
      --json "$OUT/${PREFIX}_${NGPU}gpu.json" --plot "$OUT/${PREFIX}_${NGPU}gpu.png" 2>&1 \
      | tee "$OUT/${PREFIX}_${NGPU}gpu.log"
  rc=$(( rc | ${PIPESTATUS[0]} ))
  echo "=== EP bench: $NGPU ranks, one per GPU, over p2p (CUDA IPC, peer access) ==="
  python3 bench/ep.py --gpu --ranks "$NGPU" --transport p2p $EXTRA \
      --json "$OUT/${PREFIX}_${NGPU}gpu_p2p.json" --plot "$OUT/${PREFIX}_${NGPU}gpu_p2p.png" 2>&1 \
      | tee "$OUT/${PREFIX}_${NGPU}gpu_p2p.log"
  rc=$(( rc | ${PIPESTATUS[0]} ))
fi

cp "$OUT"/${PREFIX}_*.json "$OUT"/${PREFIX}_*.png "$RES"/ 2>/dev/null || true
echo "EP bench JSON: $OUT/${PREFIX}_*.json (copied to $RES)"
exit $rc
