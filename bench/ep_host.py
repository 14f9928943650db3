"""The host's share of one gpunet.ep call: the Python between the caller and the kernel launch
(argument checks, output allocation, the launch arguments, the failure check), with the kernel
launch itself replaced by a call that returns at once.

``--mode ll`` (default) times the low-latency calls, ``--mode ht`` the high-throughput ones
(dispatch BF16 / FP8 / with num_worst_tokens, combine; the dispatch's notify answers with the
counts of one real call made first, so its host wait for the notify kernel is not in the figure).
A world of one rank. ``--gpu``: on this process's CUDA device (the allocator and the stream lookup
are CUDA's), else on the CPU, where the Python is the same apart from those (the H200 profile,
bench/RESULTS.md, had 54-114 us of host time per LL call, in every event figure whose GPU waited
for the launch; the H100's HT profiles 85-190 us). The kernels do not run after the first call,
so the outputs hold garbage: this measures time only.

Usage: python bench/ep_host.py [--mode ll|ht] [--gpu] [--iters N] [--tokens T] [--hidden H]
           [--experts E] [--topk K] [--profile] [--json PATH]
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

import ep_ht            # bench/ep_ht.py (this script's directory is on sys.path)


class _NoLaunch:
    """The Buffer's kernel library, with the LL and HT launches answering 0 at once (everything
    else as is)."""

    def __init__(self, lib):
        self._lib = lib

    def gpunet_ep_ll_launch(self, *args):
        return 0

    def gpunet_ep_ht_launch(self, *args):
        return 0

    def __getattr__(self, name):
        return getattr(self._lib, name)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("ll", "ht"), default="ll")
    ap.add_argument("--gpu", action="store_true", help="on the CUDA device (default: the CPU)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per op (ll 2000, ht 500)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per rank (ll 128, ht 4096; "
                    "ht on the CPU 256)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=None, help="ll 8, ht 256")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--recv-pool-mib", type=int, default=0,
                    help="ht: the Buffer's receive pool in MiB (0: none); the dispatch's receive "
                         "tensors then come from it")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    ht = a.mode == "ht"
    a.iters = a.iters or (500 if ht else 2000)
    a.tokens = a.tokens or ((4096 if a.gpu else 256) if ht else 128)
    a.experts = a.experts or (256 if ht else 8)

    import torch

    dev = "cuda" if a.gpu else "cpu"
    if a.gpu:
        torch.cuda.set_device(0)
    buf = _ht_buffer(a) if ht else _ll_buffer(a)
    try:
        ops = (_ht_ops if ht else _ll_ops)(buf, a, dev)
        out = {"what": "gpunet.ep %s host time per call, kernel launch skipped (%s)"
                       % (a.mode.upper(), "CUDA" if a.gpu else "CPU"),
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
            print("%-24s %8.2f us per call" % (name, us))
            for fn_name, calls, own in out["profile"].get(name, []):
                print("    %-60s %5.1f calls %7.2f us own" % (fn_name[:60], calls, own))
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
    finally:
        buf.destroy()


def _ll_buffer(a):
    from gpunet.ep import Buffer
    return Buffer(None, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(a.tokens, a.hidden, 1, a.experts),
                  low_latency_mode=True, explicitly_destroy=True, timeout_s=10.0)


def _ht_buffer(a):
    from gpunet.ep import Buffer, Config
    return Buffer(None, num_nvl_bytes=Config(*HT_CONFIG).get_nvl_buffer_size_hint(a.hidden * 2, 1),
                  explicitly_destroy=True, timeout_s=10.0, recv_pool_bytes=a.recv_pool_mib << 20)


# the HT Config timed: the first of bench/ep_ht.py's GPU sweep (its best on the H100)
HT_CONFIG = ep_ht.GPU_CONFIGS[0][:3]


def _inputs(a, dev):
    from gpunet.ep import reference as ref
    inp = ref.make_rank_inputs(1, a.tokens, a.hidden, min(a.topk, a.experts), a.experts, seed=1, holes=4)[0]
    return inp["x"].to(dev), inp["topk_idx"].to(dev), inp["topk_weights"].to(dev)


def _ll_ops(buf, a, dev):
    import torch
    T, H, E = a.tokens, a.hidden, a.experts
    x, tk, w = _inputs(a, dev)
    handle = buf.low_latency_dispatch(x, tk, T, E, use_fp8=False)[2]   # a real one, to combine
    y = torch.zeros(E, T, H, dtype=torch.bfloat16, device=dev)
    buf._lib = _NoLaunch(buf._lib)
    return {
        "dispatch bf16": lambda: buf.low_latency_dispatch(x, tk, T, E, use_fp8=False),
        "dispatch fp8": lambda: buf.low_latency_dispatch(x, tk, T, E, use_fp8=True),
        "combine bf16": lambda: buf.low_latency_combine(y, tk, w, handle),
    }


def _ht_ops(buf, a, dev):
    from gpunet.ep import Config
    from gpunet.ep import reference as ref
    x, tk, w = _inputs(a, dev)
    xq = tuple(t.to(dev) for t in ref.per_token_cast_to_fp8(x.cpu()))
    cfg = Config(*HT_CONFIG)
    _, _, ntpe, in_rank, _ = buf.get_dispatch_layout(tk, a.experts)
    kw = dict(is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=tk, topk_weights=w, config=cfg)
    notify = buf._ht_notify
    answers = []

    def first_notify(*args, **kw):       # the real call's counts, kept for the timed calls
        got = notify(*args, **kw)
        answers.append(got[0])
        return got

    def timed_notify(*args, meanwhile=None):   # its host work (the receive tensors' guess) stays
        return answers[0], meanwhile() if meanwhile is not None else None
    buf._ht_notify = first_notify
    y, _, _, _, handle, _ = buf.dispatch(x, **kw)
    if a.gpu:
        import torch
        torch.cuda.synchronize()
    buf._ht_notify = timed_notify
    buf._ht_lib = _NoLaunch(buf._ht_lib)
    worst = a.tokens
    return {
        "ht dispatch bf16": lambda: buf.dispatch(x, **kw),
        "ht dispatch fp8": lambda: buf.dispatch(xq, **kw),
        "ht dispatch bf16 worst": lambda: buf.dispatch(x, num_worst_tokens=worst, **kw),
        "ht combine bf16": lambda: buf.combine(y, handle, config=cfg),
    }


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
