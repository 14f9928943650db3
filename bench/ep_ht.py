"""Benchmark of MoE expert-parallel HIGH-THROUGHPUT dispatch / combine (gpunet.ep.Buffer's
dispatch / combine), run as ``python bench/ep.py --mode ht [...]`` (bench/ep.py hands over here).

DeepEP's intranode workload and method (its tests/legacy/test_intranode.py, re-implemented):
4096 tokens per rank, hidden 7168, top-8, 256 experts, 10 -1 holes per rank; BF16 and FP8
dispatch, BF16 combine, and the BF16 dispatch with num_worst_tokens (every token of every rank:
no host wait, the notify and the data phase in one launch, as under a CUDA graph); a sweep over
Configs (channels = num_sms / 2, send chunk, receive ring) picks the best Config for each op
(DeepEP's "best config" search); the rows report the best. Each timed call follows a barrier (launch skew does not count);
warm-up calls first; the figure is the median over iterations of the slowest rank's time.

Bytes are counted as DeepEP counts them in that test: a rank's received rows x 2H (BF16 dispatch,
"NVL recv bytes" = recv_x.numel() * 2), x (1 + 4/128) / 2 of that for FP8, and the same count for
the BF16 combine (it sends those rows back); GB/s = the bytes of the rank that receives the most
/ the median time.

Checks first (a failure is a "test" gate row FAIL): the BF16 dispatch equals
gpunet.ep.reference.ht_dispatch_ref bit for bit (rows, local expert ids, weights, counts), and
combine of the received rows / fan-out is within DeepEP's calc_diff 5e-6 of x.

Yardsticks in the same run: the one-process torch gather of the same rows (all ranks' received
rows gathered with index_select from all ranks' tokens, on one device; FACTS.md: 200 us on an
H200; target: dispatch and combine each within 1.5x of it) and, with one rank per GPU (2+ GPUs),
NCCL all_to_all_single of the same rows (target: gpunet ahead of it).

GPU, "(device)" rows: the same ops at each op's chosen Config, each call timed after a hold of
the stream (bench/ep.py --hold-us, HOLD_S), and the gather timed the same way: the host's work
before the first launch is hidden (as in a step whose GPU is still busy with earlier work), the
host's wait for the dispatch's notify inside the call is not. Targets are listed for both. On
the CPU, --hold-us > 0 runs that loop with nothing held (the tests' way to reach it).
"(default Config)" rows: a dispatch and a combine without a Config (get_dispatch_config /
get_combine_config at Buffer.num_sms, the default warps: what a DeepEP caller that passes none
gets), host-timed.
"""
import statistics
import sys
import time

CALC_DIFF_BF16 = 5e-6
TARGET_RATIO = 1.5
RANK_TIMEOUT_S = 1500
CPU_DEFAULTS = dict(ranks="2", tokens=96, hidden=256, topk=4, experts=8, iters=5, warmup=1)
GPU_DEFAULTS = dict(ranks="2", tokens=4096, hidden=7168, topk=8, experts=256, iters=10, warmup=2)
# (num_sms, send chunk, receive ring, warps per block): the sweep; the HOST arm caps channels at 2.
# The warps are gpunet's own knob (Buffer._ht_warps; DeepEP's Config has none): with 128 registers
# a thread (nvcc -Xptxas -v) a block of 16 warps fills an SM's register file, so 2 ranks sharing
# the GPU fit 132 SMs up to num_sms 64 each.
# The list: chunks of 64 in rings of 256, the best dispatch of the 2026-12-07 sweeps
# (bench/RESULTS.md "thirty-seventh session": the BF16 dispatch device-timed 0.94-0.98x the time
# of (64, 48, 128, 16) on an H100 and 0.91-0.97x on an H200, 3 of 3 alternated pairs each; the
# combine the same on the H100, 2-3% slower on the H200: the sweep takes each op's best Config),
# the best of the 2026-12-06 sweep ("twenty-sixth session": chunks of 48 in rings of 128), the
# best of the 2026-12-02 sweeps ("sixth session"), and one small-ring config per geometry.
# ((64, 8, 48, 16), the slowest in every sweep since the twenty-sixth session, is left out.)
GPU_CONFIGS = [(64, 64, 256, 16), (64, 48, 128, 16), (64, 16, 128, 16), (64, 32, 128, 16), (64, 16, 64, 16),
               (128, 16, 64, 8), (48, 16, 128, 16)]
