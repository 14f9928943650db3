"""Where the time of gpunet.ep's low-latency dispatch / combine goes: per phase, on the device, and
the host's share, for one configuration (DeepEP's: 128 tokens, hidden 7168, top-8, 288 experts).

bench/ep.py gives the headline figure (CUDA events around the call, a barrier first). This script
takes each timed call apart, in the same run and with the same alignment (bench/ep.py's
_aligner; its correctness check runs first):

- host: perf_counter around the Python call (argument checks, allocations, the launch, the failure
  check). Without a device sync inside the call this is the time the GPU may sit idle before the
  kernel starts (it counts in the event time when the stream is already drained).
- event: CUDA events around the call, as bench/ep.py times it.
- device stamps (LlParams::prof, ll.cuh ST_*): thread 0 of every block stores the global timer at
  each phase boundary; all ranks share one GPU here, so one clock orders every rank's stamps.
  Per call: kernel (first block in .. last block out), start (first .. last block in), plan
  (block 0: its quiet of the peers; there is no routing plan), send (plan .. last block's puts
  posted), hdr (the last block's
  headers + signals), wait (block 0: own headers posted .. every source arrived), recv (receive
  tables .. last block's unpack / reduce done), and across ranks: skew (first block in, earliest
  rank .. latest rank) and sig lat (the last peer's headers posted .. this rank saw them all).
- kineto (torch.profiler, when it works under MPS): every kernel and copy the call puts on the
  GPU, with its device time: extra launches or copies show up by name.

It prints one table per rank count (medians over the timed calls, microseconds), the torch
gather yardstick of bench/ep.py, and writes the JSON (every call's figures) beside it.

Usage (GPU; 2+ ranks on one GPU need MPS: bash bench/ep_gpu.sh profile starts a private daemon):
  python bench/ep_profile.py --gpu [--ranks 2] [--transport p2p] [--iters 30] [--hold-us 300]
                             [--json PATH]
On the CPU (no --gpu) it runs the same on the soft NIC and HOST arm, small sizes: a sanity check of
the script and the stamps only, not a measurement.
"""
import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))        # bench/ep.py, bench/machine.py

import ep as epbench  # noqa: E402  (bench/ep.py: aligner, checks, yardsticks)
from machine import machine  # noqa: E402

OPS = ("dispatch bf16", "dispatch fp8", "combine bf16")
PHASES = ("event", "host", "kernel", "start", "plan", "quiet", "counts", "send", "hdr", "fill",
          "hdr.f", "hdr.s", "hdr.a", "wait", "recv", "table", "skew", "sig lat")
GPU_DEFAULTS = dict(ranks="2", tokens=128, hidden=7168, topk=8, experts=288, iters=30, warmup=5)
CPU_DEFAULTS = dict(ranks="2", tokens=16, hidden=256, topk=4, experts=8, iters=4, warmup=1)


def _phases(st, names):
    """Per-call device phases (ns) of one rank from its stamp matrix [blocks, STAMPS] (0 = not
    reached); returns a dict and the raw anchors the cross-rank figures need."""
    col = {n: [int(r[i]) for r in st] for i, n in enumerate(names)}

    def live(n):
        return [v for v in col[n] if v]
    out, anchor = {}, {}
    begin, end = live("begin"), live("end")
    if not begin or not end:
        return out, anchor
    out["kernel"] = max(end) - min(begin)
    out["start"] = max(begin) - min(begin)
    anchor["begin"] = min(begin)
    b0 = {n: col[n][0] for n in names}
    if b0["send_plan"]:
        out["plan"] = b0["send_plan"] - b0["begin"]
    if b0.get("quiet"):
        out["quiet"] = b0["quiet"] - b0["begin"]
    if b0.get("counted") and b0["send_plan"]:
        out["counts"] = b0["counted"] - b0["send_plan"]
    last, filled = live("send_last") if "send_last" in col else [], \
        live("hdr_filled") if "hdr_filled" in col else []
    plan, loop, hdr = live("send_plan"), live("send_loop"), live("send_hdr")
    if plan and loop:
        out["send"] = max(loop) - min(plan)
    if hdr and loop:
        out["hdr"] = max(hdr) - max(loop)
        anchor["hdr"] = max(hdr)
        filled = live("filled") if "filled" in col else []
        if filled:
            out["fill"] = max(filled) - max(loop)
        if last and filled:
            out["hdr.f"] = max(filled) - max(last)
            out["hdr.s"] = max(hdr) - max(filled)
            signaled = live("hdr_signaled") if "hdr_signaled" in col else []
            if signaled:
                out["hdr.a"] = max(hdr) - max(signaled)
    if b0["recv_ready"] and hdr:
        out["wait"] = b0["recv_ready"] - max(hdr)
        anchor["ready"] = b0["recv_ready"]
    ready, table, rloop = live("recv_ready"), live("recv_table"), live("recv_loop")
    if ready and rloop:
        out["recv"] = max(rloop) - min(ready)
    if ready and table:
        out["table"] = max(table) - min(ready)
    return out, anchor


