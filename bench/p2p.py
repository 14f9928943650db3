"""Benchmark of the p2p transport: put bandwidth next to a plain copy of the same bytes, and the
put_signal ping-pong round trip between two ranks.

GPU (--gpu, the H200 machine): 2 rank processes share GPU 0 under a private MPS daemon
(gpunet.device.testing.mps; without MPS the driver time-slices them, FACTS.md) with
transport="p2p": device-memory heaps opened by CUDA IPC, the kernels store into the peer's heap.
- put bandwidth: rank 0's ``gpunet.put`` of n bytes (4 KiB .. 256 MiB) into rank 1's heap, next to
  ``cudaMemcpyAsync`` device-to-device of the same n bytes between the same two addresses (rank
  1's heap as mapped in rank 0), in the same run, timed the same way: CUDA events around a batch of
  back-to-back calls all queued while ``torch.cuda._sleep`` holds the stream, so both figures are
  GPU stream time, not Python issue time (a batch whose start event had already passed when the
  host finished queuing is retried with a longer hold; "held" in the JSON says it worked).
  ratio = put GB/s / memcpy GB/s; target (issue 9): >= 0.85 from 1 MiB up.
- ping-pong: gpunet/device/testing/kernels/p2p_bench.cu on both ranks, one thread each: put_signal_nbi
  (8 bytes, SET) and wait_until, timed inside the kernel (%globaltimer) over ``--pp-iters`` round
  trips after a warm-up. Target: <= 2 us a round trip (a plain CUDA IPC flag ping-pong measured
  0.73 us, FACTS.md). Mode 8 (the verbs on the kernel's copy of the DevCtx, the peer named by a
  PeerRef taken once: what a kernel that waits and puts in a loop writes) is the figure; the
  other modes (PP_MODES: the same verbs naming the peer by number, on the DevCtx pointer, and raw
  stores / polls with no verb) run in the same run beside it, to say where the time goes.
- copy sweep (GPU): ops.cu k_put_p2p at 1, 2, 4, 8, 16 and 64 MiB with the variants and geometries of
  SWEEP (16-byte loads in flight per thread, weak or volatile stores, bytes and threads per
  block), timed as the put rows; gpunet.put uses _launch.bulk_tier and bulk_geometry (the size tiers).
- NIC peer cost: put + quiet from the host at 4 KiB and 1 MiB over p2p, then in a second world
  over transport='ibgda' (the soft NIC; on CUDA its engine moves the device-memory heap's bytes
  with the CUDA runtime, as a NIC's DMA over GPUDirect would): the JSON's nic_put_quiet.
- correctness: before the timing rank 0 puts its pattern into rank 1's zeroed buffer through the
  API (one bulk put of the largest size) and rank 1 checks every byte (a "test" row).
Each figure is the median of ``--runs`` (>= 3) runs, with the min and max of the run figures.

CPU (default, small: what tests/test_bench_scripts.py runs): the same flow on the HOST arm over
the soft NIC's arenas, 4 KiB .. 1 MiB, ``ctypes.memmove`` as the copy beside the put, perf_counter
timing. These figures show the machinery, not a GPU.

Prints a table, writes JSON (rows, gate rows for scripts/gate.py, the machine).
Usage: python bench/p2p.py [--gpu] [--runs 3] [--max-mib 256] [--pp-iters N] [--json PATH]
"""
import argparse
import ctypes
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))        # bench/machine.py

from machine import machine  # noqa: E402

TARGET_RATIO = 0.85          # issue 9: put >= 85% of cudaMemcpyAsync from 1 MiB up
TARGET_RATIO_FROM = 1 << 20
TARGET_RTT_US = 2.0          # issue 9: put_signal ping-pong round trip
MEMCPY_D2D = 3               # cudaMemcpyDeviceToDevice
RANK_TIMEOUT_S = 900
# gpunet/device/testing/kernels/p2p_bench.cu's modes; TARGET_MODE is the figure held to TARGET_RTT_US.
PP_MODES = {0: "verbs", 1: "verbs, DevCtx by pointer", 2: "raw: acquire poll",
            3: "raw: relaxed poll + acquire", 4: "raw: acquire poll + pause",
            5: "put_signal verb, raw wait", 6: "raw send, wait_until verb",
            7: "verbs, source + PeerDesc prefetched", 8: "verbs, PeerRef held",
            9: "raw: acquire.gpu poll", 10: "raw: signal only, relaxed (floor)",
            11: "raw: fence.acq_rel.gpu, acquire.gpu", 12: "PeerRef send, acquire.gpu wait"}