CPU_CONFIGS = [(4, 4, 48, 2), (4, 8, 64, 2)]
PROFILE_CALLS = 5       # per op, with the device stamps on (after the sweep, best Config)
# The timed ops; "dispatch bf16 worst" is the BF16 dispatch with num_worst_tokens (no host wait).
# "combine bf16" combines the dispatch's recv_x itself (as DeepEP's intranode test does): with a
# receive pool it lies in the pool, and p2p peers that may load load its rows in place (ht.cuh
# "the in-place combine"); "combine bf16 ring" combines a copy in torch memory (an expert output
# the caller allocated), whose rows go through the rings.
OPS = ("dispatch bf16", "dispatch fp8", "combine bf16", "combine bf16 ring", "dispatch bf16 worst")


def _rank_bench(rank, world, cfg):
    import torch
    import torch.distributed as dist

    from gpunet.ep import Config
    from gpunet.ep import reference as ref
    from gpunet.ep.demo import buffer_transport
    import ep as ll_bench                       # bench/ep.py: the rank start, the timer

    gpu = cfg["gpu"]
    T, H, K, E = cfg["tokens"], cfg["hidden"], cfg["topk"], cfg["experts"]
    configs = [Config(*c[:3]) for c in cfg["configs"]]
    warps = [c[3] for c in cfg["configs"]]
    nbytes = max(c.get_nvl_buffer_size_hint(H * 2, world)
                 for c in configs + list(default_configs(world).values()))
    pool = recv_pool_bytes(cfg, world)
    buf, dev, nccl, align, align_how = ll_bench._rank_start(rank, world, cfg, num_nvl_bytes=nbytes,
                                                            low_latency_mode=False, recv_pool_bytes=pool)
    res = {"rank": rank, "align": align_how, "transport": buffer_transport(buf), "fail": [],
           "buffer_bytes": nbytes, "recv_pool_bytes": pool}
    try:
        ins = ref.make_rank_inputs(world, T, H, K, E, cfg["seed"], holes=cfg["holes"])
        x = ins[rank]["x"].to(dev)
        tk = ins[rank]["topk_idx"].to(dev)
        w = ins[rank]["topk_weights"].to(dev)
        ntr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(tk, E)
        xq = tuple(t.to(dev) for t in ref.per_token_cast_to_fp8(ins[rank]["x"]))
        kw = dict(is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=tk, topk_weights=w)
        # --- correctness, once ------------------------------------------------------------------
        rx, rtk, rw, counts, handle, _ = buf.dispatch(x, config=configs[0], **kw)
        want = ref.ht_dispatch_ref([i["x"] for i in ins], [i["topk_idx"] for i in ins],
                                   [i["topk_weights"] for i in ins], E, rank)
        if not torch.equal(rx.cpu(), want["recv_x"]) or not torch.equal(rtk.cpu(), want["recv_topk_idx"]) \
                or not torch.equal(rw.cpu(), want["recv_topk_weights"]) or counts != want["counts"]:
            res["fail"].append("dispatch differs from ht_dispatch_ref")
        comb, _, _ = buf.combine(rx, handle, config=configs[0])
        # the same rows from torch memory go through the rings: the same sums, bit for bit
        if not torch.equal(buf.combine(rx.clone(), handle, config=configs[0])[0], comb):
            res["fail"].append("combine of recv_x (in place) differs from combine of its copy (the rings)")
        fan = in_rank.sum(1, keepdim=True).clamp(min=1).float().cpu()
        reach = in_rank.any(1).cpu()
        d = ref.calc_diff(comb.float().cpu()[reach] / fan[reach], x.float().cpu()[reach]) if bool(reach.any()) else 0.0
        res["combine_calc_diff"] = d
        if not d <= CALC_DIFF_BF16:
            res["fail"].append("combine / fan-out vs x: calc_diff %.3g > %g" % (d, CALC_DIFF_BF16))
        res["recv_rows"] = int(rx.shape[0])
        res["recv_in_pool"] = buf._pool is not None and buf._pool.contains(rx)
        # the pool's room is for the calls the timing loops hold at once, not for these
        del rx, rtk, rw, handle, comb
        # --- the Config sweep ---------------------------------------------------------------------
        timer = ll_bench._Timer(gpu)

        def laps(fn, timer=timer):
            cpu = []
            for _ in range(cfg["warmup"] + cfg["iters"]):
                align()
                cpu.append(timer(fn)[1])
            return timer.resolve(cpu)[cfg["warmup"]:]

        # "dispatch bf16 worst": num_worst_tokens = every token of every rank (no host wait: the
        # notify and the data phase run as one launch, as under a CUDA graph)
        sweep = {op: [] for op in OPS}
        worst = T * world

        held = {}

        def calls_at(i):
            """The timed calls at Config i (its warps set on the Buffer). The combine's input is one
            dispatch's output, held for the last Config asked only (``held``): each Config's held in
            the sweep ran the receive pool out (sessions 28-33: 7 Configs x 132 MB), so the later
            Configs and the "(device)" rows measured the ring path, not the pool's in-place
            stores."""
            buf._ht_warps = warps[i]
            if held.get("i") != i:
                held.clear()            # the last Config's output goes before this one's comes
                c = configs[i]
                # combine uses the dispatch's channels: a handle made with this Config's num_sms
                y, _, _, _, h, _ = buf.dispatch(x, config=c, **kw)
                y_torch = y.clone()     # not in the receive pool: "combine bf16 ring"
                held.update(i=i, calls={
                    "dispatch bf16": lambda: buf.dispatch(x, config=c, **kw),
                    "combine bf16": lambda: buf.combine(y, h, config=c),
                    "combine bf16 ring": lambda: buf.combine(y_torch, h, config=c),
                    "dispatch fp8": lambda: buf.dispatch(xq, config=c, **kw),
                    "dispatch bf16 worst": lambda: buf.dispatch(x, config=c, num_worst_tokens=worst, **kw)})
            return held["calls"]

        for i in range(len(configs)):
            for op, fn in calls_at(i).items():
                sweep[op].append(laps(fn))
        res["sweep"] = sweep
        # where the time goes, per op, at the Config fastest for the slowest rank, chosen by
        # every rank alike: device stamps of every block (ht.cuh HT_ST_*)
        every = [None] * world
        dist.all_gather_object(every, {op: [statistics.median(l) for l in lapsets]
                                       for op, lapsets in sweep.items()})
        res["profile"], res["device"] = {}, {}
        at = cfg.get("device_config")           # --ht-device-config: one Config for every op
        choice = {op: cfg["configs"].index(at) for op in sweep} if at else profile_choice(every)
        res["choice"] = choice
        for op, i in choice.items():
            res["profile"][op] = _profile(buf, calls_at(i)[op], align, gpu, cfg["configs"][i])
        # the "(device)" rows (GPU): the same calls at the same Config with the stream held before
        # each (bench/ep.py HOLD_S): the host's work before the first launch is hidden, its wait
        # for the notify inside the call is not (CPU, --hold-us > 0: the same loop, nothing held)
        if cfg.get("hold_s", 0) > 0:
            hold = ll_bench._Timer(gpu, cfg["hold_s"])    # (not `held`: calls_at's memo)
            for op, i in choice.items():
                res["device"][op] = laps(calls_at(i)[op], hold)
            res["held_fraction"] = sum(hold.held) / max(1, len(hold.held))
        buf._ht_warps = None
        held.clear()
        # what a caller that passes no Config gets (get_dispatch_config / get_combine_config, the
        # default warps): the "(default Config)" rows, host-timed like the sweep
        y, _, _, _, h, _ = buf.dispatch(x, **kw)
        res["default"] = {"dispatch bf16": laps(lambda: buf.dispatch(x, **kw)),
                          "combine bf16": laps(lambda: buf.combine(y, h))}
        if nccl is not None:
            res["nccl"] = _nccl(x, in_rank, world, cfg, align, nccl, timer)
        # (CUDA: a pool that once had no room is not tried again: the rows after it used torch
        # memory, the ring path; the table says so next to the pool's size)
        res["pool_ran_out"] = bool(buf._pool is not None and buf._pool.exhausted)
    finally:
        buf.destroy()
    everyone = [None] * world
    dist.all_gather_object(everyone, res)
    return everyone if rank == 0 else None


