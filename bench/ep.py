"""Benchmark of MoE expert-parallel low-latency dispatch / combine (gpunet.ep.Buffer).

DeepEP's workload and timing method (its tests/legacy/test_low_latency.py and utils/testing.py,
re-implemented here): hidden 7168, top-8, 288 experts, 128 tokens per rank, BF16 and FP8 dispatch,
BF16 combine, plus a sweep over tokens per rank. Each timed call is preceded by a barrier so that
launch skew between ranks does not count; warm-up calls first; the figure is the median over
iterations of the slowest rank's time in that iteration (min and max beside it).

Bytes are counted as DeepEP counts them, per *selection* (a (token, k) with topk_idx != -1) of the
rank's own tokens, local traffic included ("logical" bandwidth): BF16 dispatch 2H bytes, FP8
dispatch H + H/128*4 + 16 bytes, BF16 combine 2H bytes; GB/s = those bytes / median time.

Every configuration is first checked against gpunet.ep.reference (counts, layout, rows; FP8 rows
cast back within calc_diff 9e-4; combine of per-expert-scaled rows against the closed form within
calc_diff 1e-5). A failed check is a "test" row FAIL in the JSON's gate list.

Yardsticks, in the same run:
- torch gather (one process, the parent, after the ranks finish): all ranks' rows of one dispatch
  step gathered with index_select into the packed per-expert layout (the same rows the ranks move
  together on one GPU), and one rank's rows alone (FACTS.md's 16.3 us workload on an H200); the
  same rows moved back (index_select with the inverse order, the combine direction); and torch's
  weighted reduce (index_add_ in float32) for information. Targets (issue 10): dispatch within
  1.5x of the all-ranks gather, combine within 1.5x of the same gather time.
- "(device)" rows (GPU): the same calls and yardsticks timed again with the stream held by a
  sleep kernel before the start event (HOLD_S), so the host's enqueue (Python argument checks,
  allocations, the launch) is hidden and the events measure the GPU work alone, on both sides of
  the ratio, as DeepEP's kineto figures do; the rows without the suffix include whatever host time
  the GPU waited for. bench/ep_profile.py takes a call apart (host, phases on the device). On the
  CPU, --hold-us > 0 runs the same loops with nothing held (for the tests: no GPU-only code).
- NCCL all_to_all_single (GPU, one rank per GPU, 2+ GPUs): each rank sends each destination rank
  the rows of its tokens that have an expert there, once per destination rank (what gpunet sends),
  with starts aligned by an NCCL all_reduce before each call.

CPU (default): rank processes on the soft NIC, HOST-arm kernels, perf_counter, small sizes: these
figures show the machinery, not a network. GPU (--gpu): ranks share the GPUs round robin (2 and 4
ranks on one GPU need MPS: bench/ep_gpu.sh starts a private daemon), CUDA events.

Usage: python bench/ep.py [--gpu] [--ranks 2,4] [--sweep 16,32,64,128] [--transport p2p]
                         [--json PATH] [--plot PATH]
"""
import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))        # bench/machine.py

from machine import machine  # noqa: E402

CALC_DIFF_BF16 = 1e-5        # DeepEP's bound for BF16 paths (EP-ANCHORS.md §B.4)
CALC_DIFF_FP8 = 9e-4         # DeepEP's bound once rows went through FP8
TARGET_RATIO = 1.5           # issue 10: dispatch / combine within 1.5x of the torch gather
RANK_TIMEOUT_S = 1500        # whole rank run; each device wait inside Buffer is bounded itself
HOLD_S = 300e-6              # GPU: the "(device)" rows hold the stream this long before each timed
                             # call (torch.cuda._sleep), so the host's enqueue is hidden and the
                             # events time the GPU work alone (as DeepEP's kineto figures do)
DEVICE = " (device)"         # the suffix of those rows (ops and torch yardsticks alike)
HOLD_GPU_HZ = 2.0e9          # cycles per second assumed for torch.cuda._sleep (an upper bound: a
                             # slower clock only holds the stream longer)

CPU_DEFAULTS = dict(ranks="2", sweep="4,8,16", tokens=16, hidden=256, topk=4, experts=8,
                    iters=10, warmup=2)
GPU_DEFAULTS = dict(ranks="2,4", sweep="16,32,64,128", tokens=128, hidden=7168, topk=8,
                    experts=288, iters=50, warmup=10)