TARGET_MODE = 8
# The copy sweep (GPU): ops.cu k_put_p2p at a few sizes with other variants and geometries than
# gpunet.put's (gpunet/_launch.py BULK_TIERS_GPU, bulk_geometry): (name, variant, bytes per
# block, blocks per SM, threads per block); variant bit 0: Unroll 8, bit 1: weak stores.
SWEEP = [("u4 volatile 16K/256", 0, 16 << 10, 4, 256),
         ("u8 volatile 32K/256", 1, 32 << 10, 4, 256),
         ("u4 weak 16K/256", 2, 16 << 10, 4, 256),
         ("u8 weak 16K/256", 3, 16 << 10, 4, 256),
         ("u8 weak 32K/256", 3, 32 << 10, 4, 256),
         ("u8 weak 32K/256 x8/SM", 3, 32 << 10, 8, 256),
         ("u8 weak 64K/512", 3, 64 << 10, 4, 512),
         ("u8 weak 8K/256 x8/SM", 3, 8 << 10, 8, 256),
         ("u4 weak 8K/256 x8/SM", 2, 8 << 10, 8, 256),
         ("u4 weak 4K/256 x8/SM", 2, 4 << 10, 8, 256),
         ("u4 weak 4K/128 x16/SM", 2, 4 << 10, 16, 128)]
PARTS = ("sweep", "profile", "nic", "pingpong")   # --skip: the optional parts of a run
SWEEP_SIZES = [1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20, 64 << 20]
HOLD_GPU_HZ = 2.0e9          # cycles per second assumed for torch.cuda._sleep (an upper bound:
                             # a slower clock only holds the stream longer)


def _sizes(max_bytes, min_bytes=4096):
    out, n = [], min_bytes
    while n <= max_bytes:
        out.append(n)
        n *= 4 if n < (1 << 20) else 2
    if out[-1] != max_bytes:
        out.append(max_bytes)
    return out