def profile_choice(medians):
    """The Config index each op is profiled at, the same on every rank: medians[r][op][i] is rank
    r's median time of op at Config i; the choice is the Config whose slowest rank is fastest
    (the table's figure). Each rank picking its own fastest made the ranks call with different
    Configs when two were close (H100, twenty-fourth session: 2 of 4 runs ended in the
    ConfigError "a peer's call disagrees", rightly raised by the kernels' header check)."""
    out = {}
    for op in medians[0]:
        slowest = [max(m[op][i] for m in medians) for i in range(len(medians[0][op]))]
        out[op] = min(range(len(slowest)), key=slowest.__getitem__)
    return out


def _profile(buf, fn, align, gpu, config):
    """PROFILE_CALLS calls of fn with the HT kernels' stamps on (gpunet/ep/buffer.py
    _set_profile; names in gpunet/device/ep.py HT_ST_NAMES). Per call: host (perf_counter around the
    Python call), notify (block 0 of the notify launch: begin .. headers posted .. every source's
    header seen), gap (notify end .. the data launch's first block in: the host's sync and
    allocations between the two launches), kernel (the data launch's first block in .. last block
    out), and per role (sender blocks = even, receiver blocks = odd) the medians over blocks of
    what thread 0 summed: move (staging / p2p stores; receiver: copies / reduction), post (puts +
    signals; receiver: credits), idle (steps that moved nothing: waiting for credit / data), steps,
    idle steps, items, and first (block in .. first chunk moved). Medians over the calls, us."""
    import torch

    from gpunet.device import ep as dep
    names = dep.HT_ST_NAMES
    col = {n: i for i, n in enumerate(names)}
    dev = "cuda" if gpu else "cpu"
    stamps = torch.zeros(2 * dep.HT_MAX_CHANNELS * dep.STAMPS, dtype=torch.int64, device=dev)
    per_call = []
    buf._set_profile(stamps)
    try:
        for _ in range(PROFILE_CALLS):
            stamps.zero_()
            align()
            t0 = time.perf_counter()
            fn()
            host = time.perf_counter() - t0
            if gpu:
                torch.cuda.synchronize()
            st = stamps.view(-1, dep.STAMPS)[:, :len(names)].cpu().tolist()
            per_call.append(_phases(st, col, host))
    finally:
        buf._set_profile(None)
    keys = sorted({k for c in per_call for k in c})
    return {"config": config, **{k: statistics.median([c[k] for c in per_call if k in c]) for k in keys}}