# ---------------------------------------------------------------------------------------------
# rank side

def hold_stream(seconds):
    """Queue a sleep of at least ``seconds`` on the current CUDA stream (torch.cuda._sleep at
    HOLD_GPU_HZ): what is enqueued after it starts when the sleep ends, not when the host
    enqueued it (bench/ep_profile.py --hold-us uses it too)."""
    import torch
    torch.cuda._sleep(int(seconds * HOLD_GPU_HZ))


class _Timer:
    """Times single calls: CUDA events on GPU (read after the run), perf_counter on CPU.

    ``hold_s`` > 0 (GPU): a sleep kernel of that length goes on the stream before the start
    event, so the call is enqueued while the GPU is still busy and the events time the GPU work
    alone, not the host's argument checks and launch; ``held`` records per call whether the
    stream had not yet reached the start event when the call was enqueued (the hold held).
    On the CPU nothing can be held (the HOST arm runs inside the call): ``hold_s`` > 0 times the
    calls as without it and records every call as not held, so the CPU tests run the "(device)"
    loops, which otherwise only a GPU would reach (5f92927 broke one that way)."""

    def __init__(self, gpu, hold_s=0.0):
        self.gpu = gpu
        self.hold_s = hold_s
        self.pending = []
        self.held = []

    def __call__(self, fn):
        import torch
        if self.gpu:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if self.hold_s:
                hold_stream(self.hold_s)
            s.record()
            out = fn()
            e.record()
            if self.hold_s:
                self.held.append(not s.query())
            self.pending.append((s, e))
            return out, None
        t0 = time.perf_counter()
        out = fn()
        if self.hold_s:
            self.held.append(False)
        return out, time.perf_counter() - t0

    def resolve(self, cpu_times):
        """Seconds per call, in call order."""
        import torch
        if not self.gpu:
            return list(cpu_times)
        torch.cuda.synchronize()
        out = [s.elapsed_time(e) * 1e-3 for s, e in self.pending]
        self.pending = []
        return out


def _aligner(gpu, nccl_group, ctx):
    """A function run before each timed call so every rank starts together.

    CPU: a gloo barrier (calls are synchronous there). GPU with an NCCL group (one rank per GPU):
    an NCCL all_reduce of one element, which the streams of all ranks leave together (DeepEP's
    barrier_comm_profiling). GPU without NCCL (ranks sharing a GPU, where NCCL refuses to run):
    gpunet's own device barrier enqueued on the stream (Context.barrier(blocking=False)), so the
    timed kernels start when the last rank arrives, not when each host launched them."""
    import torch
    import torch.distributed as dist

    if not gpu:
        return (lambda: dist.barrier()), "gloo barrier (host)"
    if nccl_group is not None:
        one = torch.ones(1, device="cuda")

        def align():
            dist.all_reduce(one, group=nccl_group)
        return align, "NCCL all_reduce on the stream (device-side)"

    def align():
        torch.cuda.current_stream().synchronize()        # keep the launch queue short
        ctx.barrier(blocking=False)
    return align, "gpunet device barrier on the stream (Context.barrier(blocking=False))"


def _rank_start(rank, world, cfg, **buffer_kwargs):
    """A bench rank's start (bench/ep.py, bench/ep_ht.py): on the GPU its device (rank % the device
    count) and, with one rank per GPU (and not cfg["no_nccl"]), an NCCL group; the Buffer with
    ``buffer_kwargs`` (explicitly destroyed; cfg's transport and timeout_s) and the aligner.
    Returns (buf, dev, nccl group or None, align, how it aligns)."""
    import torch
    import torch.distributed as dist

    from gpunet.ep import Buffer

    dev, nccl = "cpu", None
    if cfg["gpu"]:
        ngpu = torch.cuda.device_count()
        torch.cuda.set_device(rank % ngpu)
        dev = "cuda"
        if 2 <= world <= ngpu and not cfg["no_nccl"]:
            nccl = dist.new_group(backend="nccl")
    buf = Buffer(dist.group.WORLD, explicitly_destroy=True, transport=cfg["transport"],
                 timeout_s=cfg["timeout_s"], **buffer_kwargs)
    align, how = _aligner(cfg["gpu"], nccl, buf.runtime)
    return buf, dev, nccl, align, how