def _kineto(fn, align, n, on):
    """Device time per name of what ``n`` calls of fn put on the GPU (torch.profiler), per call;
    or {"error": ...} where the profiler does not work (e.g. CUPTI under MPS). ``on`` False: the
    same calls unprofiled (the other ranks: one profiler per GPU, every rank in step)."""
    import torch
    if not on:
        for _ in range(n):
            align()
            fn()
        torch.cuda.synchronize()
        return None
    done = 0
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                align()
                fn()
                done += 1
            torch.cuda.synchronize()
        out = {}
        for ev in prof.key_averages():
            dev = 0.0
            for attr in ("self_device_time_total", "self_cuda_time_total", "device_time_total",
                         "cuda_time_total"):
                if hasattr(ev, attr):
                    dev = float(getattr(ev, attr))
                    break
            cpu = float(getattr(ev, "self_cpu_time_total", 0.0))
            if dev > 0 or ev.key.startswith("cuda") or "Launch" in ev.key:
                out[ev.key[:80]] = {"count_per_call": ev.count / n, "device_us_per_call": dev / n,
                                    "cpu_us_per_call": cpu / n}
        return out
    except Exception as e:  # noqa: BLE001 - the profiler is optional; say why it is missing
        for _ in range(n - done):       # the other ranks make n calls: stay in step with them
            align()
            fn()
        return {"error": "%s: %s" % (type(e).__name__, e)}