def _phases(st, col, host_s):
    """One call's figures (us, counts) from its stamp rows [blocks][HT_ST_NAMES]."""
    us = lambda ns: ns / 1e3  # noqa: E731
    out = {"host": host_s * 1e6}
    blocks = [r for r in st if r[col["begin"]]]
    r0 = st[0]
    if r0[col["notify_begin"]]:
        out["notify"] = us(r0[col["notify_end"]] - r0[col["notify_begin"]])
        out["notify.hdr"] = us(r0[col["notify_sent"]] - r0[col["notify_begin"]])
        out["notify.pos"] = us(r0[col["notify_pos"]] - r0[col["notify_begin"]])
        if blocks:
            out["gap"] = us(min(r[col["begin"]] for r in blocks) - r0[col["notify_end"]])
    if not blocks:
        return out
    out["kernel"] = us(max(r[col["end"]] for r in blocks) - min(r[col["begin"]] for r in blocks))
    for role, parity in (("send", 0), ("recv", 1)):
        rows = [r for i, r in enumerate(st) if i % 2 == parity and r[col["begin"]]]
        if not rows:
            continue
        med = lambda v: statistics.median(v)  # noqa: E731
        for k in ("t_move", "t_post", "t_idle"):
            out["%s.%s" % (role, k[2:])] = us(med([r[col[k]] for r in rows]))
        for k in ("steps", "idle_steps", "items"):
            out["%s.%s" % (role, k)] = med([r[col[k]] for r in rows])
        out["%s.first" % role] = us(med([r[col["first"]] - r[col["begin"]] for r in rows if r[col["first"]]] or [0]))
        out["%s.span" % role] = us(med([r[col["end"]] - r[col["begin"]] for r in rows]))
    return out