def _expert_scale(num_experts, device):
    """Per global expert, a power of two (0.5, 1, 2) so scaled bf16 rows stay exact and combine
    shows which expert a row came back from."""
    import torch
    return torch.pow(2.0, (torch.arange(num_experts, device=device) % 3 - 1).float())


def _check_dispatch(out, want, use_fp8):
    """Compare Buffer's dispatch result with ll_dispatch_ref's; returns a failure string or ''."""
    import torch

    from gpunet.ep import reference as ref

    recv, count, handle = out[0], out[1], out[2]
    w_x, w_count, w_src, w_layout = want
    if not torch.equal(count.cpu(), w_count):
        return "counts %s != reference %s" % (count.cpu().tolist(), w_count.tolist())
    src, layout = handle[0].cpu(), handle[1].cpu()
    if not torch.equal(layout, w_layout):
        return "layout_range differs from the reference"
    for le in range(w_count.numel()):
        n = int(w_count[le])
        if not torch.equal(src[le, :n], w_src[le, :n]):
            return "src_info of local expert %d differs" % le
        if not n:
            continue
        if use_fp8:
            back = ref.per_token_cast_back(recv[0][le, :n].cpu(), recv[1][le, :n].cpu())
            d = ref.calc_diff(back, w_x[le, :n])
            if not d <= CALC_DIFF_FP8:                      # also catches NaN
                return "FP8 rows of local expert %d: calc_diff %.3g > %g" % (le, d, CALC_DIFF_FP8)
        elif not torch.equal(recv[le, :n].cpu(), w_x[le, :n]):
            return "BF16 rows of local expert %d differ from the reference" % le
    return ""


def ll_recv_pool_bytes(cfg, world):
    """The LL Buffer's recv_pool_bytes: cfg["recv_pool_mib"] MiB, or (-1) with GPUNET_EP_LL_DIRECT=1
    room for 4 BF16 dispatches' recv_x and src_info at the sweep's largest tokens, + 64 MiB (with
    every peer p2p on this GPU the dispatch then runs direct, ll.cuh "The direct dispatch"; the
    timing loop holds one result at a time, the smaller sweep points and the FP8 calls leave
    torch's cached blocks), else none (the message path)."""
    from gpunet import config
    mib = cfg.get("recv_pool_mib", -1)
    if mib >= 0 or config.get("GPUNET_EP_LL_DIRECT") != "1":
        return max(mib, 0) << 20
    e_loc, rows = cfg["experts"] // world, world * max(cfg["sweep"])
    per_call = e_loc * rows * (2 * cfg["hidden"] + 4)
    return (4 * per_call + (64 << 20)) // (1 << 20) * (1 << 20)


