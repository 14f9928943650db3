"""The host's share of one gpunet.ep low-latency call, measured on the CPU: the Python between the
caller and the kernel launch (argument checks, output allocation, the launch arguments, the
failure check), with the kernel launch itself replaced by a call that returns at once.

Why on the CPU: that Python is the same on the CPU and the CUDA platform apart from the stream
lookup and the allocator (the H200 profile, bench/RESULTS.md, had 54-114 us of host time per call,
in every event figure whose GPU waited for the launch). The kernel does not run, so the outputs
hold garbage: this measures time only.

Usage: python bench/ep_host.py [--iters 2000] [--tokens 128] [--hidden 7168] [--experts 8]
           [--topk 8] [--profile] [--json PATH]
Prints per-op medians (us per call) of perf_counter_ns around the call, and with --profile the
functions with the most own time (cProfile).
"""
import argparse
import cProfile
import ctypes
import json
import pstats
import statistics
import sys
import time
from pathlib import Path


class _NoLaunch:
    """The Buffer's kernel library, with the LL launch answering 0 at once (everything else as is)."""

    def __init__(self, lib):
        self._lib = lib

    def gpunet_ep_ll_launch(self, *args):
        return 0

    def __getattr__(self, name):
        return getattr(self._lib, name)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    import torch
    from gpunet.ep import Buffer
    from gpunet.ep import reference as ref

    T, H, E, K = a.tokens, a.hidden, a.experts, min(a.topk, a.experts)
    buf = Buffer(None, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(T, H, 1, E),
                 low_latency_mode=True, explicitly_destroy=True, timeout_s=10.0)
    try:
        inp = ref.make_rank_inputs(1, T, H, K, E, seed=1, holes=4)[0]
        x, tk, w = inp["x"], inp["topk_idx"], inp["topk_weights"]
        handle = buf.low_latency_dispatch(x, tk, T, E, use_fp8=False)[2]   # a real one, to combine
        y = torch.zeros(E, T, H, dtype=torch.bfloat16)
        buf._lib = _NoLaunch(buf._lib)
        ops = {
            "dispatch bf16": lambda: buf.low_latency_dispatch(x, tk, T, E, use_fp8=False),
            "dispatch fp8": lambda: buf.low_latency_dispatch(x, tk, T, E, use_fp8=True),
            "combine bf16": lambda: buf.low_latency_combine(y, tk, w, handle),
        }
        out = {"what": "gpunet.ep LL host time per call, kernel launch skipped (CPU)",
               "config": vars(a), "median_us": {}, "profile": {}}
        for name, fn in ops.items():
            for _ in range(50):
                fn()
            ts = []
            for _ in range(a.iters):
                t0 = time.perf_counter_ns()
                fn()
                ts.append(time.perf_counter_ns() - t0)
            out["median_us"][name] = statistics.median(ts) / 1e3
            if a.profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(a.iters):
                    fn()
                prof.disable()
                rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:10]
                out["profile"][name] = [
                    ("%s:%d(%s)" % (Path(k[0]).name, k[1], k[2]), v[1] / a.iters, v[2] / a.iters * 1e6)
                    for k, v in rows]
        for name, us in out["median_us"].items():
            print("%-14s %8.2f us per call" % (name, us))
            for fn_name, calls, own in out["profile"].get(name, []):
                print("    %-60s %5.1f calls %7.2f us own" % (fn_name[:60], calls, own))
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
    finally:
        buf.destroy()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