def _nccl(x, in_rank, world, cfg, align, group, timer):
    """all_to_all_single of this rank's rows, once per destination rank in is_token_in_rank."""
    import torch
    import torch.distributed as dist

    sends = [in_rank[:, d].nonzero().view(-1) for d in range(world)]
    inp = x.index_select(0, torch.cat(sends))
    in_splits = torch.tensor([s.numel() for s in sends], device=x.device)
    out_splits = torch.empty_like(in_splits)
    dist.all_to_all_single(out_splits, in_splits, group=group)
    out = torch.empty(int(out_splits.sum()), x.shape[1], dtype=x.dtype, device=x.device)
    ins, outs = in_splits.tolist(), out_splits.tolist()
    cpu = []
    for _ in range(cfg["warmup"] + cfg["iters"]):
        align()
        cpu.append(timer(lambda: dist.all_to_all_single(out, inp, outs, ins, group=group))[1])
    return {"laps_s": timer.resolve(cpu)[cfg["warmup"]:], "bytes_per_rank": inp.numel() * 2}


def _gather_yardstick(cfg, world, hold_s=0.0):
    """The same rows gathered by one process on one device: every rank's received rows (in the HT
    layout) index_select-ed from all ranks' tokens; median seconds and rows. ``hold_s`` > 0: each
    call timed after a hold of the stream (the "(device)" rows' method)."""
    import torch

    from gpunet.ep import reference as ref
    dev = "cuda" if cfg["gpu"] else "cpu"
    T, H, K, E = cfg["tokens"], cfg["hidden"], cfg["topk"], cfg["experts"]
    ins = ref.make_rank_inputs(world, T, H, K, E, cfg["seed"], holes=cfg["holes"])
    X = torch.cat([i["x"] for i in ins]).to(dev)
    e_loc = E // world
    idx = []
    for d in range(world):
        for j in range(world):
            tk = ins[j]["topk_idx"]
            sel = ((tk >= d * e_loc) & (tk < (d + 1) * e_loc)).any(1).nonzero().view(-1)
            idx.append(sel + j * T)
    idx = torch.cat(idx).to(dev)
    out = torch.empty(idx.numel(), H, dtype=X.dtype, device=dev)
    import ep as ll_bench
    timer = ll_bench._Timer(cfg["gpu"], hold_s)
    cpu = []
    for _ in range(cfg["warmup"] + cfg["iters"]):
        cpu.append(timer(lambda: torch.index_select(X, 0, idx, out=out))[1])
    return statistics.median(timer.resolve(cpu)[cfg["warmup"]:]), idx.numel()


def default_configs(world):
    """The Configs a caller that passes none gets, per op of the "(default Config)" rows."""
    from gpunet.ep import Buffer
    return {"dispatch bf16": Buffer.get_dispatch_config(world), "combine bf16": Buffer.get_combine_config(world)}


def _config_tuple(c, gpu):
    """(num_sms, send chunk, receive ring, warps) of a Config at the arm's default warps."""
    from gpunet.ep import buffer as B
    return (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            B.CUDA_HT_WARPS if gpu else B.HOST_HT_WARPS)