def _rank_bench(rank, world, cfg):
    """One rank: for each tokens-per-rank point, check dispatch/combine against the reference,
    then time dispatch (BF16, FP8) and combine pairs; NCCL rows when one rank per GPU."""
    import torch
    import torch.distributed as dist

    from gpunet.ep import Buffer
    from gpunet.ep import reference as ref
    from gpunet.ep.demo import buffer_transport

    gpu = cfg["gpu"]
    H, K, E = cfg["hidden"], cfg["topk"], cfg["experts"]
    e_loc = E // world
    t_cap = max(cfg["sweep"])
    hint = Buffer.get_low_latency_rdma_size_hint(t_cap, H, world, E)
    buf, dev, nccl, align, align_how = _rank_start(rank, world, cfg, num_rdma_bytes=hint,
                                                   low_latency_mode=True, num_qps_per_rank=e_loc,
                                                   recv_pool_bytes=ll_recv_pool_bytes(cfg, world))
    scale = _expert_scale(E, dev)
    results = {"rank": rank, "points": [], "align": align_how,
               "transport": buffer_transport(buf),
               "bf16_dispatch": "direct" if buf._ll_direct_ok() else "messages"}
    try:
        for T in cfg["sweep"]:
            ins = ref.make_rank_inputs(world, T, H, K, E, cfg["seed"] + T, holes=cfg["holes"])
            x = ins[rank]["x"].to(dev)
            tk = ins[rank]["topk_idx"].to(dev)
            w = ins[rank]["topk_weights"].to(dev)
            xs = [i["x"] for i in ins]
            tks = [i["topk_idx"] for i in ins]
            point = {"tokens": T, "selections": int((tk != -1).sum()), "fail": []}
            # --- correctness, once per point ----------------------------------------------------
            want = ref.ll_dispatch_ref(xs, tks, E, T, rank)
            for use_fp8 in (False, True):
                out = buf.low_latency_dispatch(x, tk, T, E, use_fp8=use_fp8)
                bad = _check_dispatch(out, want, use_fp8)
                if bad:
                    point["fail"].append("dispatch %s: %s" % ("fp8" if use_fp8 else "bf16", bad))
            # receive tensors are held only while needed: each is a pool call's room (direct)
            del out
            recv, _, handle, _, _ = buf.low_latency_dispatch(x, tk, T, E, use_fp8=False)
            local_scale = scale[rank * e_loc:(rank + 1) * e_loc].view(-1, 1, 1)
            expert_out = (recv.float() * local_scale).to(torch.bfloat16)
            del recv
            combined = buf.low_latency_combine(expert_out, tk, w, handle)[0]
            valid = (tk != -1).float()
            wsum = (w.float() * valid * scale[tk.clamp(min=0)]).sum(1, keepdim=True)
            d = ref.calc_diff(combined.float().cpu(), (x.float() * wsum).cpu())
            point["combine_calc_diff"] = d
            if not d <= CALC_DIFF_BF16:
                point["fail"].append("combine: calc_diff %.3g > %g" % (d, CALC_DIFF_BF16))
            # --- timing: aligned dispatch / combine pairs; then (GPU) the same with the stream
            # held before each call: the "(device)" rows, GPU time without the host's share -----
            laps = {}
            timings = [("", _Timer(gpu))]
            if cfg.get("hold_s", 0) > 0:
                timings.append((DEVICE, _Timer(gpu, cfg["hold_s"])))
            for suffix, timer in timings:
                laps["combine" + suffix] = []
                for use_fp8 in (False, True):
                    name = ("dispatch fp8" if use_fp8 else "dispatch bf16") + suffix
                    d_cpu, c_cpu = [], []
                    for _ in range(cfg["warmup"] + cfg["iters"]):
                        align()
                        (o, dt) = timer(lambda: buf.low_latency_dispatch(x, tk, T, E, use_fp8=use_fp8))
                        d_cpu.append(dt)
                        align()
                        (_, dt) = timer(lambda: buf.low_latency_combine(expert_out, tk, w, o[2]))
                        c_cpu.append(dt)
                        o = None        # not alive during the next dispatch (two calls' room)
                    times = timer.resolve([v for pair in zip(d_cpu, c_cpu) for v in pair])
                    dts, cts = times[0::2], times[1::2]
                    laps[name] = dts[cfg["warmup"]:]
                    laps["combine" + suffix] += cts[cfg["warmup"]:]
                if timer.hold_s:
                    point["held_fraction"] = sum(timer.held) / max(1, len(timer.held))
            point["laps_s"] = laps
            # --- NCCL all_to_all_single with the rows gpunet sends --------------------------------
            if nccl is not None:
                point["nccl"] = _nccl_point(x, tk, world, e_loc, cfg, align, nccl)
            results["points"].append(point)
        if buf._pool is not None and buf._pool.exhausted:
            # (CUDA) the Buffer stops using a pool that once had no room: the calls after it ran
            # the message path, and the table's head says so
            results["bf16_dispatch"] += " until the receive pool ran out (then messages)"
    finally:
        buf.destroy()
    everyone = [None] * world
    dist.all_gather_object(everyone, results)
    return everyone if rank == 0 else None


