"""CPU latency of the Python API on the soft NIC: a 64-byte put + quiet and an 8-byte ping-pong
(2 ranks), over ibgda and the proxy, and where a put's time goes.

Rows (each repeated in ``--runs`` independent runs: a fresh gpunet.init, NICs and engines each
run; the table gives the median of the runs' medians and the spread [min, max] of those medians):

  put+quiet        2 ranks: rank 0 puts 64 B to rank 1 and quiet()s, one at a time (gpunet.demo's
                   put_quiet); what a Python caller waits for one small put to be delivered.
  ping-pong        2 ranks: 8-byte put_signal there, wait_until the answer (gpunet.demo's
                   ping_pong).
  breakdown (one rank, loopback QP, this process):
    ctypes call            a foreign call into the ops library that does nothing (an ABI size query)
    launch, quiet only     the HOST-arm launch of the ops kernel with one OP_QUIET and nothing
                           outstanding: the launch and the status handling without any NIC work
    device put+quiet       the ops kernel putting 64 B (the kernel ends with a quiet): the device
                           code plus the soft NIC (and the proxy thread) executing the put
    API put+quiet          gpunet.put + gpunet.quiet: the above plus the Python wrappers

Target (issue 7): put+quiet under 30 us median on the 2-core CI machine, in every run. Other
processes' load disturbs these figures (the polling threads give way to any runnable thread): the
machine's load average is recorded at the start and at the end, and a CPU probe (a fixed Python
loop) before each run says how fast the vCPU ran then. On the CPU a waiting caller runs the soft
NIC's and the proxy's passes itself (gpunet/host/progress.py), so a put + quiet needs no other thread.
--diag adds, per row and thread of each rank (caller, NIC engine, proxy threads): CPU time, time
runnable but not running, switches, migrations and the CPU it ran on last.

Usage: python bench/cpu_put.py [--runs 3] [--iters 300] [--json PATH] [--transports ibgda,proxy]
                              [--no-breakdown] [--diag]
"""
import argparse
import ctypes
import datetime
import json
import os
import sys
import time

from machine import machine  # bench/machine.py (the script's folder is on sys.path)

TARGET_US = 30.0


def _rank(rank, world, args):
    """One rank of the 2-rank rows: for each run and transport, a fresh Context, then put+quiet
    and ping-pong; rank 0 returns {transport: {"put+quiet": [stats per run],
    "ping-pong": [...]}}."""
    import torch

    import gpunet
    from gpunet.demo import ping_pong, put_quiet, stats_us

    import torch.distributed as dist

    out = {t: {"put+quiet": [], "ping-pong": [], "probe": []} for t in args.transports}
    if args.diag:
        out["diag"] = []
    for run in range(args.runs):
        for t in args.transports:
            with gpunet.init(transport=t, heap_bytes=4 << 20, timeout_s=30.0) as ctx:
                buf = ctx.alloc((4096,), torch.uint8)
                sig = ctx.alloc((2,), torch.int64)
                out[t]["probe"].append(_cpu_probe_us())
                roles = _roles(ctx) if args.diag else None
                s0 = _thread_stats(roles) if args.diag else None
                pq = put_quiet(ctx, buf, args.iters, args.warmup)
                s1 = _thread_stats(roles) if args.diag else None
                pp = ping_pong(ctx, buf, sig, args.iters, args.warmup)
                s2 = _thread_stats(roles) if args.diag else None
                if rank == 0:
                    out[t]["put+quiet"].append(stats_us(pq))
                    out[t]["ping-pong"].append(stats_us(pp))
                if args.diag:
                    mine = {"put+quiet": _delta(s0, s1), "ping-pong": _delta(s1, s2)}
                    for row, a, b in (("put+quiet", s0, s1), ("ping-pong", s1, s2)):
                        mine[row]["wall_ms"] = (b["wall_ns"] - a["wall_ns"]) / 1e6
                        tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
                        mine[row]["steal_ms"] = (b["steal_ticks"] - a["steal_ticks"]) * tick_ms
                        mine[row]["idle_ms"] = [(y - x) * tick_ms for x, y in
                                                zip(a["idle_ticks"], b["idle_ticks"])]
                    every = [None] * world
                    dist.all_gather_object(every, mine)
                    if rank == 0:
                        med = {"put+quiet": out[t]["put+quiet"][-1]["median_us"],
                               "ping-pong": out[t]["ping-pong"][-1]["median_us"]}
                        out["diag"].append(dict(run=run, transport=t, median_us=med,
                                                ranks=every))
    return out