def _op_row(world, cfg, op, config, laps, nbytes, gather_s, fails):
    """A table row of one op: the slowest rank's laps' stats, bytes, GB/s and the gather ratio."""
    import ep as ll_bench
    st = ll_bench._stats(laps)
    return {"ranks": world, "tokens": cfg["tokens"], "op": op, "config": config, **st,
            "bytes_per_rank": nbytes, "GBps": nbytes / (st["median_us"] * 1e-6) / 1e9,
            "vs_torch_gather": st["median_us"] * 1e-6 / gather_s, "check": "FAIL" if fails else "OK"}


def _configs(args):
    """The sweep: --ht-configs "num_sms:chunk:ring:warps,..." or the defaults for the arm."""
    if not args.ht_configs:
        return GPU_CONFIGS if args.gpu else CPU_CONFIGS
    return _parse_configs(args.ht_configs, "--ht-configs")


def _parse_configs(text, what):
    """"num_sms:chunk:ring:warps,..." as a list of 4-tuples of ints (``what`` names the option)."""
    out = []
    for item in text.split(","):
        vals = tuple(int(v) for v in item.split(":"))
        if len(vals) != 4:
            raise SystemExit("%s: %r is not num_sms:chunk:ring:warps" % (what, item))
        out.append(vals)
    return out


def recv_pool_bytes(cfg, world):
    """The Buffer's recv_pool_bytes: cfg["recv_pool_mib"] MiB, or (-1) room for 10 calls' BF16
    receive tensors (rows, src_idx, top-k ids and weights) of world x tokens rows, + 64 MiB: the
    timing loops hold one dispatch's output (the combine's input) and torch keeps cached blocks of
    each call's sizes (BF16, FP8, num_worst_tokens) in the pool."""
    mib = cfg.get("recv_pool_mib", -1)
    if mib >= 0:
        return mib << 20
    row = 2 * cfg["hidden"] + 12 * cfg["topk"] + 4
    return (10 * world * cfg["tokens"] * row + (64 << 20)) // (1 << 20) * (1 << 20)


