#!/usr/bin/env bash
# session 35, call 2 (what the budget left allows): the HT CUDA pool test on main 6e8c9e8 (its
# repeated round asserts that the dispatch's data phase was prelaunched behind the notify and ran)
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT/g
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 180 python3 -m pytest -q tests/test_ep_ht_cuda.py -k pool > $OUT/g/ht_cuda.log 2>&1; echo "ht cuda tests rc=$?"
tail -3 $OUT/g/ht_cuda.log