def _host_breakdown(fn, align, n, on):
    """Where the host's time in ``n`` calls of fn goes (cProfile around the calls alone): the
    top functions by own time, us per call. ``on`` False: the same calls unprofiled (in step)."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    for _ in range(n):
        align()
        if on:
            prof.enable()
        fn()
        if on:
            prof.disable()
    if not on:
        return None
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:12]
    return [{"fn": "%s:%d(%s)" % (Path(k[0]).name, k[1], k[2]), "calls_per_call": v[1] / n,
             "own_us_per_call": v[2] / n * 1e6, "cum_us_per_call": v[3] / n * 1e6}
            for k, v in rows]


def _rank_profile(rank, world, cfg):
    """One rank: check once, then time every op with host clock, events and device stamps."""
    import torch
    import torch.distributed as dist

    from gpunet.device import ep as dep
    from gpunet.ep import Buffer
    from gpunet.ep import reference as ref
    from gpunet.ep.demo import buffer_transport

    gpu = cfg["gpu"]
    dev = "cuda" if gpu else "cpu"
    if gpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    T, H, K, E = cfg["tokens"], cfg["hidden"], cfg["topk"], cfg["experts"]
    e_loc = E // world
    kw = {}
    if cfg["blocks"]:
        kw["num_blocks"] = cfg["blocks"]
    if cfg["threads"]:
        kw["block_threads"] = cfg["threads"]
    buf = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(T, H, world, E),
                 low_latency_mode=True, num_qps_per_rank=e_loc, explicitly_destroy=True,
                 transport=cfg["transport"], timeout_s=cfg["timeout_s"],
                 recv_pool_bytes=epbench.ll_recv_pool_bytes(dict(cfg, sweep=[T]), world), **kw)
    res = {"rank": rank, "transport": buffer_transport(buf), "grid": buf._grid,
           "block": buf._block, "calls": {}, "fail": [],
           "bf16_dispatch": "direct" if buf._ll_direct_ok() else "messages"}
    try:
        align, res["align"] = epbench._aligner(gpu, None, buf.runtime)
        ins = ref.make_rank_inputs(world, T, H, K, E, cfg["seed"] + T, holes=cfg["holes"])
        x, tk, w = (ins[rank][k].to(dev) for k in ("x", "topk_idx", "topk_weights"))
        want = ref.ll_dispatch_ref([i["x"] for i in ins], [i["topk_idx"] for i in ins], E, T, rank)
        for fp8 in (False, True):
            bad = epbench._check_dispatch(buf.low_latency_dispatch(x, tk, T, E, use_fp8=fp8), want, fp8)
            if bad:
                res["fail"].append("dispatch %s: %s" % ("fp8" if fp8 else "bf16", bad))
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, tk, T, E, use_fp8=False)
        y = recv.clone()                 # the experts' output: the dispatched rows as they are
        combined = buf.low_latency_combine(y, tk, w, handle)[0]
        wsum = (w.float() * (tk != -1).float()).sum(1, keepdim=True)
        d = ref.calc_diff(combined.float().cpu(), (x.float() * wsum).cpu())
        res["combine_calc_diff"] = d
        if not d <= epbench.CALC_DIFF_BF16:
            res["fail"].append("combine: calc_diff %.3g" % d)
        stamps = torch.zeros(buf._grid * dep.STAMPS, dtype=torch.int64, device=dev)
        calls = {"dispatch bf16": lambda: buf.low_latency_dispatch(x, tk, T, E, use_fp8=False),
                 "dispatch fp8": lambda: buf.low_latency_dispatch(x, tk, T, E, use_fp8=True),
                 "combine bf16": lambda: buf.low_latency_combine(y, tk, w, handle)}
        for op in OPS:
            fn = calls[op]
            rows = []
            for i in range(cfg["warmup"] + cfg["iters"]):
                stamps.zero_()
                buf._set_profile(stamps)
                align()
                if gpu:
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    if cfg["call_hold_s"]:
                        epbench.hold_stream(cfg["call_hold_s"])
                    t0 = time.perf_counter()
                    s.record()
                    fn()
                    e.record()
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    ev_ns = s.elapsed_time(e) * 1e6
                else:
                    t0 = time.perf_counter()
                    fn()
                    t1 = time.perf_counter()
                    ev_ns = (t1 - t0) * 1e9
                buf._set_profile(None)
                st = stamps.view(buf._grid, dep.STAMPS).cpu().tolist()
                ph, anchor = _phases(st, dep.ST_NAMES)
                if i >= cfg["warmup"]:
                    rows.append({"event": ev_ns, "host": (t1 - t0) * 1e9, **ph, "anchor": anchor})
            res["calls"][op] = rows
        res["host_breakdown"] = {op: _host_breakdown(calls[op], align, 20, rank == 0)
                                 for op in ("dispatch bf16", "combine bf16")}
        if gpu and not cfg["no_kineto"]:
            res["kineto"] = {op: _kineto(calls[op], align, cfg["kineto_iters"], rank == 0)
                             for op in OPS}
    finally:
        buf.destroy()
    everyone = [None] * world
    dist.all_gather_object(everyone, res)
    return everyone if rank == 0 else None


def _cross_rank(per_rank, op):
    """Add the cross-rank figures (one clock: ranks share the GPU) to every call row."""
    n = min(len(r["calls"][op]) for r in per_rank)
    for i in range(n):
        rows = [r["calls"][op][i] for r in per_rank]
        begins = [rw["anchor"].get("begin") for rw in rows]
        if all(begins):
            for rw in rows:
                rw["skew"] = rw["anchor"]["begin"] - min(begins)
        hdrs = [rw["anchor"].get("hdr") for rw in rows]
        for j, rw in enumerate(rows):
            peers = [h for k, h in enumerate(hdrs) if k != j and h]
            if peers and rw["anchor"].get("ready") and len(peers) == len(rows) - 1:
                rw["sig lat"] = rw["anchor"]["ready"] - max(peers)


def _med(rows, key):
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals) / 1e3 if vals else None


def _report(world, per_rank, yard, cfg):
    lines = []
    head = ("%d ranks, %s, grid %d x %d threads; %d tokens, hidden %d, top-%d, %d experts; medians "
            "of %d calls, us" % (world, per_rank[0]["transport"], per_rank[0]["grid"],
                                  per_rank[0]["block"], cfg["tokens"], cfg["hidden"], cfg["topk"],
                                  cfg["experts"], cfg["iters"]))
    lines += [head, ""]
    fmt = "%-14s %4s" + " %8s" * len(PHASES)
    lines.append(fmt % (("op", "rank") + PHASES))
    lines.append("-" * (20 + 9 * len(PHASES)))
    summary = {}
    for op in OPS:
        _cross_rank(per_rank, op)
        for r in per_rank:
            meds = [_med(r["calls"][op], p) for p in PHASES]
            summary.setdefault(op, []).append(dict(zip(PHASES, meds)))
            lines.append(fmt % ((op, r["rank"]) + tuple("-" if v is None else "%.1f" % v
                                                           for v in meds)))
    g = yard.get("gather, all ranks", {}).get("median_s")
    if g:
        lines.append("")
        lines.append("torch gather of the same rows (all ranks, one process): %.1f us; target "
                     "<= %.1fx = %.1f us" % (g * 1e6, epbench.TARGET_RATIO,
                                             g * 1e6 * epbench.TARGET_RATIO))
        for name, y in yard.items():
            lines.append("  torch %-28s %8.1f us" % (name, y["median_s"] * 1e6))
    kin = per_rank[0].get("kineto")
    if kin:
        lines.append("")
        lines.append("kineto, rank 0, per call (what the call puts on the GPU):")
        for op in OPS:
            k = kin.get(op, {})
            if "error" in k:
                lines.append("  %s: profiler unavailable: %s" % (op, k["error"][:200]))
                continue
            for name, v in sorted(k.items(), key=lambda kv: -kv[1]["device_us_per_call"])[:8]:
                lines.append("  %-14s %-60s x%-4.1f dev %8.1f us  cpu %8.1f us"
                             % (op, name[:60], v["count_per_call"], v["device_us_per_call"],
                                v["cpu_us_per_call"]))
    hb = per_rank[0].get("host_breakdown") or {}
    for op, top in hb.items():
        if not top:
            continue
        lines.append("")
        lines.append("host, rank 0, %s: cProfile, us per call (own / cumulative)" % op)
        for row in top:
            lines.append("  %-60s x%-4.1f own %7.1f  cum %7.1f" % (row["fn"][:60], row["calls_per_call"],
                                                                 row["own_us_per_call"],
                                                                 row["cum_us_per_call"]))
    fails = ["rank %d: %s" % (r["rank"], f) for r in per_rank for f in r["fail"]]
    lines.append("")
    lines.append("check: " + ("; ".join(fails) if fails else "OK (layout exact, combine calc_diff "
                                                              "%.2g)" % max(r["combine_calc_diff"]
                                                                            for r in per_rank)))
    return "\n".join(lines), summary, fails


LEGEND = """columns (us, median over calls; device columns from the global timer stamps):
  event   CUDA events around the call (bench/ep.py's figure)   host  perf_counter around the call
  kernel  first block in .. last block out      start  first .. last block in (same rank)
  plan    block 0: begin .. its quiet published  send  plan .. every block's puts posted
  quiet   block 0: begin .. its quiet of the peers done
  counts  direct BF16 dispatch, block 0: plan .. its count round done (rows wait for it)
  hdr     headers + signals after the last row (hdr.f: the last block's work on the headers
          after it knew it was last; every block fills header rows before it (ll.cuh
          fill_header_row, combine_header_early), so against runs from before that change
          compare hdr, kernel and event, not hdr.f; fill: dispatch, the last row .. every
          block's header rows filled;
          hdr.s: the signals after that; hdr.a: of hdr.s, self announce + sync reset after
          every signal was posted)              wait   own headers posted .. all sources seen
  recv    receive tables .. unpack / reduce done  table  combine: tables .. slot-table barrier
  skew    this rank's first block in - the earliest rank's   sig lat  last peer's headers .. seen
  event - kernel = launch / host time the GPU did not run the kernel (host > kernel: host-bound)"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--ranks")
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--topk", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--iters", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--holes", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--transport", default="auto", choices=("auto", "ibgda", "proxy", "p2p"),
                    help="gpunet.init's (auto: p2p on one node on CUDA, ibgda on the CPU; "
                         "ibgda: the soft NIC)")
    ap.add_argument("--blocks", default="0",
                    help="Buffer num_blocks, a list (e.g. 0,64: one run each; 0: the default grid)")
    ap.add_argument("--threads", type=int, default=0, help="Buffer block_threads (0: default)")
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--hold-us", type=float, default=0.0,
                    help="GPU: hold the stream this long before each timed call (bench/ep.py's "
                         "'(device)' rows): every rank's kernel then starts together, after the "
                         "hosts' launches, so the phases are those of aligned ranks (0: no hold)")
    ap.add_argument("--recv-pool-mib", type=int, default=-1,
                    help="the Buffer's receive pool in MiB (bench/ep.py ll_recv_pool_bytes): -1 "
                         "(default) with GPUNET_EP_LL_DIRECT=1 room for 4 dispatches (direct where "
                         "every peer is p2p on this GPU), else none (the message path)")
    ap.add_argument("--no-kineto", action="store_true")
    ap.add_argument("--kineto-iters", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    for k, v in (GPU_DEFAULTS if args.gpu else CPU_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.gpu:
        import torch
        if not torch.cuda.is_available():
            print("bench/ep_profile.py --gpu needs an NVIDIA GPU", file=sys.stderr)
            return 2
    cfg = {k: getattr(args, k) for k in ("gpu", "tokens", "hidden", "topk", "experts", "iters",
                                         "warmup", "holes", "seed", "transport", "blocks",
                                         "threads", "timeout_s", "no_kineto", "kineto_iters",
                                         "recv_pool_mib")}
    cfg["sweep"] = [args.tokens]
    cfg["hold_s"] = epbench.HOLD_S if args.gpu else 0.0   # the yardsticks: also timed with the stream held
    cfg["call_hold_s"] = args.hold_us * 1e-6 if args.gpu else 0.0
    from gpunet.demo import run_ranks
    from gpunet.errors import GpunetError

    out = {"what": "gpunet.ep LL per-phase profile", "config": cfg, "runs": [],
           "machine": machine(gpu=args.gpu)}
    rc = 0
    print(LEGEND)
    runs = [(w, b) for w in [int(v) for v in str(args.ranks).split(",")]
            for b in [int(v) for v in str(args.blocks).split(",")]]
    for world, blocks in runs:
        cfg["blocks"] = blocks
        t0 = time.monotonic()
        try:
            per_rank = run_ranks(_rank_profile, world, cfg, timeout_s=epbench.RANK_TIMEOUT_S)
        except GpunetError as e:
            print("[ep_profile] %d ranks FAILED: %s" % (world, e), file=sys.stderr, flush=True)
            out["runs"].append({"ranks": world, "blocks": blocks, "error": str(e)})
            rc = 1
            continue
        yard = epbench._torch_yardsticks(cfg, world, args.tokens)
        text, summary, fails = _report(world, per_rank, yard, cfg)
        print()
        print(text, flush=True)
        rc |= 1 if fails else 0
        out["runs"].append({"ranks": world, "blocks": per_rank[0]["grid"],
                            "wall_s": time.monotonic() - t0, "summary_us": summary,
                            "yardsticks": yard, "per_rank": per_rank, "fail": fails})
    path = Path(args.json) if args.json else (ROOT / "bench" / "results" / datetime.date.today()
                                               .isoformat() / ("ep_profile_%s_%s.json" % (
                                                   "gpu" if args.gpu else "cpu", args.transport)))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print("\nJSON: %s" % path)
    return rc


if __name__ == "__main__":
    sys.exit(main())