def _iters(n, gpu):
    """Calls per timed batch: enough bytes that a batch takes well over the timer's resolution."""
    if gpu:
        return max(5, min(200, (256 << 20) // n))
    return max(3, min(50, (8 << 20) // n))


# ---------------------------------------------------------------------------------------------
# rank side

def _memcpy_async(gpu):
    """f(dst, src, n): cudaMemcpyAsync device-to-device on torch's current stream (GPU), or
    ctypes.memmove (CPU)."""
    if not gpu:
        return lambda dst, src, n: ctypes.memmove(dst, src, n)
    import torch

    from gpunet.host.platform import get_platform
    fn = get_platform().runtime().lib.cudaMemcpyAsync
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int

    def copy(dst, src, n):
        rc = fn(dst, src, n, MEMCPY_D2D, torch.cuda.current_stream().cuda_stream)
        if rc != 0:
            raise RuntimeError("cudaMemcpyAsync failed with cudaError %d" % rc)
    return copy


def _time_batch(ctx, fn, iters, gpu):
    """Seconds per call of ``fn`` over a batch of ``iters`` (GPU: stream time of a batch queued
    while the stream was held); returns (seconds, held, host seconds per call to queue it)."""
    import torch

    if not gpu:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        ctx.quiet()
        dt = (time.perf_counter() - t0) / iters
        return dt, True, dt
    ctx.quiet()                       # every earlier launch done: the ops ring is empty
    hold = 0.002
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda._sleep(int(hold * HOLD_GPU_HZ))
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t1 = time.perf_counter()
        for _ in range(iters):
            fn()
        queue = (time.perf_counter() - t1) / iters
        e1.record()
        held = not e0.query()         # the stream had not reached e0 when queuing finished
        issue = time.perf_counter() - t0
        e1.synchronize()
        ctx.quiet()
        if held:
            return e0.elapsed_time(e1) * 1e-3 / iters, True, queue
        hold = max(2 * hold, 3 * issue)
    return e0.elapsed_time(e1) * 1e-3 / iters, False, queue


def _bandwidth_rows(ctx, src, dst, dst_mapped, cfg):
    import gpunet

    gpu = cfg["gpu"]
    copy = _memcpy_async(gpu)
    remote = ctx.remote(1, dst)
    rows = []
    for n in cfg["sizes"]:
        it = _iters(n, gpu)
        def put(n=n):
            gpunet.put(remote, src[:n])

        def mem(n=n):
            copy(dst_mapped, src.data_ptr(), n)

        put(), mem()                                            # warm-up (first launch, ring)
        ctx.quiet()
        runs = []
        for r in range(cfg["runs"]):
            order = (put, mem) if r % 2 == 0 else (mem, put)    # alternate which goes first
            t = {}
            for fn in order:
                t[fn] = _time_batch(ctx, fn, it, gpu)
            runs.append({"put_s": t[put][0], "memcpy_s": t[mem][0],
                         "held": bool(t[put][1] and t[mem][1]),
                         "put_host_s": t[put][2], "memcpy_host_s": t[mem][2]})
        rows.append({"bytes": n, "iters": it, "runs": runs,
                     "bulk_geometry": ctx._launcher.bulk("p2p", n)})
    return rows


def _profile_put(ctx, src, dst, n=4096, calls=2000):
    """cProfile of ``calls`` gpunet.put of ``n`` bytes (the host side: Python, the ctypes launch;
    the GPU runs them as they come): the top functions by own time, as text lines."""
    import cProfile
    import io
    import pstats

    import gpunet

    remote = ctx.remote(1, dst)
    part = src[:n]
    gpunet.put(remote, part)
    ctx.quiet()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(calls):
        gpunet.put(remote, part)
    prof.disable()
    dt = time.perf_counter() - t0
    ctx.quiet()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
    lines = [x for x in buf.getvalue().splitlines() if x.strip()]
    return {"bytes": n, "calls": calls, "us_per_call_profiled": dt / calls * 1e6,
            "top": lines[-14:]}


def _sweep_rows(ctx, src, dst_mapped, cfg):
    """GPU: ops.cu k_put_p2p of SWEEP_SIZES bytes from ``src`` to ``dst_mapped`` with each SWEEP
    variant and geometry, timed as the bandwidth rows are (stream time, held)."""
    import torch

    from gpunet._launch import bulk_geometry

    lib = ctx._launcher.lib
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    rows = []
    for n in [x for x in SWEEP_SIZES if x <= max(cfg["sizes"])]:
        it = _iters(n, True)
        for name, variant, per_block, per_sm, block in SWEEP:
            grid, block, chunk = bulk_geometry(n, True, 32, sms, per_block, per_sm, block)

            def put(grid=grid, block=block, chunk=chunk, variant=variant, n=n):
                rc = lib.gpunet_put_p2p_launch(grid, block, 32, dst_mapped, src.data_ptr(), n,
                                               chunk, variant,
                                               torch.cuda.current_stream().cuda_stream, 0)
                if rc != 0:
                    raise RuntimeError("k_put_p2p launch failed (%d)" % rc)
            put()
            ctx.quiet()
            ts = [_time_batch(ctx, put, it, True) for _ in range(cfg["runs"])]
            rows.append({"bytes": n, "name": name, "variant": variant, "grid": grid,
                         "block": block, "chunk": chunk, "held": all(t[1] for t in ts),
                         "put_us": statistics.median(t[0] for t in ts) * 1e6,
                         "put_us_runs": [t[0] * 1e6 for t in ts]})
    return rows


def _pingpong(ctx, cfg):
    import torch

    from gpunet.device import loader, testing

    gpu = cfg["gpu"]
    lib = loader.build([testing.kernels_dir() / "p2p_bench.cu"], arch="cuda" if gpu else "host")
    f = lib.gpunet_bench_pingpong
    u32, u64, vp = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
    f.argtypes = [u32, vp, vp, vp, u64, u32, u32, u32, ctypes.c_int32, u32, u32, vp, vp]
    f.restype = ctypes.c_int
    buf = ctx.alloc((64,), torch.uint8)
    sig = ctx.alloc((2,), torch.int64)
    out = torch.zeros(3, dtype=torch.int64, device="cuda" if gpu else "cpu")
    h = ctx.device_context()
    me = ctx.rank
    iters, warmup = cfg["pp_iters"], cfg["pp_warmup"]
    runs, base = {m: [] for m in cfg["pp_modes"]}, 0
    try:
        for _ in range(cfg["runs"]):
            for mode in cfg["pp_modes"]:          # every mode in each run: same conditions
                ctx.barrier()
                rc = f(h.warp_size, h.ptr, buf.data_ptr(), sig.data_ptr(), base, iters + warmup,
                       warmup, 8, 1 - me, 1 if me == 0 else 0, mode, out.data_ptr(),
                       h.stream or None)
                if rc != 0:
                    raise RuntimeError("ping-pong kernel (%s) launch failed (%d)" % (PP_MODES[mode], rc))
                ctx.check("ping-pong kernel (%s)" % PP_MODES[mode])
                ns, n, ok = (int(v) for v in out.cpu())
                if not ok:
                    raise RuntimeError("ping-pong kernel (%s): a call returned false without a "
                                       "recorded failure" % PP_MODES[mode])
                if me == 0:
                    runs[mode].append(ns / n / 1000.0)
                base += iters + warmup
        ctx.barrier()
    finally:
        ctx.free(sig)
        ctx.free(buf)
    return runs


NIC_SIZES = (4096, 1 << 20)   # put + quiet latency rows: p2p against a NIC peer (the soft NIC)
NIC_ITERS = {True: 200, False: 20}


def _put_quiet_us(ctx, src, dst, n, iters):
    """Rank 0: median us of ``iters`` blocking put + quiet of ``n`` bytes to rank 1 (what a NIC
    peer's copy engine costs next to p2p's stores)."""
    import gpunet

    ts = []
    for _ in range(iters + 2):
        t0 = time.perf_counter()
        gpunet.put(ctx.remote(1, dst[:n]), src[:n])
        ctx.quiet()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[2:]) * 1e6


def _nic_rows(rank, cfg, p2p_us):
    """The same put + quiet over transport='ibgda' (the soft NIC; on CUDA its engine moves the
    device-memory heap's bytes with the CUDA runtime, as a NIC's DMA would), next to ``p2p_us``
    (size -> us over p2p, this run). Rows on rank 0; every rank takes part."""
    import torch

    import gpunet

    ctx = gpunet.init(transport="ibgda", nic="soft", heap_bytes=2 * max(NIC_SIZES) + (8 << 20),
                      timeout_s=cfg["timeout_s"])
    try:
        src = ctx.alloc((max(NIC_SIZES),), torch.uint8)
        dst = ctx.alloc((max(NIC_SIZES),), torch.uint8)
        src.fill_(rank + 1)
        ctx.barrier()
        rows = []
        if rank == 0:
            heap = ("device-memory" if ctx._device_heap else "host-mapped") if cfg["gpu"] \
                else "shared-memory arena"
            for n in NIC_SIZES:
                us = _put_quiet_us(ctx, src, dst, n, NIC_ITERS[cfg["gpu"]])
                rows.append({"bytes": n, "ibgda_us": us, "p2p_us": p2p_us.get(n), "heap": heap})
        ctx.barrier()
        return rows
    finally:
        ctx.close()


def _rank(rank, world, cfg):
    import torch
    import torch.distributed as dist

    import gpunet

    gpu = cfg["gpu"]
    if gpu:
        torch.cuda.set_device(0)
    maxn = max(cfg["sizes"])
    ctx = gpunet.init(transport="p2p", nic="soft", heap_bytes=2 * maxn + (8 << 20),
                      timeout_s=cfg["timeout_s"])
    try:
        dev = "cuda" if gpu else "cpu"
        src = ctx.alloc((maxn,), torch.uint8)
        dst = ctx.alloc((maxn,), torch.uint8)
        pat = ((torch.arange(maxn, dtype=torch.int64) * 7 + 13 * rank) % 251).to(torch.uint8)
        src.copy_(pat.to(dev))
        dst.zero_()
        ctx.barrier()
        # correctness first: one API put of the largest size, checked byte for byte at rank 1
        if rank == 0:
            gpunet.put(ctx.remote(1, dst), src)
            ctx.quiet()
        ctx.barrier()
        wrong = int((dst.cpu() != ((torch.arange(maxn) * 7) % 251).to(torch.uint8)).sum()) \
            if rank == 1 else 0
        ctx.barrier()
        rows, sweep, profile, p2p_us = [], [], None, {}
        if rank == 0:
            mapped = ctx._transports.peer_heaps[1].base + (dst.data_ptr() - ctx.heap_base)
            rows = _bandwidth_rows(ctx, src, dst, mapped, cfg)
            if gpu and "sweep" not in cfg["skip"]:
                sweep = _sweep_rows(ctx, src, mapped, cfg)
            if "profile" not in cfg["skip"]:
                profile = _profile_put(ctx, src, dst)
            if "nic" not in cfg["skip"]:
                p2p_us = {n: _put_quiet_us(ctx, src, dst, n, NIC_ITERS[gpu]) for n in NIC_SIZES}
        # a host barrier: rank 1 must not spin in a device wait (bounded by timeout_s, and an SM
        # polling memory) while rank 0 measures
        dist.barrier()
        ctx.barrier()
        rtt = {} if "pingpong" in cfg["skip"] else _pingpong(ctx, cfg)
        from gpunet.device import abi
        flags = int(ctx._dev.peers[1 - rank].rkey)
        info = {"rank": rank, "wrong": wrong, "transports": dict(ctx.transports),
                "peer_same_device": bool(flags & abi.P2P_SAME_DEVICE)}
        every = [None] * world
        dist.all_gather_object(every, info)
    finally:
        ctx.close()
    nic = [] if "nic" in cfg["skip"] else _nic_rows(rank, cfg, p2p_us)
    return {"rows": rows, "sweep": sweep, "profile": profile, "rtt_us": rtt, "ranks": every,
            "nic": nic}


# ---------------------------------------------------------------------------------------------
# launcher side

def _stats(xs):
    return statistics.median(xs), min(xs), max(xs)


def _summarize(res, cfg):
    rows, gate = [], []
    wrong = sum(r["wrong"] for r in res["ranks"])
    gate.append({"kind": "test", "name": "p2p bench: a bulk put lands byte for byte",
                 "result": "PASS" if wrong == 0 else "FAIL",
                 "figure": "%d wrong bytes of %d" % (wrong, max(cfg["sizes"])),
                 "goal": "0 wrong bytes"})
    ratios_from = []
    for r in res["rows"]:
        n = r["bytes"]
        put_gbps = [n / x["put_s"] / 1e9 for x in r["runs"]]
        mem_gbps = [n / x["memcpy_s"] / 1e9 for x in r["runs"]]
        ratio = [p / m for p, m in zip(put_gbps, mem_gbps)]
        row = {"bytes": n, "iters": r["iters"], "bulk_geometry": r["bulk_geometry"],
               "held": all(x["held"] for x in r["runs"])}
        for k, xs in (("put_GBps", put_gbps), ("memcpy_GBps", mem_gbps), ("ratio", ratio)):
            row[k], row[k + "_min"], row[k + "_max"] = _stats(xs)
        row["put_us"] = statistics.median(x["put_s"] for x in r["runs"]) * 1e6
        row["memcpy_us"] = statistics.median(x["memcpy_s"] for x in r["runs"]) * 1e6
        # host time to queue one call (Python + launch), not part of the GPU figures above
        row["put_host_us"] = statistics.median(x["put_host_s"] for x in r["runs"]) * 1e6
        row["memcpy_host_us"] = statistics.median(x["memcpy_host_s"] for x in r["runs"]) * 1e6
        rows.append(row)
        if n >= TARGET_RATIO_FROM:
            ratios_from.append((n, row["ratio"]))
    if ratios_from:
        worst = min(ratios_from, key=lambda t: t[1])
        gate.append({"kind": "target", "name": "p2p put vs %s" % cfg["yardstick"],
                     "result": "met" if worst[1] >= TARGET_RATIO else "NOT met",
                     "figure": "lowest median ratio %.2f at %s; %s"
                               % (worst[1], _size(worst[0]),
                                  ", ".join("%s %.2f" % (_size(n), x) for n, x in ratios_from)),
                     "goal": ">= %.2f at every size from %s" % (TARGET_RATIO, _size(TARGET_RATIO_FROM))})
    modes = {int(m): xs for m, xs in res["rtt_us"].items() if xs}
    rtt = modes.get(TARGET_MODE)
    pp = None
    if rtt:
        med, lo, hi = _stats(rtt)
        pp = {"rtt_us": med, "rtt_us_min": lo, "rtt_us_max": hi, "runs": rtt,
              "round_trips_per_run": cfg["pp_iters"],
              "modes": [{"mode": m, "name": PP_MODES[m], "rtt_us": _stats(xs)[0],
                         "rtt_us_min": _stats(xs)[1], "rtt_us_max": _stats(xs)[2], "runs": xs}
                        for m, xs in sorted(modes.items())]}
        by_number = ("; by PE number (mode 0) %.2f us" % _stats(modes[0])[0]) if modes.get(0) else ""
        gate.append({"kind": "target", "name": "p2p put_signal ping-pong round trip",
                     "result": "met" if hi <= TARGET_RTT_US else "NOT met",
                     "figure": "%s: median of %d runs %.2f us [%.2f, %.2f]%s"
                               % (PP_MODES[TARGET_MODE], len(rtt), med, lo, hi, by_number),
                     "goal": "<= %.1f us in every run" % TARGET_RTT_US})
    return rows, pp, gate


def _size(n):
    return "%d MiB" % (n >> 20) if n >= (1 << 20) else "%d KiB" % (n >> 10)


def _details(pp, sweep, profile=None):
    """The ping-pong's modes and the copy sweep (printed before the main table, which a gate log's
    tail keeps)."""
    lines = []
    if pp:
        lines.append("put_signal ping-pong modes (gpunet/device/testing/kernels/p2p_bench.cu), round trip:")
        for m in pp["modes"]:
            lines.append("  mode %d %-30s %.2f us [%.2f, %.2f]" % (m["mode"], m["name"], m["rtt_us"],
                                                                  m["rtt_us_min"], m["rtt_us_max"]))
    if profile:
        lines.append("host side of gpunet.put (%d B; cProfile of %d calls, %.1f us a call under "
                     "the profiler), top by own time:" % (profile["bytes"], profile["calls"],
                                                          profile["us_per_call_profiled"]))
        lines.extend("  " + x for x in profile["top"])
    if sweep:
        lines.append("copy sweep (ops.cu k_put_p2p; variant, bytes per block / threads): put us, "
                     "median of the runs")
        for r in sweep:
            lines.append("  %7s  %-24s %4d x %4d  %9.2f us  %s" % (
                _size(r["bytes"]), r["name"], r["grid"], r["block"], r["put_us"],
                "" if r["held"] else "(not held)"))
    return "\n".join(lines)


def _table(rows, pp, head, yard):
    lines = [head, ""]
    fmt = "%9s %6s  %10s %10s  %12s %10s  %6s %12s  %5s  %s"
    lines.append(fmt % ("bytes", "iters", "put us", "put GB/s", yard[:12] + " us", "GB/s",
                        "ratio", "ratio range", "held", "host us/call (put, copy)"))
    lines.append("-" * 112)
    for r in rows:
        lines.append(fmt % (_size(r["bytes"]), r["iters"], "%.2f" % r["put_us"],
                            "%.1f" % r["put_GBps"], "%.2f" % r["memcpy_us"],
                            "%.1f" % r["memcpy_GBps"], "%.2f" % r["ratio"],
                            "[%.2f, %.2f]" % (r["ratio_min"], r["ratio_max"]),
                            "yes" if r["held"] else "NO",
                            "%.1f, %.1f" % (r["put_host_us"], r["memcpy_host_us"])))
    if pp:
        lines.append("")
        lines.append("put_signal ping-pong (8 bytes, SET, %s), round trip: median %.2f us [%.2f, %.2f] "
                     "over %d runs of %d round trips" % (PP_MODES[TARGET_MODE], pp["rtt_us"], pp["rtt_us_min"],
                                                         pp["rtt_us_max"], len(pp["runs"]),
                                                         pp["round_trips_per_run"]))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true", help="2 ranks on GPU 0 under a private MPS daemon")
    ap.add_argument("--runs", type=int, default=3, help="runs per figure (>= 3 for the gate)")
    ap.add_argument("--max-mib", type=float, help="largest put in MiB (GPU 256, CPU 1)")
    ap.add_argument("--pp-iters", type=int, help="ping-pong round trips per run (GPU 10000, CPU 200)")
    ap.add_argument("--timeout-s", type=float, default=30.0, help="device wait bound")
    ap.add_argument("--no-mps", action="store_true", help="GPU: do not start an MPS daemon (one "
                    "is already running for this run's CUDA_MPS_PIPE_DIRECTORY)")
    ap.add_argument("--skip", default="",
                    help="comma list of parts left out: %s (the correctness check and the put "
                         "bandwidth rows always run)" % ",".join(PARTS))
    ap.add_argument("--puts-only", action="store_true",
                    help="--skip every part: the put path alone (for A/Bs)")
    ap.add_argument("--json", help="default bench/results/<date>/p2p_<cpu|gpu>.json")
    args = ap.parse_args(argv)
    unknown = {x for x in args.skip.split(",") if x} - set(PARTS)
    if unknown:
        ap.error("--skip: unknown part(s) %s; expected some of %s" % (sorted(unknown), PARTS))
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    if args.gpu:
        import torch
        if not torch.cuda.is_available():
            print("bench/p2p.py --gpu needs an NVIDIA GPU (torch.cuda.is_available() is False)",
                  file=sys.stderr)
            return 2
    max_bytes = int((args.max_mib or (256 if args.gpu else 1)) * (1 << 20))
    cfg = dict(gpu=args.gpu, runs=args.runs, sizes=_sizes(max_bytes), timeout_s=args.timeout_s,
               pp_iters=args.pp_iters or (10000 if args.gpu else 200),
               pp_warmup=100 if args.gpu else 20,
               pp_modes=sorted(PP_MODES) if args.gpu else [0, 2, 5, 6, TARGET_MODE],
               yardstick="cudaMemcpyAsync D2D" if args.gpu else "memmove",
               skip=sorted(PARTS) if args.puts_only else sorted({x for x in args.skip.split(",") if x}))
    from gpunet.demo import run_ranks
    from gpunet.errors import GpunetError

    print("[bench/p2p] 2 ranks over p2p, %s, sizes %s .. %s, %d runs"
          % ("GPU 0 (shared)" if args.gpu else "CPU soft NIC + HOST arm", _size(cfg["sizes"][0]),
             _size(cfg["sizes"][-1]), args.runs), file=sys.stderr, flush=True)
    mps_note = "no MPS (CPU)"
    t0 = time.monotonic()
    try:
        if args.gpu and not args.no_mps:
            from gpunet.device.testing.mps import private_mps
            with private_mps():
                mps_note = "private MPS daemon"
                res = run_ranks(_rank, 2, cfg, timeout_s=RANK_TIMEOUT_S)
        else:
            if args.gpu:
                mps_note = "MPS daemon of the caller (--no-mps)"
            res = run_ranks(_rank, 2, cfg, timeout_s=RANK_TIMEOUT_S)
    except GpunetError as e:
        print("[bench/p2p] FAILED: %s" % e, file=sys.stderr, flush=True)
        res = None
    m = machine(gpu=args.gpu)
    if res is None:
        rows, pp, gate = [], None, [{"kind": "test", "name": "p2p bench ran", "result": "FAIL",
                                     "figure": "the ranks failed (see stderr)", "goal": "it runs"}]
    else:
        rows, pp, gate = _summarize(res, cfg)
    head = ("gpunet p2p bench, %s, %s, 2 ranks (%s); put = gpunet.put (bulk launch), copy = %s of "
            "the same bytes between the same addresses; medians of %d runs"
            % ("GPU " + m.get("gpu", "?") if args.gpu else "CPU", m["date"], mps_note,
               cfg["yardstick"], args.runs))
    sweep = res.get("sweep", []) if res else []
    profile = res.get("profile") if res else None
    nic = res.get("nic", []) if res else []
    print(_details(pp, sweep, profile))
    if nic:
        print("put + quiet from the host, p2p vs a NIC peer (transport='ibgda', the soft NIC; its "
              "engine copies the %s heap), median us:" % nic[0]["heap"])
        for r in nic:
            print("  %7s  p2p %8.1f  ibgda %8.1f  (ibgda / p2p %.2f)" % (
                _size(r["bytes"]), r["p2p_us"], r["ibgda_us"], r["ibgda_us"] / r["p2p_us"]))
    print(_table(rows, pp, head, cfg["yardstick"]))
    for g in gate:
        print("%-6s %-7s %s  %s" % (g["kind"], g["result"], g["name"], g["figure"]))
    path = Path(args.json) if args.json else (ROOT / "bench" / "results" / datetime.date.today()
                                               .isoformat() / ("p2p_%s.json" % ("gpu" if args.gpu
                                                                               else "cpu")))
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {"what": "gpunet p2p put bandwidth and put_signal ping-pong", "config": cfg,
           "ranks": res["ranks"] if res else None,
           "mps": mps_note, "rows": rows, "pingpong": pp, "sweep": sweep, "put_profile": profile,
           "nic_put_quiet": nic, "gate": gate,
           "machine": m,
           "wall_s": time.monotonic() - t0}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("\nJSON: %s" % path)
    return 1 if any(g["kind"] == "test" and g["result"] != "PASS" for g in gate) else 0


if __name__ == "__main__":
    sys.exit(main())
