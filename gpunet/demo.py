"""``python -m gpunet demo``: N ranks on the soft NIC, a ping-pong and a bandwidth sweep, both
transports, a table (and a PNG plot when matplotlib is installed).

Every rank is its own process (torch.multiprocessing, gloo bootstrap on 127.0.0.1) with its own
soft mlx5 NIC; ranks reach each other through shared memory exactly as two hosts' NICs would
through a fabric. Rank 0 and rank 1 do the measuring; other ranks join the barriers.

- ping-pong: rank 0 put_signal()s 8 bytes to rank 1, which wait_until()s the signal and
  put_signal()s back; the round trip is the time rank 0 waits, median over iterations.
- put+quiet: rank 0 puts 64 bytes to rank 1 and quiet()s, one at a time: a small put's latency
  from Python (bench/cpu_put.py repeats both figures over several runs).
- bandwidth: rank 0 puts ``size`` bytes to rank 1 ``reps`` times, then quiet(); GB/s = bytes / time.

On the CPU these figures measure the soft NIC and the HOST arm's emulated device threads, not a
network: they show the stack working end to end and the two transports side by side.
"""
import argparse
import json
import os
import sys
import time

from gpunet.host.bootstrap import free_port

SIZES = [64, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
TRANSPORTS = ["ibgda", "proxy"]


def progress(msg, job="gpunet demo"):
    """One progress line of ``job`` on stderr: rewritten in place on a terminal (end ``msg`` with a
    newline to keep it), one line per call in a log."""
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K[%s] %s" % (job, msg))
    else:
        sys.stderr.write("[%s] %s\n" % (job, msg.rstrip("\n")))
    sys.stderr.flush()


def run_ranks_cli(target, world, args, job):
    """:func:`run_ranks` for a command-line job: a progress line, then rank 0's result; on a
    gpunet error, ``job failed: <error>`` on stderr and None (the job then exits 1)."""
    from gpunet.errors import GpunetError

    progress("starting %d ranks (the first run compiles the device code: a minute)\n" % world, job)
    try:
        return run_ranks(target, world, args)
    except GpunetError as e:
        print("\n%s failed: %s" % (job, e), file=sys.stderr)
        return None


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only), or None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig, path):
    """Lay ``fig`` out, write it to ``path`` (PNG, 100 dpi), close it; returns ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return path


def _rank_entry(target, rank, world, port, args, results, env):
    """One rank process of run_ranks: joins the gloo group, runs ``target(rank, world, args)``;
    rank 0 reports ("ok", its return value); any rank that raises reports ("err", traceback)."""
    import pickle
    import traceback

    os.environ.update(env or {})
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                                world_size=world)
        out = target(rank, world, args)
        if rank == 0:
            # by value: a queue would pass tensors as shared-memory handles that die with this
            # process, which may exit before the launcher reads them
            results.put(("ok", pickle.dumps(out)))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, then exit non-zero
        results.put(("err", "rank %d: %s: %s\n%s" % (rank, type(e).__name__, e,
                                                    traceback.format_exc())))
        raise SystemExit(1)


def run_ranks(target, world, args, timeout_s=900, env=None):
    """Run ``target(rank, world, args)`` in ``world`` spawned rank processes on this machine.

    Each process joins a gloo group on 127.0.0.1 (a fresh port) before calling ``target``;
    ``target`` must be a module-level function (spawn pickles it by name). Returns rank 0's return
    value. Raises gpunet.GpunetError naming the failure when a rank raises, dies or the run
    outlasts ``timeout_s`` (stragglers are killed: the wait is bounded). ``env``: variables set in
    every rank before it imports anything else. Used by ``gpunet demo``, ``gpunet ep-demo`` and
    bench/ep.py."""
    import pickle
    import queue

    import torch.multiprocessing as mp

    from gpunet.errors import GpunetError, TimeoutError as GpunetTimeout

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(target, r, world, port, args, results, env))
             for r in range(world)]
    for pr in procs:
        pr.start()
    got = None
    deadline = time.monotonic() + timeout_s
    try:
        while got is None and time.monotonic() < deadline:
            try:
                got = results.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, pr in enumerate(procs) if pr.exitcode not in (None, 0)]
                if dead:
                    try:                       # a dying rank queues its traceback first
                        got = results.get(timeout=5.0)
                    except queue.Empty:
                        got = ("err", "ranks %s exited with %s and said nothing"
                               % (dead, [procs[i].exitcode for i in dead]))
    finally:
        for pr in procs:
            pr.join(timeout=60 if got is not None and got[0] == "ok" else 5)
            if pr.is_alive():
                pr.kill()
                pr.join()
    if got is None:
        raise GpunetTimeout("run_ranks: %d ranks gave no result within %d s" % (world, timeout_s))
    if got[0] != "ok":
        raise GpunetError("run_ranks: %s" % got[1])
    return pickle.loads(got[1])


PUT_QUIET_BYTES = 64


def ping_pong(ctx, buf, sig, iters, warmup):
    """8-byte ping-pong between ranks 0 and 1 (other ranks only join the closing barrier): rank 0
    put_signal()s 8 bytes of ``buf`` to rank 1 and wait_until()s its pong; rank 1 answers each
    ping. ``sig``: a symmetric int64[2] of zeros (ping count, pong count). Returns rank 0's round
    trips in seconds (``iters`` of them, after ``warmup``); other ranks return []."""
    import gpunet

    times = []
    gpunet.barrier()
    for i in range(iters + warmup):
        if ctx.rank == 0:
            t0 = time.perf_counter()
            gpunet.put_signal(ctx.remote(1, buf), buf[:8], ctx.remote(1, sig, 0))
            gpunet.wait_until(sig, i + 1, "ge", index=1)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        elif ctx.rank == 1:
            gpunet.wait_until(sig, i + 1, "ge", index=0)
            gpunet.put_signal(ctx.remote(0, buf), buf[:8], ctx.remote(0, sig, 1))
    gpunet.quiet()
    gpunet.barrier()
    return times


def put_quiet(ctx, buf, iters, warmup, nbytes=PUT_QUIET_BYTES):
    """Rank 0 puts ``nbytes`` of ``buf`` to rank 1 and quiet()s, ``iters`` times after
    ``warmup``: returns the seconds each put + quiet took (other ranks: []; all meet at a barrier
    after). What a Python caller waits for one small put to be delivered. The other ranks wait in
    torch.distributed's barrier (asleep in a socket read) while rank 0 measures: a gpunet barrier
    is device code polling its signal, which on the CPU takes a core from rank 0's threads."""
    import torch.distributed as dist

    import gpunet

    times = []
    if ctx.rank == 0:
        dst = ctx.remote(1 % ctx.world_size, buf)
        for i in range(iters + warmup):
            t0 = time.perf_counter()
            gpunet.put(dst, buf[:nbytes])
            gpunet.quiet()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    gpunet.barrier()
    return times