def _cpu_probe_us():
    """How fast this vCPU runs Python now: the median of 21 timings of a fixed loop (us). On the
    CI VM the same code ran up to 2x slower in some runs with nothing else runnable on its CPU
    (bench/cpu_put.py --diag: the caller on its CPU the whole row, no waits); the probe beside
    each run's medians tells such a run from a regression."""
    ts = []
    for _ in range(21):
        t0 = time.perf_counter()
        x = 0
        for i in range(2000):
            x += i
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[10] * 1e6


# --- --diag: what each thread of each rank did during a row (Linux /proc; empty elsewhere) ------
def _roles(ctx):
    """{Linux thread id: role} of this rank's threads that the rows involve: the caller (this
    thread), the soft NIC's engine, the proxy threads."""
    import threading

    roles = {threading.get_native_id(): "caller"}
    pl = getattr(ctx.nic, "placement", None)
    if pl:
        roles[pl["tid"]] = "nic-engine"
    eng = getattr(getattr(ctx, "_transports", None), "engine", None)
    for i, p in enumerate(getattr(eng, "placement", None) or []):
        if p:
            roles[p["tid"]] = "proxy-%d" % i
    return roles


def _thread_stats(roles):
    """{role: counters} of the threads in ``roles`` now: run_ns and wait_ns (on a CPU / runnable
    on a run queue but not running: /proc schedstat), voluntary and involuntary switches (a
    sched_yield that gives the core away counts as involuntary), migrations and the CPU it last
    ran on."""
    out = {"wall_ns": time.monotonic_ns(), "steal_ticks": 0, "idle_ticks": []}
    try:
        with open("/proc/stat") as f:     # cpu user nice system idle iowait irq softirq steal
            out["steal_ticks"] = int(f.readline().split()[8])
            for line in f:                # cpuN ...: the idle ticks of each CPU
                if not line.startswith("cpu"):
                    break
                out["idle_ticks"].append(int(line.split()[4]))
    except (OSError, ValueError, IndexError):
        pass
    for tid, role in roles.items():
        d = "/proc/self/task/%d/" % tid
        try:
            with open(d + "schedstat") as f:
                run_ns, wait_ns, _ = (int(x) for x in f.read().split())
            c = {"run_ns": run_ns, "wait_ns": wait_ns}
            with open(d + "status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        c["vcsw"] = int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        c["ivcsw"] = int(line.split()[1])
            try:
                with open(d + "sched") as f:
                    for line in f:
                        if line.startswith("se.nr_migrations"):
                            c["migrations"] = int(line.split(":")[1])
            except OSError:
                pass
            with open(d + "stat") as f:
                c["cpu"] = int(f.read().rsplit(")", 1)[1].split()[36])
            out[role] = c
        except (OSError, ValueError, IndexError):
            continue
    return out


def _delta(a, b):
    """Counters of ``b`` minus ``a`` per role (the CPU: the one it ran on last, in ``b``)."""
    out = {}
    for role, cb in b.items():
        if not isinstance(cb, dict):
            continue
        ca = a.get(role, {})
        out[role] = {k: (v if k == "cpu" else v - ca.get(k, 0)) for k, v in cb.items()}
    return out


def _print_diag(diag):
    print("per-thread during each row (--diag): run / runnable-but-waiting ms, voluntary / "
          "involuntary switches, migrations, last CPU")
    for d in diag:
        for test in ("put+quiet", "ping-pong"):
            w = d["ranks"][0][test]
            cells = ["wall %.1f ms, steal %.1f, idle per CPU %s ms" % (
                w["wall_ms"], w["steal_ms"], "/".join("%.0f" % x for x in w["idle_ms"]))]
            for r, threads in enumerate(d["ranks"]):
                for role, c in sorted(threads[test].items()):
                    if not isinstance(c, dict):
                        continue
                    cells.append("r%d %s %.1f/%.1f ms %d/%d sw %d mig cpu%d" % (
                        r, role, c["run_ns"] / 1e6, c["wait_ns"] / 1e6, c.get("vcsw", 0),
                        c.get("ivcsw", 0), c.get("migrations", 0), c["cpu"]))
            print("  run %d %-6s %-10s %6.1f us | %s" % (d["run"], d["transport"], test,
                                                        d["median_us"][test], "; ".join(cells)))


def _timed(fn, iters, warmup):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def breakdown(transport, iters, warmup):
    """The breakdown rows of one run (one rank, loopback): {row: stats}. The ops kernel is
    launched the way a user kernel is (ctx.device_context(), gpunet.device.ops, ctx.check())."""
    import torch

    import gpunet
    from gpunet.demo import stats_us
    from gpunet.device import abi
    from gpunet.device.ops import Launch, load_ops

    res = {}
    with gpunet.init(transport=transport, heap_bytes=4 << 20, timeout_s=30.0) as ctx:
        x = ctx.alloc((64,), torch.uint8)
        y = ctx.alloc((64,), torch.uint8)
        r = ctx.remote(0, y)
        h = ctx.device_context()
        lib, largs = load_ops(h.arch), Launch(1, 1, h.warp_size).args()

        def op(**fields):
            ops = (abi.OpDesc * 1)()
            for k, v in fields.items():
                setattr(ops[0], k, v)
            return ops
        quiet = op(kind=abi.OP_QUIET)
        put = op(kind=abi.OP_PUT, pe=0, dst=y.data_ptr(), src=x.data_ptr(), nbytes=64)

        def launch(ops):
            if lib.gpunet_ops_launch(*largs, h.ptr, ctypes.addressof(ops), 1) != 0:
                raise gpunet.GpunetError("launch failed")
            ctx.check("bench")
        res["ctypes call"] = stats_us(_timed(lambda: lib.gpunet_ops_abi_size(0), iters, warmup))
        res["launch, quiet only"] = stats_us(_timed(lambda: launch(quiet), iters, warmup))
        res["device put+quiet"] = stats_us(_timed(lambda: launch(put), iters, warmup))
        res["API put+quiet"] = stats_us(_timed(lambda: (gpunet.put(r, x), gpunet.quiet()),
                                               iters, warmup))
    return res


def _spread(stats):
    meds = sorted(s["median_us"] for s in stats)
    p99 = sorted(s["p99_us"] for s in stats)
    return {"median_us": meds[len(meds) // 2], "min_median_us": meds[0], "max_median_us": meds[-1],
            "run_medians_us": [s["median_us"] for s in stats], "p99_us": p99[len(p99) // 2],
            "runs": len(stats), "iters": stats[0]["n"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="independent runs (>= 1; report >= 3)")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--transports", default="ibgda,proxy")
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--diag", action="store_true",
                    help="per thread of each rank and row: CPU time, time runnable but waiting, "
                         "context switches, migrations (Linux /proc)")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                   "results", datetime.date.today().isoformat(),
                                                   "cpu_put.json"))
    args = ap.parse_args(argv)
    args.transports = [t for t in args.transports.split(",") if t]
    if args.runs < 1 or args.iters < 1:
        ap.error("--runs and --iters must be >= 1")
    os.environ.setdefault("GPUNET_PLATFORM", "cpu")
    from gpunet.demo import run_ranks

    m = machine()
    load0 = os.getloadavg()[0]
    rows = []
    two = run_ranks(_rank, 2, args, timeout_s=1800)
    for t in args.transports:
        for test in ("put+quiet", "ping-pong"):
            rows.append(dict(row=test, transport=t, ranks=2,
                             bytes=64 if test == "put+quiet" else 8, **_spread(two[t][test]),
                             cpu_probe_us=[round(p, 1) for p in two[t]["probe"]]))
    if not args.no_breakdown:
        for t in args.transports:
            per_run = [breakdown(t, args.iters, args.warmup) for _ in range(args.runs)]
            for name in per_run[0]:
                rows.append(dict(row="breakdown: " + name, transport=t, ranks=1,
                                 **_spread([p[name] for p in per_run])))
    load1 = os.getloadavg()[0]
    print(f"{'row':<32}{'transport':>10}{'median us':>11}{'[min, max] of run medians':>28}"
          f"{'p99 us':>9}")
    for r in rows:
        print(f"{r['row']:<32}{r['transport']:>10}{r['median_us']:>11.1f}"
              f"{'[%.1f, %.1f]' % (r['min_median_us'], r['max_median_us']):>28}{r['p99_us']:>9.1f}")
    for t in args.transports:
        print("CPU probe (a fixed Python loop, us; rank 0, before each %s run): %s" % (
            t, ", ".join("%.1f" % p for p in two[t]["probe"])))
    if args.diag:
        _print_diag(two["diag"])
    pq = [r for r in rows if r["row"] == "put+quiet"]
    for r in pq:                      # the house rule: a target holds only if every run meets it
        r["target_us"] = TARGET_US
        r["target_met"] = r["max_median_us"] < TARGET_US
    print("runs: %d x %d iterations (after %d warm-up) each; load average %.1f at the start, "
          "%.1f at the end, %s cores. Target: put+quiet < %.0f us median in every run: %s" % (
              args.runs, args.iters, args.warmup, load0, load1, m["cores"], TARGET_US,
              ", ".join("%s %s" % (r["transport"], "met" if r["target_met"] else "NOT met")
                        for r in pq)))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"bench": "cpu_put", "machine": m, "argv": sys.argv[1:], "loadavg_start": load0,
                   "loadavg_end": load1, "rows": rows,
                   "diag": two.get("diag")}, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