def run(args):
    """Called by bench/ep.py main() with its parsed args (--mode ht). Returns the exit code."""
    import datetime
    import json
    from pathlib import Path

    import ep as ll_bench
    from gpunet.demo import run_ranks
    from gpunet.errors import GpunetError
    from machine import machine

    d = GPU_DEFAULTS if args.gpu else CPU_DEFAULTS
    for k, v in d.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    ranks = [int(v) for v in str(args.ranks).split(",")]
    cfg = dict(gpu=args.gpu, tokens=args.tokens, hidden=args.hidden, topk=args.topk,
               experts=args.experts, iters=args.iters, warmup=args.warmup, holes=args.holes,
               seed=args.seed, transport=args.transport, timeout_s=args.timeout_s,
               no_nccl=args.no_nccl, configs=_configs(args), recv_pool_mib=getattr(args, "recv_pool_mib", -1),
               hold_s=args.hold_us * 1e-6)   # (bench/ep.py main sets its default)
    if getattr(args, "ht_device_config", None):
        at = _parse_configs(args.ht_device_config, "--ht-device-config")
        if len(at) != 1 or at[0] not in cfg["configs"]:
            raise SystemExit("--ht-device-config: %r is not one Config of the sweep %s"
                             % (args.ht_device_config, cfg["configs"]))
        cfg["device_config"] = at[0]
    rows, gate, runs = [], [], []
    for world in ranks:
        print("[bench/ep ht] %d ranks, %d tokens, hidden %d, top-%d, %d experts (%s)"
              % (world, cfg["tokens"], cfg["hidden"], cfg["topk"], cfg["experts"],
                 "GPU" if args.gpu else "CPU soft NIC"), file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            per = run_ranks(_rank_bench, world, cfg, timeout_s=RANK_TIMEOUT_S)
            step = lambda lapsets: [max(v) for v in zip(*lapsets)]  # noqa: E731 - slowest rank per iteration
            ops = OPS
            med = {op: [statistics.median(step([p["sweep"][op][i] for p in per]))
                        for i in range(len(cfg["configs"]))] for op in ops}
            best = {op: min(range(len(cfg["configs"])), key=lambda i: med[op][i]) for op in ops}
        except GpunetError as e:
            print("[bench/ep ht] %d ranks FAILED: %s" % (world, e), file=sys.stderr, flush=True)
            gate.append({"kind": "test", "name": "EP HT %d ranks: bench ran" % world, "result": "FAIL",
                         "figure": str(e)[-300:], "goal": "every rank finishes"})
            runs.append({"ranks": world, "error": str(e)})
            continue
        gather_s, gather_rows = _gather_yardstick(cfg, world)
        held = all(p.get("device") for p in per)
        gather_dev_s = _gather_yardstick(cfg, world, cfg["hold_s"])[0] if held else None
        fails = ["rank %d: %s" % (p["rank"], f) for p in per for f in p["fail"]]
        recv = max(p["recv_rows"] for p in per)
        H = cfg["hidden"]
        nbytes = {"dispatch bf16": recv * H * 2, "combine bf16": recv * H * 2, "combine bf16 ring": recv * H * 2,
                  "dispatch fp8": int(recv * H * 2 * (1 + 4 / 128) / 2), "dispatch bf16 worst": recv * H * 2}
        for i, c in enumerate(cfg["configs"]):
            for op in ops:
                rows.append({"ranks": world, "tokens": cfg["tokens"], "op": "sweep " + op,
                             "config": c, "median_us": med[op][i] * 1e6,
                             "GBps": nbytes[op] / med[op][i] / 1e9})
        laps = {op: step([p["sweep"][op][best[op]] for p in per]) for op in ops}
        for op in ops:
            row = _op_row(world, cfg, "HT " + op, cfg["configs"][best[op]], laps[op], nbytes[op], gather_s, fails)
            if "nccl" in per[0]:
                nst = ll_bench._stats(step([p["nccl"]["laps_s"] for p in per]))
                row["nccl_median_us"] = nst["median_us"]
                row["vs_nccl"] = row["median_us"] / nst["median_us"]
            rows.append(row)
        rows.append({"ranks": world, "tokens": cfg["tokens"], "op": "torch gather, all ranks' rows",
                     "median_us": gather_s * 1e6, "rows": gather_rows,
                     "GBps": gather_rows * H * 2 / gather_s / 1e9})
        for op, c in default_configs(world).items():
            rows.append(_op_row(world, cfg, "HT " + op + " (default Config)", _config_tuple(c, args.gpu),
                                step([p["default"][op] for p in per]), nbytes[op], gather_s, fails))
        if held:
            for op in ops:     # (timed at the ranks' choice: profile_choice or --ht-device-config)
                rows.append(_op_row(world, cfg, "HT " + op + ll_bench.DEVICE, cfg["configs"][per[0]["choice"][op]],
                                    step([p["device"][op] for p in per]), nbytes[op], gather_dev_s, fails))
            rows.append({"ranks": world, "tokens": cfg["tokens"],
                         "op": "torch gather" + ll_bench.DEVICE + ", all ranks' rows",
                         "median_us": gather_dev_s * 1e6, "rows": gather_rows,
                         "GBps": gather_rows * H * 2 / gather_dev_s / 1e9})
        gate.append({"kind": "test", "name": "EP HT %d ranks: matches the reference" % world,
                     "result": "FAIL" if fails else "PASS",
                     "figure": "; ".join(fails)[:300] or "rows exact, combine calc_diff %.2g"
                     % max(p["combine_calc_diff"] for p in per),
                     "goal": "exact dispatch; combine / fan-out calc_diff <= %g" % CALC_DIFF_BF16})
        for op in [o + sfx for sfx in ("",) + ((ll_bench.DEVICE,) if held else ())
                   for o in ("dispatch bf16", "combine bf16")]:
            r = next(r for r in rows if r["op"] == "HT " + op and r["ranks"] == world)
            g_s = gather_dev_s if op.endswith(ll_bench.DEVICE) else gather_s
            gate.append({"kind": "target", "name": "EP HT %d ranks, %d tok: %s vs torch gather"
                         % (world, cfg["tokens"], op),
                         "result": "met" if r["vs_torch_gather"] <= TARGET_RATIO else "NOT met",
                         "figure": "%.1f us = %.2fx the gather (%.1f us), %.3g GB/s"
                         % (r["median_us"], r["vs_torch_gather"], g_s * 1e6, r["GBps"]),
                         "goal": "<= %.1fx" % TARGET_RATIO})
        profile = {op: [p["profile"][op] for p in per] for op in ops}
        runs.append({"ranks": world, "align": per[0]["align"], "transport": per[0]["transport"],
                     "profile": profile, "held_fraction": [p.get("held_fraction") for p in per],
                     "buffer_bytes": per[0]["buffer_bytes"], "recv_pool_bytes": per[0]["recv_pool_bytes"],
                     "recv_in_pool": [p["recv_in_pool"] for p in per],
                     "pool_ran_out": [p.get("pool_ran_out", False) for p in per],
                     "best": {k: cfg["configs"][v] for k, v in best.items()},
                     "wall_s": time.monotonic() - t0})
    m = machine(gpu=args.gpu)
    head = ("gpunet EP high-throughput bench, %s, %s; %d tokens/rank, hidden %d, top-%d, %d experts, "
            "%d holes/rank, %d iters (+%d warm-up)" % (
                "GPU " + m.get("gpu", "?") if args.gpu else "CPU soft NIC + HOST arm", m["date"],
                cfg["tokens"], cfg["hidden"], cfg["topk"], cfg["experts"], cfg["holes"], cfg["iters"],
                cfg["warmup"]))
    def pool_note(r):
        if not r["recv_pool_bytes"]:
            return "none"
        out = [i for i, v in enumerate(r["pool_ran_out"]) if v]
        return "%d MiB (receive tensors in it on ranks %s%s)" % (
            r["recv_pool_bytes"] >> 20, [i for i, v in enumerate(r["recv_in_pool"]) if v],
            "; it RAN OUT on ranks %s: their later calls used torch memory and the rings" % out if out else "")
    pools = sorted({pool_note(r) for r in runs if "recv_pool_bytes" in r})
    note = ("bytes/rank as DeepEP's intranode test counts them: received rows x 2H (FP8: x (1+4/128)/2), "
            "combine the same; the rank receiving most; time = median over iterations of the slowest "
            "rank; Config = (num_sms, send chunk, receive ring); receive pool: %s" % ", ".join(pools))
    print(head)
    print(note)
    fmt = "%5s %6s  %-34s %-14s %10s %9s %8s %8s  %s"
    print(fmt % ("ranks", "tokens", "op", "config", "median us", "GB/s", "x gather", "x NCCL", "check"))
    for r in rows:
        print(fmt % (r["ranks"], r["tokens"], r["op"], str(tuple(r["config"])) if "config" in r else "",
                     "%.1f" % r["median_us"], "%.3g" % r["GBps"],
                     "%.2f" % r["vs_torch_gather"] if "vs_torch_gather" in r else "",
                     "%.2f" % r["vs_nccl"] if "vs_nccl" in r else "", r.get("check", "")))
    if args.transport != "auto":
        for g in gate:
            g["name"] += " [%s]" % args.transport
    for run_ in runs:
        for op, ranks_ in run_.get("profile", {}).items():
            for rk, pr in enumerate(ranks_):
                print("profile %d ranks, rank %d, %s %s: %s" % (
                    run_["ranks"], rk, op, tuple(pr["config"]),
                    ", ".join("%s %.4g" % (k, v) for k, v in pr.items() if k != "config")))
    for g in gate:
        print("%-6s %-7s %s  %s" % (g["kind"], g["result"], g["name"], g["figure"]))
    path = Path(args.json) if args.json else (Path(__file__).resolve().parent / "results" /
                                               datetime.date.today().isoformat() /
                                               ("ep_ht_%s.json" % ("gpu" if args.gpu else "cpu")))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"what": "gpunet.ep high-throughput dispatch/combine", "bytes": note,
                   "config": {k: v for k, v in cfg.items()}, "runs": runs, "rows": rows, "gate": gate,
                   "machine": m}, f, indent=1)
    print("\nJSON: %s" % path)
    return 1 if any(g["kind"] == "test" and g["result"] != "PASS" for g in gate) else 0