def stats_us(times):
    """median / p99 / min / max of a list of seconds, in us (the rows' fields)."""
    t = sorted(times)
    if not t:
        return {}
    return {"median_us": t[len(t) // 2] * 1e6,
            "p99_us": t[min(len(t) - 1, int(len(t) * 0.99))] * 1e6,
            "min_us": t[0] * 1e6, "max_us": t[-1] * 1e6, "n": len(t)}


def _rank_main(rank, world, args):
    import torch

    import gpunet

    rows = []
    steps = len(TRANSPORTS) * (1 + len(args.sizes))
    step = 0
    for transport in TRANSPORTS:
        with gpunet.init(transport=transport, heap_bytes=max(args.sizes) * 2 + (4 << 20),
                         timeout_s=30.0) as ctx:
            buf = ctx.alloc((max(args.sizes),), torch.uint8)
            sig = ctx.alloc((2,), torch.int64)        # [0]: ping count, [1]: pong count
            gpunet.barrier()
            # ping-pong, then put + quiet
            step += 1
            if rank == 0:
                progress("%s: ping-pong, put + quiet (%d/%d)" % (transport, step, steps))
            times = ping_pong(ctx, buf, sig, args.iters, args.warmup)
            lat = put_quiet(ctx, buf, args.iters, args.warmup)
            if rank == 0:
                rows.append(dict(transport=transport, test="ping-pong", bytes=8, **stats_us(times)))
                rows.append(dict(transport=transport, test="put+quiet", bytes=PUT_QUIET_BYTES,
                                 **stats_us(lat)))
            # bandwidth sweep
            for size in args.sizes:
                step += 1
                if rank == 0:
                    progress("%s: put %s x %d (%d/%d)" % (transport, _fmt(size), args.reps,
                                                           step, steps))
                    gpunet.put(ctx.remote(1, buf), buf[:size])     # warm-up
                    gpunet.quiet()
                    t0 = time.perf_counter()
                    for _ in range(args.reps):
                        gpunet.put(ctx.remote(1, buf), buf[:size])
                    gpunet.quiet()
                    dt = time.perf_counter() - t0
                    rows.append({"transport": transport, "test": "put bandwidth", "bytes": size,
                                 "GBps": size * args.reps / dt / 1e9,
                                 "us_per_put": dt / args.reps * 1e6})
                gpunet.barrier()
    if rank == 0:
        progress("done\n")
    return rows


def _fmt(n):
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return "%d %s" % (n // k, unit)
    return "%d B" % n


def _table(rows, world):
    lines = ["gpunet demo: %d ranks, soft NIC (CPU), HOST-arm device code, %s"
             % (world, time.strftime("%Y-%m-%d")), ""]
    lines.append("%-9s %-14s %10s %14s %14s" % ("transport", "test", "size", "median / MB/s",
                                                "p99 / us/put"))
    lines.append("-" * 65)
    for r in rows:
        if r["test"] in ("ping-pong", "put+quiet"):
            lines.append("%-9s %-14s %10s %11.1f us %11.1f us" % (
                r["transport"], r["test"], _fmt(r["bytes"]), r["median_us"], r["p99_us"]))
        else:
            lines.append("%-9s %-14s %10s %9.1f MB/s %11.1f us" % (
                r["transport"], r["test"], _fmt(r["bytes"]), r["GBps"] * 1e3, r["us_per_put"]))
    return "\n".join(lines)


def _plot(rows, path):
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for t in TRANSPORTS:
        pts = [(r["bytes"], r["GBps"]) for r in rows if r["transport"] == t and "GBps" in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=t)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("put size (bytes)")
    ax.set_ylabel("GB/s")
    ax.set_title("gpunet put bandwidth, soft NIC")
    ax.legend()
    ax.grid(True, alpha=0.3)
    return save_figure(fig, path)


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpunet demo", description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="rank processes (>= 2)")
    p.add_argument("--iters", type=int, default=200,
                   help="ping-pong round trips and put + quiet calls")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--reps", type=int, default=20, help="puts per bandwidth point")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=SIZES)
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.add_argument("--plot", default="gpunet_demo.png", help="PNG path (needs matplotlib)")
    args = p.parse_args(argv)
    if args.ranks < 2:
        p.error("--ranks must be >= 2")
    rows = run_ranks_cli(_rank_main, args.ranks, args, "gpunet demo")
    if rows is None:
        return 1
    print(_table(rows, args.ranks))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "rows": rows}, f, indent=1)
    png = _plot(rows, args.plot)
    print("\nplot: %s" % (png or "not saved (pip install matplotlib for a PNG)"))
    return 0
