#!/usr/bin/env bash
# The GPU gate. Run it on the H200 machine (the device tool's `run`) before any change to gpunet/device/ or
# gpunet/host/platform.py lands:   bash scripts/gpu-check.sh        (OUT=dir keeps the logs and JSON there)
#
# It installs gpunet (editable, no deps: the image has torch, numba, nvcc), runs every CUDA test
# (a test skipped for want of a GPU or CUDA counts as a failure here), the GPU benchmarks and the
# worked example, and prints one table. Rows of kind "test" gate: the last line says PASS only when
# all of them passed. Rows of kind "target" report a performance target (met / NOT met, with the
# median and spread of the runs); they are listed, and counted in the last line, but a missed
# target does not fail the gate (performance is judged from bench/RESULTS.md, not from one run).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export GATE_ROWS="$OUT/gate_rows.jsonl" PYTHONUNBUFFERED=1
: > "$GATE_ROWS"
step() { echo; echo "=== $* ===  ($(date +%T))"; }
# GATE_STEPS="tests proxy post order ep ep-ht doctor" (default: all) picks steps, to split the gate across calls
# of at most 10 minutes; the table then covers the steps run. PROXY_CPU_ARGS: extra bench/proxy.py
# arguments for the CPU drain row (e.g. "--threads 1 --diag"); EP_RANKS / EP_TRANSPORTS narrow the
# ep step (bench/ep_gpu.sh).
want() { [ -z "${GATE_STEPS:-}" ] || [[ " $GATE_STEPS " == *" $1 "* ]]; }
gate() { python3 scripts/gate.py "$@"; }

step "install"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  && gate row test install PASS "pip install --no-deps -e ." \
  || { tail -20 "$OUT/install.log"; gate row test install FAIL "see install.log"; }
nvidia-smi -L

step "warm-up: the CUDA libraries compiled in parallel (scripts/gpu_warm.py)"
# (every later step loads the cached builds instead of compiling them one after another: a fresh
# machine each call; 79 s serially on 2 cores)
python3 scripts/gpu_warm.py > "$OUT/warmup.log" 2>&1 \
  && { grep "warm-up" "$OUT/warmup.log"; gate row test warm-up PASS "$(grep -o 'CUDA libraries built.*' "$OUT/warmup.log" | cut -c1-200)"; } \
  || { tail -20 "$OUT/warmup.log"; gate row test warm-up FAIL "see warmup.log"; }

if want tests; then
step "CUDA tests"
# Every test file that exercises the CUDA arm (the *_cuda.py files, the platform probes, the
# worked examples); the CPU-only tests run in CI, not here. 194 s on 2026-12-02 before the 4-rank
# worlds were added; run this step alone in a call (GATE_STEPS=tests).
CUDA_TESTS=$(ls tests/test_*cuda*.py tests/test_platform.py tests/test_examples.py 2>/dev/null)
# Every test's name and outcome go to $OUT/cuda_tests.log as they finish (-v), with the 15
# slowest at the end: a step cut off by the call's limit still says which test was running.
timeout 480 python3 -m pytest -v -rs --durations=15 --junitxml="$OUT/cuda_tests.xml" $CUDA_TESTS \
    > "$OUT/cuda_tests.log" 2>&1
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/cuda_tests.log" | tail -15
awk '/slowest 15 durations/ {f = 1; print; next} /^=/ {f = 0} f' "$OUT/cuda_tests.log"
gate junit "CUDA tests" "$OUT/cuda_tests.xml"
fi

if want proxy; then
step "proxy: GPU -> proxy -> soft NIC round trip (3 runs)"
timeout 240 python3 bench/proxy.py --gpu --reps 3 --json "$OUT/proxy_gpu.json" 2>&1 | tail -12
gate proxy_gpu "$OUT/proxy_gpu.json"
fi

if want proxy; then
step "proxy: commands per second per proxy thread (this host's CPU, GPU-fed shape)"
timeout 240 python3 bench/proxy.py ${PROXY_CPU_ARGS:-} --json "$OUT/proxy_cpu.json" 2>&1 | tail -24
gate proxy_cpu "$OUT/proxy_cpu.json"
fi

if want post; then
step "device post rate (sink consumer, collapsed CQ, post_warp: one WQE per lane)"
timeout 300 python3 bench/device_post.py --cq collapsed --qps 1,32 --warps 1,32,132,264 --post-modes batched,serial \
    --skip store,e2e,ordering --repeat 3 --json "$OUT/device_post.json" > "$OUT/device_post.log" 2>&1
tail -14 "$OUT/device_post.log"
gate device_post "$OUT/device_post.json"
fi

if want order; then
step "GPU ordering schedules and end-to-end posts through the soft NIC (correctness)"
timeout 300 python3 bench/device_post.py --skip store,sink --seeds 1 --json "$OUT/device_order.json" \
    > "$OUT/device_order.log" 2>&1
tail -12 "$OUT/device_order.log"
gate device_post "$OUT/device_order.json"
fi

if want ep && [ -f bench/ep_gpu.sh ]; then
  step "MoE EP low-latency dispatch / combine (2 and 4 ranks on one GPU under MPS)"
  OUT="$OUT" timeout 540 bash bench/ep_gpu.sh 2>&1 | tail -30
  gate ep "$OUT"
fi

if want ep-ht && [ -f bench/ep_gpu.sh ]; then
  step "MoE EP high-throughput dispatch / combine (2 ranks on one GPU under MPS; bench/ep_ht.py)"
  mkdir -p "$OUT/ht"
  OUT="$OUT/ht" EP_BENCH_PREFIX=ep_ht_gpu EP_BENCH_ARGS="--mode ht --ranks 2" timeout 540 bash bench/ep_gpu.sh 2>&1 | tail -30
  gate ep "$OUT/ht"
fi

if want doctor; then
step "doctor: python -m gpunet doctor (the table a machine's owner sees; JSON in doctor.json)"
timeout 420 python3 -m gpunet doctor --json "$OUT/doctor.json" 2> "$OUT/doctor.log"
gate doctor "$OUT/doctor.json"
fi

if want p2p; then
  step "p2p: put bandwidth vs cudaMemcpyAsync, put_signal ping-pong (2 ranks on one GPU, private MPS)"
  timeout 540 python3 bench/p2p.py --gpu --runs 3 --json "$OUT/p2p_gpu.json" 2>&1 | tail -25
  gate p2p "$OUT/p2p_gpu.json"
fi

# ep-prof runs only when GATE_STEPS names it (a diagnosis, not a gate row): where the EP LL time
# goes, per phase, host vs kernel (bench/ep_profile.py via bench/ep_gpu.sh profile)
if [[ " ${GATE_STEPS:-} " == *" ep-prof "* ]] && [ -f bench/ep_profile.py ]; then
  step "MoE EP low-latency profile (2 ranks on one GPU under MPS: p2p, soft NIC)"
  OUT="$OUT" timeout 580 bash bench/ep_gpu.sh profile 2>&1 | grep -v '^\[INFO\]' | tail -120
fi

step "summary"
gate table