def _nccl_point(x, tk, world, e_loc, cfg, align, group):
    """all_to_all_single of this rank's rows, once per destination rank that holds one of the
    token's experts; returns {"laps_s", "bytes_per_rank"}."""
    import torch
    import torch.distributed as dist

    dest = (tk.clamp(min=0) // e_loc)
    sends = [((dest == d) & (tk != -1)).any(1).nonzero().view(-1) for d in range(world)]
    rows = torch.cat(sends)
    inp = x.index_select(0, rows)
    in_splits = torch.tensor([s.numel() for s in sends], device=x.device)
    out_splits = torch.empty_like(in_splits)
    dist.all_to_all_single(out_splits, in_splits, group=group)
    out = torch.empty(int(out_splits.sum()), x.shape[1], dtype=x.dtype, device=x.device)
    ins, outs = in_splits.tolist(), out_splits.tolist()
    timer = _Timer(True)
    for _ in range(cfg["warmup"] + cfg["iters"]):
        align()
        timer(lambda: dist.all_to_all_single(out, inp, outs, ins, group=group))
    laps = timer.resolve(None)[cfg["warmup"]:]
    return {"laps_s": laps, "bytes_per_rank": inp.numel() * inp.element_size()}


# ---------------------------------------------------------------------------------------------
# one-process torch yardsticks

def _torch_yardsticks(cfg, world, T):
    """index_select gathers into the packed per-expert layout and back, and torch's weighted
    index_add_ reduce, for the routing of ``world`` ranks at T tokens each; medians in seconds."""
    import torch

    from gpunet.ep import reference as ref

    gpu = cfg["gpu"]
    dev = "cuda" if gpu else "cpu"
    H, K, E = cfg["hidden"], cfg["topk"], cfg["experts"]
    ins = ref.make_rank_inputs(world, T, H, K, E, cfg["seed"] + T, holes=cfg["holes"])
    X = torch.cat([i["x"] for i in ins]).to(dev)                       # [R*T, H]
    all_tk = torch.cat([i["topk_idx"] for i in ins])                    # [R*T, K]
    W = torch.cat([i["topk_weights"] for i in ins])

    def packed_index(sources):
        # packed order: expert, then source rank, then token (the contract's layout); a token
        # naming one expert twice is one row
        idx, wts = [], []
        for e in range(E):
            for j in sources:
                sel = (all_tk[j * T:(j + 1) * T] == e)
                toks = sel.any(1).nonzero().view(-1)
                idx.append(toks + j * T)
                wts.append((W[j * T:(j + 1) * T] * sel).sum(1)[toks])
        return torch.cat(idx).to(dev), torch.cat(wts).to(dev)

    out = {}
    timings = [("", _Timer(gpu))]
    if cfg.get("hold_s", 0) > 0:
        timings.append((DEVICE, _Timer(gpu, cfg["hold_s"])))
    for label, sources in (("all ranks", range(world)), ("one rank", [0])):
        idx, wts = packed_index(list(sources))
        packed = torch.empty(idx.numel(), H, dtype=X.dtype, device=dev)
        inv = torch.argsort(idx, stable=True)
        back = torch.empty_like(packed)
        red = torch.zeros(X.shape[0], H, dtype=torch.float32, device=dev)
        cases = {"gather": lambda: torch.index_select(X, 0, idx, out=packed),
                 "gather back": lambda: torch.index_select(packed, 0, inv, out=back),
                 "index_add reduce": lambda: red.zero_().index_add_(
                     0, idx, packed.float() * wts.view(-1, 1)).to(torch.bfloat16)}
        for (suffix, timer), (name, fn) in ((t, c) for t in timings for c in cases.items()):
            cpu = []
            for i in range(cfg["warmup"] + cfg["iters"]):
                cpu.append(timer(fn)[1])
            laps = timer.resolve(cpu)[cfg["warmup"]:]
            out["%s%s, %s" % (name, suffix, label)] = {"median_s": statistics.median(laps),
                                                       "rows": idx.numel(),
                                                       "bytes": idx.numel() * H * 2}
    return out


# ---------------------------------------------------------------------------------------------
# report

def _stats(laps):
    laps = sorted(laps)
    return {"median_us": statistics.median(laps) * 1e6, "min_us": laps[0] * 1e6,
            "max_us": laps[-1] * 1e6}


def _rows_for(cfg, world, per_rank, yard):
    """Table rows (dicts) for one rank count from every rank's results and the yardsticks."""
    from gpunet.ep import reference as ref

    rows, gate = [], []
    H = cfg["hidden"]
    for pi, T in enumerate(cfg["sweep"]):
        pts = [r["points"][pi] for r in per_rank]
        fails = ["rank %d: %s" % (r, f) for r, p in enumerate(pts) for f in p["fail"]]
        sel = [p["selections"] for p in pts]
        for op in [o for o in pts[0]["laps_s"]]:
            base, dev_rows = op.replace(DEVICE, ""), op.endswith(DEVICE)
            # each row against the gather timed the same way (held stream or not)
            gather = yard[T]["gather%s, all ranks" % (DEVICE if dev_rows else "")]["median_s"]
            # per iteration the slowest rank; then median over iterations
            step = [max(v) for v in zip(*[p["laps_s"][op] for p in pts])]
            st = _stats(step)
            nbytes = max(sel) * ref.selection_bytes(H, base)
            row = {"ranks": world, "tokens": T,
                   "op": (base if base != "combine" else "combine bf16") + (DEVICE if dev_rows else ""),
                   **st, "bytes_per_rank": nbytes,
                   "GBps": nbytes / (st["median_us"] * 1e-6) / 1e9,
                   "rank_medians_us": [statistics.median(p["laps_s"][op]) * 1e6 for p in pts],
                   "vs_torch_gather": st["median_us"] * 1e-6 / gather,
                   "check": "FAIL" if fails else "OK"}
            if dev_rows:
                row["held_fraction"] = min(p.get("held_fraction", 0.0) for p in pts)
            if "nccl" in pts[0] and not dev_rows:
                nst = _stats([max(v) for v in zip(*[p["nccl"]["laps_s"] for p in pts])])
                row["nccl_median_us"] = nst["median_us"]
                row["nccl_bytes_per_rank"] = max(p["nccl"]["bytes_per_rank"] for p in pts)
                row["vs_nccl"] = st["median_us"] / nst["median_us"]
            rows.append(row)
        for name, y in yard[T].items():
            rows.append({"ranks": world, "tokens": T, "op": "torch " + name,
                         "median_us": y["median_s"] * 1e6, "bytes_per_rank": y["bytes"],
                         "rows": y["rows"], "GBps": y["bytes"] / y["median_s"] / 1e9})
        gate.append({"kind": "test", "name": "EP %d ranks, %d tokens: matches the reference"
                     % (world, T), "result": "FAIL" if fails else "PASS",
                     "figure": "; ".join(fails)[:300] or "counts, layout, rows, combine calc_diff "
                     "%.2g" % max(p["combine_calc_diff"] for p in pts),
                     "goal": "exact BF16 layout; FP8 calc_diff <= %g; combine <= %g"
                     % (CALC_DIFF_FP8, CALC_DIFF_BF16)})
        if T == cfg["tokens"]:
            for op in [o + sfx for sfx in ("", DEVICE) for o in ("dispatch bf16", "combine bf16")]:
                r = next((r for r in rows if r["tokens"] == T and r["op"] == op), None)
                if r is None:
                    continue
                g_us = r["median_us"] / r["vs_torch_gather"]
                gate.append({"kind": "target", "name": "EP %d ranks, %d tok: %s vs torch gather"
                             % (world, T, op), "result": "met" if r["vs_torch_gather"] <=
                             TARGET_RATIO else "NOT met",
                             "figure": "%.1f us = %.2fx the gather (%.1f us)%s"
                             % (r["median_us"], r["vs_torch_gather"], g_us,
                                "; stream held in %.0f%% of calls" % (100 * r["held_fraction"])
                                if "held_fraction" in r else ""),
                             "goal": "<= %.1fx" % TARGET_RATIO})
    return rows, gate


BYTES_NOTE = ("bytes/rank as DeepEP counts (the rank with the most): selections (topk != -1) x "
              "(BF16 dispatch 2H | FP8 "
              "dispatch H + H/128*4 + 16 | BF16 combine 2H), local traffic included; GB/s = "
              "bytes / median; time = median over iterations of the slowest rank")


def _table(rows, cfg, head):
    lines = [head, BYTES_NOTE, ""]
    fmt = "%5s %6s  %-34s %10s %10s %10s %9s %8s %8s  %s"
    lines.append(fmt % ("ranks", "tokens", "op", "median us", "min us", "max us", "GB/s",
                        "x gather", "x NCCL", "check"))
    lines.append("-" * 124)
    for r in rows:
        lines.append(fmt % (r["ranks"], r["tokens"], r["op"], "%.1f" % r["median_us"],
                            "%.1f" % r["min_us"] if "min_us" in r else "",
                            "%.1f" % r["max_us"] if "max_us" in r else "",
                            "%.3g" % r["GBps"],
                            "%.2f" % r["vs_torch_gather"] if "vs_torch_gather" in r else "",
                            "%.2f" % r["vs_nccl"] if "vs_nccl" in r else "",
                            r.get("check", "")))
    return "\n".join(lines)


def _plot(rows, path, title):
    from gpunet.demo import pyplot, save_figure
    plt = pyplot()
    if plt is None:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ops = sorted({r["op"] for r in rows if not r["op"].startswith("torch") or "all ranks" in r["op"]})
    worlds = sorted({r["ranks"] for r in rows})
    colors = {op: "C%d" % i for i, op in enumerate(ops)}          # colour = op, marker = ranks
    markers = dict(zip(worlds, "os^Dv*"))
    for world in worlds:
        for op in ops:
            pts = sorted((r["tokens"], r["median_us"], r["GBps"]) for r in rows
                         if r["ranks"] == world and r["op"] == op)
            if not pts:
                continue
            kw = dict(color=colors[op], marker=markers[world], label="%d ranks: %s" % (world, op),
                      linestyle="--" if op.startswith("torch") else "-")
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], **kw)
            ax2.plot([p[0] for p in pts], [p[2] for p in pts], **kw)
    for ax, yl in ((ax1, "latency, median (us)"),
                   (ax2, "GB/s (gpunet: DeepEP's count per rank; torch: rows moved)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel(yl)
        ax.grid(True, alpha=0.3)
    ax1.set_yscale("log")
    ax2.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true", help="CUDA tensors, CUDA events, DeepEP sizes")
    ap.add_argument("--ranks", help="rank counts to run, e.g. 2,4 (default: CPU 2, GPU 2,4)")
    ap.add_argument("--sweep", help="tokens per rank to sweep (includes --tokens)")
    ap.add_argument("--tokens", type=int, help="the headline tokens per rank (targets use it)")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--topk", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--iters", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--holes", type=int, default=10, help="-1 entries per rank (DeepEP: 10)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--transport", default="auto", choices=("auto", "ibgda", "proxy", "p2p"),
                    help="gpunet.init's transport (auto: p2p between ranks of one node on CUDA, "
                         "the soft NIC's ibgda on the CPU; ibgda / proxy: the soft NIC, also on "
                         "a GPU; on CUDA the heap is device memory, p2p peers open it by CUDA IPC)")
    ap.add_argument("--timeout-s", type=float, default=100.0, help="Buffer's device wait bound")
    ap.add_argument("--hold-us", type=float,
                    help="the '(device)' rows hold the stream this long before each timed call "
                         "(default %g on a GPU, 0 on the CPU; 0: no such rows; on the CPU a value "
                         "> 0 runs their loops without a hold, for the tests)" % (HOLD_S * 1e6))
    ap.add_argument("--no-nccl", action="store_true", help="skip the NCCL rows")
    ap.add_argument("--json", help="default bench/results/<date>/ep_<cpu|gpu>.json")
    ap.add_argument("--plot", help="PNG path (default: beside the JSON)")
    ap.add_argument("--mode", default="ll", choices=("ll", "ht"),
                    help="ll: the low-latency rows (this file); ht: the high-throughput rows "
                         "(bench/ep_ht.py: 4096 tokens, a Config sweep, the gather yardstick)")
    ap.add_argument("--recv-pool-mib", type=int, default=-1,
                    help="the Buffer's receive pool (recv_pool_bytes) in MiB: p2p peers store "
                         "rows straight into the receive tensors (ll: the direct dispatch, with "
                         "GPUNET_EP_LL_DIRECT=1 and the peers on this GPU); -1 (default): room for "
                         "10 HT calls' receive tensors, or for 4 LL calls' with "
                         "GPUNET_EP_LL_DIRECT=1 (else none); 0: none (ll: messages; ht: the rings)")
    ap.add_argument("--ht-configs",
                    help="ht: the Config sweep as num_sms:chunk:ring:warps,... (default: bench/ep_ht.py "
                         "GPU_CONFIGS / CPU_CONFIGS)")
    ap.add_argument("--ht-device-config",
                    help="ht: profile and time the '(device)' rows of every op at this Config of the "
                         "sweep (num_sms:chunk:ring:warps), so that A/B runs compare one Config; "
                         "default: each op's Config whose slowest rank was fastest in the sweep")
    args = ap.parse_args(argv)
    if args.hold_us is None:
        args.hold_us = HOLD_S * 1e6 if args.gpu else 0.0
    if args.mode == "ht":
        import ep_ht
        return ep_ht.run(args)
    d = GPU_DEFAULTS if args.gpu else CPU_DEFAULTS
    for k, v in d.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    ranks = [int(v) for v in str(args.ranks).split(",")]
    sweep = sorted({int(v) for v in str(args.sweep).split(",")} | {args.tokens})
    for r in ranks:
        if r < 1 or args.experts % r:
            ap.error("--experts %d must be a multiple of every rank count (%d)" % (args.experts, r))
    if args.hidden % 128:
        ap.error("--hidden must be a multiple of 128")
    if args.gpu:
        import torch
        if not torch.cuda.is_available():
            print("bench/ep.py --gpu needs an NVIDIA GPU (torch.cuda.is_available() is False)",
                  file=sys.stderr)
            return 2
    cfg = dict(gpu=args.gpu, hold_s=args.hold_us * 1e-6, sweep=sweep, tokens=args.tokens,
               hidden=args.hidden, topk=args.topk, experts=args.experts, iters=args.iters, warmup=args.warmup, holes=args.holes,
               seed=args.seed, transport=args.transport, timeout_s=args.timeout_s,
               no_nccl=args.no_nccl, recv_pool_mib=args.recv_pool_mib)
    from gpunet.demo import run_ranks
    from gpunet.errors import GpunetError

    rows, gate, runs = [], [], []
    for world in ranks:
        print("[bench/ep] %d ranks, tokens %s, hidden %d, top-%d, %d experts (%s)"
              % (world, sweep, args.hidden, args.topk, args.experts,
                 "GPU" if args.gpu else "CPU soft NIC"), file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            per_rank = run_ranks(_rank_bench, world, cfg, timeout_s=RANK_TIMEOUT_S)
        except GpunetError as e:
            # the run is recorded as a failed test row (the gate reads it), and the next rank
            # count still runs
            print("[bench/ep] %d ranks FAILED: %s" % (world, e), file=sys.stderr, flush=True)
            gate.append({"kind": "test", "name": "EP %d ranks: bench ran" % world,
                         "result": "FAIL", "figure": str(e)[-300:], "goal": "every rank finishes"})
            runs.append({"ranks": world, "error": str(e)})
            continue
        yard = {T: _torch_yardsticks(cfg, world, T) for T in sweep}
        r, g = _rows_for(cfg, world, per_rank, yard)
        rows += r
        gate += g
        runs.append({"ranks": world, "align": per_rank[0]["align"],
                     "transport": per_rank[0]["transport"], "wall_s": time.monotonic() - t0,
                     "bf16_dispatch": per_rank[0]["bf16_dispatch"]})
    m = machine(gpu=args.gpu)
    head = ("gpunet EP low-latency bench, %s, %s; hidden %d, top-%d, %d experts, %d holes/rank, "
            "%d iters (+%d warm-up); BF16 dispatch: %s; alignment: %s"
            % ("GPU " + m.get("gpu", "?") if args.gpu else "CPU soft NIC + HOST arm", m["date"],
               args.hidden, args.topk, args.experts, args.holes, args.iters, args.warmup,
               ", ".join(sorted({r.get("bf16_dispatch", "failed") for r in runs})),
               "; ".join("%d ranks: %s" % (r["ranks"], r.get("align", "failed")) for r in runs)))
    print(_table(rows, cfg, head))
    if args.transport != "auto":        # one gate row set per transport: names must not collide
        for g in gate:
            g["name"] += " [%s]" % args.transport
    for g in gate:
        print("%-6s %-7s %s  %s" % (g["kind"], g["result"], g["name"], g["figure"]))
    path = Path(args.json) if args.json else (ROOT / "bench" / "results" / datetime.date.today()
                                               .isoformat() / ("ep_%s.json" % ("gpu" if args.gpu
                                                                              else "cpu")))
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {"what": "gpunet.ep low-latency dispatch/combine", "bytes": BYTES_NOTE,
           "config": {k: v for k, v in cfg.items()}, "runs": runs, "rows": rows, "gate": gate,
           "machine": m}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    png = _plot(rows, args.plot or str(path.with_suffix(".png")), head[:120]) if rows else None
    print("\nJSON: %s\nplot: %s" % (path, png or "not saved (no matplotlib)"))
    return 1 if any(g["kind"] == "test" and g["result"] != "PASS" for g in gate) else 0


if __name__ == "__main__":
    sys.exit(main())
