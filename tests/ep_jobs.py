"""Jobs the EP tests run on every rank (tests/mp_ranks.py runs "ep_jobs:<name>"): build a
gpunet.ep.Buffer, run low-latency dispatch / combine rounds on inputs every rank regenerates from
one seed (so each rank can compute every rank's reference with gpunet.ep.reference), and report
what it checked plus the hashes of what it got (``rounds``: several back to back). Each job
takes the rank's ``state`` dict first.

A round's ``spec`` (a dict): seed, t_max, hidden, topk, num_experts; routing knobs holes,
hot_expert, empty_experts, vary_tokens, tagged; modes use_fp8, round_scale, use_ue8m0, hook,
combine_hook, zero_copy, stats; failures: masked (ranks already masked), die = (rank, "dispatch" |
"combine") (that rank exits at the start of that phase, the others expect it masked from then on)
or (rank, seconds) (that rank exits that long after the round starts, wherever it is then; each
other rank expects it masked in a phase exactly when it masked it by the phase's end);
routing = "rank_repeats" (rank_repeating_routing replaces the top-k), wire (record what the
dispatch put on the wire: wire_prepare / wire_read); slow = (rank, seconds[, "combine"]) (that
rank sleeps before its dispatch, or before its combine: a late peer, or with a short timeout a
transient fault), masked_by_rank =
{rank: (masked in dispatch, masked in combine)} (what each rank expects masked when the ranks
disagree, as after a transient fault); victim_masks = ranks the dying rank (die) masks locally
before its dispatch, so its last dispatch reaches only the others.
"""
import os
import threading
import time

import torch
import torch.distributed as dist

from gpunet._launch import to_host
from gpunet.ep import Buffer, EPTimeout
from gpunet.ep import _layout as lay
from gpunet.ep import reference as ref
from gpunet.errors import GpunetError


def e4m3_cases():
    """float32 values that pin down a float -> e4m3fn cast: every e4m3 value, every midpoint between
    neighbours (ties to even) and its two float32 neighbours, the subnormal range, values past 448
    (saturated), +-inf, zeros, both signs; and NaNs of both signs last (2 values)."""
    import numpy as np
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    vals = codes[~torch.isnan(codes)].unique().numpy().astype(np.float32)
    mids = ((vals[1:].astype(np.float64) + vals[:-1]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    edge = np.array([0.0, -0.0, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -9, 2.0 ** -6, 448, 449, 464, 465,
                     479.9, 480, 512, 1e6, 3e38, np.inf, -np.inf, 1e-40, -1e-45], dtype=np.float32)
    nan = np.array([np.nan, -np.nan], dtype=np.float32)
    return np.concatenate([vals, mids, near, edge, -mids, -edge, nan]).astype(np.float32)


def make_buffer(state, transport, **kwargs):
    """This rank's Buffer (explicitly destroyed: close()) in state["ep_buf"], with Buffer's
    ``kwargs``; ``transport`` is gpunet.init's, or "mixed" (the pair (a, b) uses the proxy when
    a + b is odd, ibgda otherwise), or "p2p+proxy" (tests/p2p_jobs.py's p2p_and_proxy). Returns
    the rank, its transports per peer and its pid. The LL and HT jobs' init both come here."""
    if transport == "mixed":
        transport = lambda a, b: "proxy" if (a + b) % 2 else "ibgda"  # noqa: E731 - symmetric per pair
    elif transport == "p2p+proxy":
        import p2p_jobs
        transport = p2p_jobs.p2p_and_proxy
    buf = Buffer(dist.group.WORLD, explicitly_destroy=True, transport=transport, **kwargs)
    state["ep_buf"] = buf
    return {"rank": buf.rank, "transports": dict(buf.runtime.transports), "pid": os.getpid(),
            "ll_world_flags": buf._ll_world_flags(), "ll_lib": str(buf._lib.gpunet_path)}


def init(state, transport, num_rdma_bytes, timeout_s=20.0, shrink=False, warp_size=32,
         num_blocks=None, block_threads=None, recv_pool_bytes=0):
    """Make this rank's Buffer (low-latency mode); ``transport`` as make_buffer's; the grid the
    Buffer's default unless given; ``recv_pool_bytes`` > 0 with every peer p2p makes the BF16
    dispatch direct (ll.cuh "The direct dispatch")."""
    return make_buffer(state, transport, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                       enable_shrink=shrink, timeout_s=timeout_s, warp_size=warp_size,
                       num_blocks=num_blocks, block_threads=block_threads,
                       recv_pool_bytes=recv_pool_bytes)


def direct_exit_build(state, victim):
    """Rank ``victim`` loads the LL kernels built with GPUNET_TEST_LL_EXIT_AFTER_COUNTS: its next
    direct dispatch exits the process after the count round, before any row."""
    buf = state["ep_buf"]
    if buf.rank == victim:
        from gpunet.device import ep as dep
        buf._lib = dep.load_ep("host", defines={"GPUNET_TEST_LL_EXIT_AFTER_COUNTS": 1},
                               kinds=buf._build_kinds)
    return buf.rank


def pool_hog(state, ranks, nbytes):
    """On the ranks in ``ranks``: hold (state["hog"]) a tensor of ``nbytes`` from the Buffer's
    receive pool, so a dispatch's receive tensors no longer fit there (that rank then takes
    messages: not a direct destination); ``nbytes`` 0 lets it go. Returns the pool's free bytes."""
    buf = state["ep_buf"]
    state.pop("hog", None)
    if buf.rank in ranks and nbytes:
        state["hog"] = buf._pool.empty((nbytes,), torch.uint8)
        assert state["hog"] is not None
    return buf.recv_pool_bytes - buf._pool.used_bytes()


def clean_failing_before_launch(state, spec, failing_rank):
    """clean_low_latency_buffer on every rank, whose launch raises on ``failing_rank`` (as a
    launch that failed), then low_latency_clean_mask_buffer on every rank (vLLM's recovery), then
    an LL round. Returns (what the first clean raised or None, the ranks masked after the
    recovery, the round's output)."""
    buf = state["ep_buf"]
    raised = None
    if buf.rank == failing_rank:
        def no_launch(*a, **kw):
            raise GpunetError("injected: the clean's launch failed")
        buf._launch = no_launch
    try:
        buf.clean_low_latency_buffer(spec["t_max"], spec["hidden"], spec["num_experts"])
    except Exception as e:  # noqa: BLE001 - the test checks the type
        raised = type(e).__name__
    finally:
        buf.__dict__.pop("_launch", None)
    buf.low_latency_clean_mask_buffer()
    masked = buf.masked_ranks()
    return raised, masked, round_(state, spec)


def buffer_variants(state, variants, num_rdma_bytes):
    """For each (bad_rank, kwargs) in ``variants``: every rank makes a low-latency Buffer over
    ibgda, the bad rank with ``kwargs`` on top of good ones. Returns each call's outcome
    (mp_jobs._outcome: the gpunet error class, message, seconds); a Buffer made is destroyed."""
    from mp_jobs import _outcome
    out = []
    for bad_rank, kwargs in variants:
        made = []

        def call():
            args = dict(num_rdma_bytes=num_rdma_bytes, low_latency_mode=True, timeout_s=10.0,
                        warp_size=32)
            if dist.get_rank() == bad_rank:
                args.update(kwargs)
            made.append(Buffer(dist.group.WORLD, explicitly_destroy=True, transport="ibgda", **args))

        out.append(_outcome(call))
        for b in made:
            b.destroy()
    return out


def heap_paths(state):
    """How this rank's heap is reached: {device_heap (Context._device_heap), ctl_mirror (the
    Buffer reads its control block through a copy), dma_copies and dma_error (the soft NIC's
    copy-engine calls so far and its last error), dma_peers (peers whose heap this rank's NIC
    maps for its copy engine)}."""
    buf = state["ep_buf"]
    ctx = buf.runtime
    st = ctx.nic.stats()
    return {"device_heap": ctx._device_heap, "ctl_mirror": buf._ctl_mirror,
            "dma_copies": st.get("dma_copies", 0), "dma_error": st.get("dma_error", 0),
            "dma_peers": sorted(ctx._transports.dma_heaps)}


def check_device_heap_rounds(info, transport):
    """Every rank of two_rank_rounds(transport, GPUNET_HEAP_MEMORY=device): over ``transport``
    only, its heap device memory read through the control mirror, the peer's heap mapped for its
    NIC's copy engine, copies made and none failed."""
    for i in info:
        h = i["heap"]
        assert set(i["transports"].values()) == {transport}, i
        assert h["device_heap"] and h["ctl_mirror"], h
        assert h["dma_peers"] == [1 - i["rank"]] and h["dma_copies"] > 0 and h["dma_error"] == 0, h


def close(state):
    buf = state.pop("ep_buf", None)
    if buf is not None:
        buf.destroy()
    return "closed"


def rank_repeating_routing(num_tokens, topk, num_experts, num_ranks, source, seed):
    """int64 [num_tokens, topk]: a routing where tokens select SEVERAL experts on one rank.
    Token t of rank ``source`` has a home rank (t + source) % num_ranks (so with num_tokens >=
    num_ranks every rank is some token's home): 2 .. min(topk, E_loc) distinct experts there, the
    rest distinct experts elsewhere, the columns shuffled; every third token has one -1 hole
    outside its home, and the last token (when num_tokens > num_ranks) selects nothing at all.
    Same arguments, same tensor. Needs min(topk, E_loc) >= 2 and topk <= num_experts."""
    el = num_experts // num_ranks
    assert min(topk, el) >= 2 and topk <= num_experts, (topk, el, num_experts)
    gen = torch.Generator().manual_seed(int(seed) * 7907 + source)
    out = torch.empty(num_tokens, topk, dtype=torch.int64)
    for t in range(num_tokens):
        home = (t + source) % num_ranks
        n_home = 2 + int(torch.randint(min(topk, el) - 1, (1,), generator=gen))
        on = home * el + torch.randperm(el, generator=gen)[:n_home]
        others = torch.tensor([e for e in range(num_experts) if e // el != home], dtype=torch.int64)
        off = others[torch.randperm(others.numel(), generator=gen)[:topk - n_home]]
        if t % 3 == 2 and off.numel():
            off[0] = -1
        row = torch.cat([on, off])
        out[t] = row[torch.randperm(topk, generator=gen)]
    if num_tokens > num_ranks:
        out[-1] = -1
    return out


def pairs_per_rank(topks, num_experts):
    """From the routing alone, in plain torch (``topks``: every rank's topk_idx): [source,
    destination] counts of the unique (token, destination rank) pairs (what goes on the wire when
    a token goes ONCE to each rank it selects) and of the (token, selected expert) pairs (once
    per expert), and per (source, destination) the tokens of those pairs in token order."""
    world = len(topks)
    e_loc = num_experts // world
    per_rank = torch.zeros(world, world, dtype=torch.int64)
    per_expert = torch.zeros(world, world, dtype=torch.int64)
    tokens = {}
    for j, tk in enumerate(topks):
        t_of = torch.arange(tk.shape[0]).view(-1, 1).expand_as(tk)
        live = tk >= 0
        dest = tk[live] // e_loc
        pairs = torch.unique(torch.stack([t_of[live], dest]), dim=1)   # sorted by token, then rank
        per_rank[j] = torch.bincount(pairs[1], minlength=world)
        per_expert[j] = torch.bincount(dest, minlength=world)
        for r in range(world):
            tokens[j, r] = pairs[0][pairs[1] == r].tolist()
    return per_rank, per_expert, tokens


def telling_pairs(topks, num_experts):
    """pairs_per_rank of a routing that tells once-per-rank from once-per-expert: asserts that
    EVERY (source, destination) has more (token, expert) than (token, rank) pairs, so a dispatch
    sending per expert would break every count the once-per-rank tests check."""
    per_rank, per_expert, tokens = pairs_per_rank(topks, num_experts)
    assert bool((per_expert > per_rank).all()), \
        "the routing does not tell once-per-rank from once-per-expert: %s vs %s" % (
            per_rank.tolist(), per_expert.tolist())
    return per_rank, per_expert, tokens


def spec_rank_inputs(spec, world, tokens):
    """ref.make_rank_inputs for a job spec's shape and routing options, ``tokens`` per rank
    (the LL jobs' t_max, the HT jobs' tokens)."""
    return ref.make_rank_inputs(world, tokens, spec["hidden"], spec["topk"],
                                spec["num_experts"], spec["seed"], holes=spec.get("holes", 0),
                                hot_expert=spec.get("hot_expert"),
                                empty_experts=spec.get("empty_experts", ()),
                                vary_tokens=spec.get("vary_tokens", False),
                                tagged=spec.get("tagged", False))


def _inputs(spec, world):
    return with_routing(spec, spec_rank_inputs(spec, world, spec["t_max"]), world)


def with_routing(spec, inputs, world):
    """``inputs`` with spec["routing"] applied (the LL and HT jobs' _inputs, and the tests)."""
    if spec.get("routing") == "rank_repeats":
        for j, d in enumerate(inputs):
            d["topk_idx"] = rank_repeating_routing(d["topk_idx"].shape[0], spec["topk"],
                                                   spec["num_experts"], world, j, spec["seed"])
    return inputs


def wire_prepare(buf, spec):
    """Before a dispatch that records its wire (spec["wire"]): fill this rank's dispatch receive
    area of the LL buffer the call will use (gpunet/ep/_layout.py: source j's message slot s at
    d_recv + (j * t_max + s) * msg_stride, the meta after the payload, its first int32 the token
    index) with 0xFF bytes, so a slot no message reached reads token -1; then a barrier, so no
    rank's dispatch starts before every rank's area is filled. Returns what wire_read needs."""
    world = buf.group_size
    layout = lay.LlLayout(spec["t_max"], spec["hidden"], world, spec["num_experts"])
    stride, payload = lay.msg_stride(spec["hidden"], spec.get("use_fp8", False))
    off = layout.buffers[buf._ll_idx]["d_recv"]     # the buffer this dispatch will use
    rdma = buf.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
    area = rdma[off:off + world * spec["t_max"] * stride]
    area.fill_(0xFF)
    if area.is_cuda:
        torch.cuda.synchronize()                    # the fill is done before any peer writes
    dist.barrier()
    return area, stride, payload


def wire_read(buf, spec, prepared):
    """After the dispatch (and its hook): {nrecv: the messages each source's header announced
    (the receive phase unpacks exactly that many; Buffer._nrecv_np, what EPTimeout.counts_seen
    reports), slot_tokens: per source, the token index in each of its t_max message slots here
    (-1: no message landed there; this rank's own slots are not used when it reads its own
    send staging, so they are reported as None)}."""
    area, stride, payload = prepared
    world, rank, t_max = buf.group_size, buf.rank, spec["t_max"]
    nrecv = [int(v) for v in buf._nrecv_np[:world]]
    slots = _cpu(area).view(world * t_max, stride)[:, payload:payload + 4].contiguous().view(torch.int32)
    toks = slots.view(world, t_max).tolist()
    return {"nrecv": nrecv, "slot_tokens": [None if j == rank else toks[j] for j in range(world)]}


def _decode(recv, use_fp8):
    """The expert side's input as bf16 [E_loc, R*T_max, H] (fp8 cast back with its scales)."""
    if not use_fp8:
        return recv
    q, s = recv
    el, rows, h = q.shape
    out = ref.per_token_cast_back(q.reshape(el * rows, h), s.reshape(el * rows, -1))
    return out.view(el, rows, h).to(torch.bfloat16)


def _expert(x_in, rank, e_loc):
    """A deterministic 'expert': row * (1 + (global expert id) / 64), in bf16."""
    scale = 1.0 + (torch.arange(e_loc, dtype=torch.float32) + rank * e_loc) / 64.0
    return (x_in.float() * scale.view(-1, 1, 1)).to(torch.bfloat16)


def _device(buf):
    return "cuda" if buf.runtime.platform.name == "cuda" else "cpu"


def _cpu(obj):
    """Tensors (also inside tuples) moved to the CPU for checking, through gpunet's to_host (the
    stream synchronized first: a .cpu() queued behind an EP kernel that waits for NIC-set data
    holds up the soft NIC's copies on device heaps, bench/copy_engine_stall.py); everything else
    as is."""
    if isinstance(obj, torch.Tensor):
        return to_host(obj)
    if isinstance(obj, tuple):
        return tuple(_cpu(o) for o in obj)
    return obj


def _hook_findings(what, hook, requested):
    """DeepEP's hook contract: a callable with return_recv_hook, None without (its C++ returns an
    empty std::optional)."""
    if requested and not callable(hook):
        return ["%s(return_recv_hook=True) returned hook %r, not a callable" % (what, hook)]
    if not requested and hook is not None:
        return ["%s(return_recv_hook=False) returned hook %r, not None (DeepEP's)" % (what, hook)]
    return []


def _hashes(d):
    return {k: ref.hash_tensor(v) for k, v in d.items() if isinstance(v, torch.Tensor)}


def _valid(t, count):
    """The rows [0, count[e]) of every local expert e of a packed tensor (or column-major scales),
    concatenated: what a rerun must reproduce bit for bit (the rest is unspecified)."""
    if t is None:
        return None
    parts = []
    for e in range(t.shape[0]):
        rows = t[e, :int(count[e])].flatten()
        parts.append(rows.new_empty(rows.shape).copy_(rows).view(torch.uint8))  # stride 1
    return torch.cat(parts)


def _ref_dispatch(spec, inputs, rank, masked):
    return ref.ll_dispatch_ref([i["x"] for i in inputs], [i["topk_idx"] for i in inputs],
                               spec["num_experts"], spec["t_max"], rank, masked_ranks=masked,
                               use_fp8=spec.get("use_fp8", False),
                               round_scale=spec.get("round_scale", False),
                               use_ue8m0=spec.get("use_ue8m0", False))


def _check_dispatch(spec, world, rank, inputs, got, masked):
    """Compare a dispatch result with the reference and with DeepEP's own checks; returns a list
    of findings (empty: all held)."""
    use_fp8 = spec.get("use_fp8", False)
    recv_x, count, handle = got
    src_info, layout_range = handle[0], handle[1]
    topks = [i["topk_idx"] for i in inputs]
    want_x, want_count, want_src, want_lr = _ref_dispatch(spec, inputs, rank, masked)
    bad = []
    if not torch.equal(count, want_count):
        bad.append("counts %s != reference %s" % (count.tolist(), want_count.tolist()))
    if not torch.equal(layout_range, want_lr):
        bad.append("layout_range differs from the reference")
    if tuple(handle[2:]) != (spec["t_max"], spec["hidden"], spec["num_experts"]):
        bad.append("handle tail %r" % (tuple(handle[2:]),))
    # counts against the all-gathered routing, DeepEP's way (independent of the reference's layout)
    e_loc = spec["num_experts"] // world
    exp_counts = ref.ll_expected_counts(topks, spec["num_experts"], rank, masked_ranks=masked)
    if not torch.equal(count, exp_counts):
        bad.append("counts differ from the gathered routing: %s vs %s"
                   % (count.tolist(), exp_counts.tolist()))
    begin, cnt = ref.unpack_layout_range(layout_range)
    if not torch.equal(cnt.sum(dim=1).to(torch.int32), count):
        bad.append("layout_range counts do not add up to recv_count")
    if not torch.equal(begin[:, 1:], (begin + cnt)[:, :-1]) or bool((begin[:, 0] != 0).any()):
        bad.append("layout_range ranges do not tile [0, count) in rank order")
    for e in range(e_loc):
        n = int(want_count[e])
        if not torch.equal(src_info[e, :n], want_src[e, :n]):
            bad.append("expert %d: src_info differs" % e)
        if use_fp8:
            q, s = recv_x
            wq, ws = want_x
            if tuple(s.shape) != tuple(ws.shape) or s.dtype != ws.dtype or \
                    not s.transpose(1, 2).is_contiguous():
                bad.append("scales %s %s (stride %s) vs the reference's %s %s; they must be a "
                           "column-major view" % (tuple(s.shape), s.dtype, s.stride(),
                                                  tuple(ws.shape), ws.dtype))
            if not torch.equal(q[e, :n].view(torch.uint8), wq[e, :n].view(torch.uint8)):
                bad.append("expert %d: fp8 rows differ" % e)
            if not torch.equal(s[e, :n], ws[e, :n]):
                bad.append("expert %d: scales differ" % e)
        elif not torch.equal(recv_x[e, :n], want_x[e, :n]):
            bad.append("expert %d: rows differ" % e)
        if spec.get("tagged") and not use_fp8:
            # DeepEP's self-describing rows: every row is one rank's constant, tail = token index
            for j in range(world):
                b, c = int(begin[e, j]), int(cnt[e, j])
                rows = recv_x[e, b:b + c]
                if c and not bool((rows[:, :-128] == float(j - ref.TAG_OFFSET)).all()):
                    bad.append("expert %d: rows of source %d do not all carry rank %d" % (e, j, j))
                if c and not torch.equal(rows[:, -128:].float(),
                                         src_info[e, b:b + c].float().view(-1, 1).expand(c, 128)):
                    bad.append("expert %d: token tags of source %d != src_info" % (e, j))
    return bad


def _ref_combine(spec, inputs, world, rank, masked_dispatch, masked_combine):
    """combine's reference on `rank`: every rank's experts applied to its reference dispatch."""
    e_loc = spec["num_experts"] // world
    use_fp8 = spec.get("use_fp8", False)
    outs, handles = [], []
    for o in range(world):
        rx, _, rs, rl = _ref_dispatch(spec, inputs, o, masked_dispatch)
        outs.append(_expert(_decode(rx, use_fp8), o, e_loc))
        handles.append((rs, rl, spec["t_max"], spec["hidden"], spec["num_experts"]))
    mine = inputs[rank]
    return ref.ll_combine_ref(outs, mine["topk_idx"], mine["topk_weights"], handles, rank,
                              masked_ranks=masked_combine)


def _dispatch(buf, spec, mine, stats):
    e_loc = spec["num_experts"] // buf.group_size
    dev = _device(buf)
    cum = torch.zeros(e_loc, dtype=torch.int32, device=dev) if stats else None
    wstats = torch.zeros(buf.group_size, buf.group_size, dtype=torch.int64, device=dev) if stats else None
    recv_x, count, handle, event, hook = buf.low_latency_dispatch(
        mine["x"].to(dev), mine["topk_idx"].to(dev), spec["t_max"], spec["num_experts"],
        cumulative_local_expert_recv_stats=cum, dispatch_wait_recv_cost_stats=wstats,
        use_fp8=spec.get("use_fp8", False), round_scale=spec.get("round_scale", False),
        use_ue8m0=spec.get("use_ue8m0", False), return_recv_hook=spec.get("hook", False))
    return recv_x, count, handle, hook, cum, wstats


def _combine(buf, spec, mine, recv_x, handle, stats):
    """Combine the expert outputs of what dispatch delivered (recv_x, handle: as returned)."""
    e_loc = spec["num_experts"] // buf.group_size
    dev = _device(buf)
    x_c = _expert(_decode(_cpu(recv_x), spec.get("use_fp8", False)), buf.rank, e_loc).to(dev)
    if spec.get("zero_copy"):
        zbuf = buf.get_next_low_latency_combine_buffer(handle)
        zbuf.copy_(x_c)
        x_c = zbuf
    cstats = torch.zeros(buf.group_size, dtype=torch.int64, device=dev) if stats else None
    combined, event, hook = buf.low_latency_combine(
        x_c, mine["topk_idx"].to(dev), mine["topk_weights"].to(dev), handle,
        zero_copy=spec.get("zero_copy", False),
        return_recv_hook=spec.get("combine_hook", spec.get("hook", False)),
        combine_wait_recv_cost_stats=cstats)
    return combined, hook, cstats


class Failures:
    """The failure knobs of a round's spec (the module docstring) as rank ``rank`` reads them, in
    one place for the LL round here and the HT round (tests/ep_ht_jobs.py): masked, victim and
    stage ("dispatch" | "combine" | None) or die_at (seconds), what this rank expects masked in
    dispatch and in combine (masked_by_rank overrides them), and the slow rank, its delay and
    phase."""

    def __init__(self, spec, rank):
        self.spec, self.rank = spec, rank
        self.masked = tuple(spec.get("masked", ()))
        self.victim, stage = spec.get("die", (None, None))
        self.die_at = stage if isinstance(stage, float) else None
        self.stage = None if self.die_at is not None else stage
        self.masked_dispatch = self.masked + ((self.victim,) if self.stage == "dispatch" else ())
        self.masked_combine = self.masked + ((self.victim,) if self.stage is not None else ())
        if spec.get("masked_by_rank") is not None:
            self.masked_dispatch, self.masked_combine = (tuple(m) for m in spec["masked_by_rank"][rank])
        self.slow_rank, self.delay_s, self.slow_phase = \
            (tuple(spec.get("slow", (None, 0.0))) + ("dispatch",))[:3]

    def start(self, buf):
        """At the start of the round: the victim exits now (die at "dispatch"), or leaves the
        ranks victim_masks out of its last dispatch (its local mask: no rows, no header to them)
        and, for die = (victim, seconds), arms its exit."""
        self.buf = buf
        if self.rank != self.victim:
            return
        if self.stage == "dispatch":
            os._exit(0)
        for p in self.spec.get("victim_masks", ()):
            buf.low_latency_update_mask_buffer(p, True)
        if self.die_at is not None:
            threading.Timer(self.die_at, os._exit, (0,)).start()

    def before(self, phase):
        """Before ``phase`` ("dispatch" | "combine"): the victim exits before combine (die at
        "combine") once its dispatch's sends completed; the slow rank sleeps before its slow
        phase.

        Why the quiet: a dispatch returns when this rank's rows ARRIVED, not when the rows it SENT
        did; over ibgda and proxy the soft NIC that still has to move them is a thread of this
        process. Exiting at once let a starved NIC thread die with a send undone (CI, 2026-12-06:
        test_a_rank_late_from_waiting_out_a_dead_one_is_not_masked[ibgda], rank 1 never got rank
        2's header and masked it in dispatch). "Dies before combine" means after its dispatch was
        delivered; a death with sends in flight is what die_at (seconds) and the killed-rank
        tests generate."""
        if self.rank == self.victim and self.stage == "combine" and phase == "combine":
            try:
                self.buf.runtime.quiet()
            finally:
                os._exit(0)
        if self.rank == self.slow_rank and self.slow_phase == phase:
            time.sleep(self.delay_s)


def keep_returned(state, tensors):
    """Keep a call's returned tensors and a copy of them as returned (returned_unchanged)."""
    state["returned"] = tuple(tensors)
    state["as_returned"] = tuple(t.clone() for t in tensors)


def returned_unchanged(state):
    """Whether the tensors keep_returned kept still equal their copies (None where none were
    kept). Bytes: receive rows of a masked source are uninitialised pool memory, NaN among them."""
    if "returned" not in state:
        return None
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(state.pop("returned"), state.pop("as_returned")))


def dispatch_with_late_source(state, spec, late_rank, stall_s):
    """An LL dispatch of the spec's inputs; ``late_rank``'s host stalls ``stall_s`` before its
    launch. The other ranks keep recv_x and the handle's src_info (keep_returned). Returns (this
    rank's masked ranks, whether its recv_x lies in its receive pool)."""
    buf = state["ep_buf"]
    mine = _inputs(spec, buf.group_size)[buf.rank]
    if buf.rank == late_rank:
        time.sleep(stall_s)
    recv_x, _, handle, _, _, _ = _dispatch(buf, spec, mine, False)
    in_pool = buf._pool is not None and buf._pool.contains(recv_x)
    if buf.rank != late_rank:
        keep_returned(state, (recv_x, handle[0]))
    return buf.masked_ranks(), in_pool


def round_(state, spec):
    """One dispatch + combine round on every rank (see the module docstring for spec). Returns
    {bad: findings, calc_diff, nan, count, hashes, masked, raised: None | EPTimeout fields}."""
    buf = state["ep_buf"]
    world, rank = buf.group_size, buf.rank
    f = Failures(spec, rank)
    masked, victim, die_at = f.masked, f.victim, f.die_at
    masked_dispatch, masked_combine = f.masked_dispatch, f.masked_combine
    inputs = _inputs(spec, world)
    mine = inputs[rank]
    stats = spec.get("stats", False)
    out = {"bad": [], "calc_diff": None, "nan": False, "raised": None, "hashes": {}}
    f.start(buf)
    f.before("dispatch")
    wire = wire_prepare(buf, spec) if spec.get("wire") else None
    try:
        t0 = time.monotonic()
        recv_d, count_d, handle_d, hook, cum, wstats = _dispatch(buf, spec, mine, stats)
        pool = getattr(buf, "_pool", None)   # (None in the HT Buffers' rounds)
        out["in_pool"] = bool(pool is not None and pool.contains(
            recv_d[0] if spec.get("use_fp8") else recv_d))
        out["bad"] += _hook_findings("dispatch", hook, spec.get("hook", False))
        if hook is not None:
            hook()
        out["t_dispatch"] = time.monotonic() - t0
        if wire is not None:
            out["wire"] = wire_read(buf, spec, wire)
        recv_x, count, handle = _cpu(recv_d), _cpu(count_d), _cpu(handle_d)
        cum, wstats = _cpu(cum), _cpu(wstats)
        if die_at is not None and rank != victim and victim in buf.masked_ranks():
            masked_dispatch = masked_combine = masked + (victim,)
            out["victim_masked_in"] = "dispatch"
        out["bad"] += _check_dispatch(spec, world, rank, inputs, (recv_x, count, handle), masked_dispatch)
        if cum is not None and not torch.equal(cum, count):
            out["bad"].append("cumulative_local_expert_recv_stats %s != counts %s"
                              % (cum.tolist(), count.tolist()))
        if wstats is not None:
            others = [r for r in range(world) if r != rank]
            if bool((wstats < 0).any()) or bool((wstats[others] != 0).any()):
                out["bad"].append("dispatch wait stats negative or outside this rank's row")
            out["dispatch_wait"] = wstats[rank].tolist()
        f.before("combine")
        t0 = time.monotonic()
        combined, chook, cstats = _combine(buf, spec, mine, recv_d, handle_d, stats)
        out["bad"] += _hook_findings("combine", chook, spec.get("combine_hook", spec.get("hook", False)))
        if chook is not None:
            chook()
        combined, cstats = _cpu(combined), _cpu(cstats)
        out["t_combine"] = time.monotonic() - t0
        if die_at is not None and rank != victim and victim in buf.masked_ranks():
            masked_combine = masked + (victim,)
            out.setdefault("victim_masked_in", "combine")
    except EPTimeout as e:
        out["raised"] = {"phase": e.phase, "peers_silent": e.peers_silent,
                         "counts_seen": e.counts_seen, "msg": str(e)[:400]}
        return out
    want_c = _ref_combine(spec, inputs, world, rank, masked_dispatch, masked_combine)
    out["calc_diff"] = ref.calc_diff(combined, want_c) if combined.numel() else 0.0
    out["nan"] = bool(torch.isnan(combined.float()).any())
    if cstats is not None:
        out["combine_wait"] = cstats.tolist()
    use_fp8 = spec.get("use_fp8", False)
    out["count"] = count.tolist()
    out["hashes"] = _hashes({"count": count, "src_info": _valid(handle[0], count),
                             "layout_range": handle[1], "combined": combined,
                             "recv_x": _valid(recv_x[0] if use_fp8 else recv_x, count),
                             "scales": _valid(recv_x[1], count) if use_fp8 else None})
    out["masked"] = buf.masked_ranks() if buf.enable_shrink else []
    return out


def run_rounds(round_fn, state, specs):
    """``round_fn(state, spec)`` for each spec in turn, each started as soon as the one before
    returned on this rank (no collective between them: back to back, as a training loop runs its
    steps). The list of their results; the first round that raised (its ``raised`` is not None:
    an EPTimeout) ends it. The LL and HT ``rounds`` jobs both run here."""
    outs = []
    for spec in specs:
        outs.append(round_fn(state, spec))
        if outs[-1]["raised"] is not None:
            break
    return outs


def rounds(state, specs):
    """The LL round_ for each spec, back to back (run_rounds)."""
    return run_rounds(round_, state, specs)


def timings(outs):
    """Per rank's round output (or {} for a round it never returned): (t_dispatch, t_combine,
    masked), -1 for a time not taken; for the tests' assertion messages."""
    return [(round(o.get("t_dispatch", -1), 2), round(o.get("t_combine", -1), 2), o.get("masked"))
            for o in outs]


def check_rounds(outs, specs, masked, assert_round):
    """The survivors' (status, run_rounds result) pairs of a ``rounds`` job over ``specs``: each
    survivor finished every round, masked exactly ``masked`` after each, and
    ``assert_round(that round's outputs, spec, why)`` holds; every message ends with the timings
    of every round (``timings``)."""
    for status, o in outs:
        assert status == "ok", o
    for k, spec in enumerate(specs):
        got = [o[k] if k < len(o) else None for _, o in outs]
        why = "round %d: t_dispatch, t_combine, masked per survivor: %s; all rounds: %s" % (
            k, timings([g or {} for g in got]), [timings(o) for _, o in outs])
        assert None not in got, why
        assert [g.get("masked") for g in got] == [list(masked)] * len(got), why
        assert_round(got, spec, why)


def two_in_flight(state, spec_a, spec_b):
    """Two dispatches in flight (the two LL buffers): dispatch A and B (hooks), receive A then B,
    then combine A and B (hooks), receive both; every result checked against its reference."""
    buf = state["ep_buf"]
    world, rank = buf.group_size, buf.rank
    res = {}
    runs = []
    for name, spec in (("a", dict(spec_a, hook=True)), ("b", dict(spec_b, hook=True))):
        inputs = _inputs(spec, world)
        got = _dispatch(buf, spec, inputs[rank], False)
        runs.append((name, spec, inputs, got))
    for _, _, _, got in runs:
        got[3]()                                        # receive hooks, in order A, B
    combs = []
    for name, spec, inputs, got in runs:
        res[name] = {"bad": _check_dispatch(spec, world, rank, inputs, _cpu(got[:3]), ())}
        combs.append((name, spec, inputs, _combine(buf, spec, inputs[rank], got[0], got[2], False)))
    for _, _, _, c in combs:
        c[1]()
    for name, spec, inputs, c in combs:
        want = _ref_combine(spec, inputs, world, rank, (), ())
        res[name]["calc_diff"] = ref.calc_diff(_cpu(c[0]), want) if c[0].numel() else 0.0
    return res


def ll_order(state, specs, order, slow=(None, 0.0)):
    """LL calls in ``order`` on every rank, batch i on ``specs[i]`` (its own seed), every call
    with return_recv_hook=True: "d<i>" sends batch i's dispatch, "dh<i>" calls its hook (then the
    dispatch is checked against the reference), "c<i>" sends its combine of what that dispatch
    received, "ch<i>" calls the combine's hook; "slow" sleeps ``slow[1]`` s on rank ``slow[0]``.
    The first call that raises ends the order. Returns {"raised": None or (step, exception type,
    message), "launches": the kernel launches the step that raised made, "dispatch": {i: batch
    i's dispatch findings}, "calc_diff": {i: batch i's combine calc_diff}}."""
    buf = state["ep_buf"]
    world, rank = buf.group_size, buf.rank
    launches = []
    real = buf._launch

    def counted(P, what, grid=None):
        launches.append(what)
        return real(P, what, grid)

    buf._launch = counted
    out = {"raised": None, "launches": [], "dispatch": {}, "calc_diff": {}}
    batches = {}
    try:
        for step in order:
            if step == "slow":
                if rank == slow[0]:
                    time.sleep(slow[1])
                continue
            kind = step.rstrip("0123456789")
            i = int(step[len(kind):])
            del launches[:]
            try:
                if kind == "d":
                    spec = dict(specs[i], hook=True)
                    inputs = _inputs(spec, world)
                    batches[i] = {"spec": spec, "inputs": inputs,
                                  "d": _dispatch(buf, spec, inputs[rank], False)}
                    continue
                b = batches[i]
                spec, inputs = b["spec"], b["inputs"]
                if kind == "dh":
                    b["d"][3]()
                    out["dispatch"][i] = _check_dispatch(spec, world, rank, inputs,
                                                         _cpu(b["d"][:3]), ())
                elif kind == "c":
                    b["c"] = _combine(buf, spec, inputs[rank], b["d"][0], b["d"][2], False)
                else:
                    b["c"][1]()
                    got = _cpu(b["c"][0])
                    want = _ref_combine(spec, inputs, world, rank, (), ())
                    out["calc_diff"][i] = ref.calc_diff(got, want) if got.numel() else 0.0
            except Exception as e:  # noqa: BLE001 - the test checks the type and message
                out["raised"] = (step, type(e).__name__, str(e))
                out["launches"] = list(launches)
                break
    finally:
        buf.__dict__.pop("_launch", None)
    return out


def mask(state, op, r=None):
    """The mask API on this rank: op "update" (r, mask), "query", "clean"."""
    buf = state["ep_buf"]
    if op == "query":
        m = torch.zeros(buf.group_size, dtype=torch.int32)
        buf.low_latency_query_mask_buffer(m)
        return m.tolist()
    if op == "clean":
        buf.low_latency_clean_mask_buffer()
        return None
    buf.low_latency_update_mask_buffer(r[0], r[1])
    return None


def set_timeout(state, seconds):
    """Buffer.set_timeout on this rank (the bound of every wait on a peer, from the next call on);
    ``seconds`` a number, or a list of one per rank."""
    buf = state["ep_buf"]
    if isinstance(seconds, (list, tuple)):
        seconds = seconds[buf.rank]
    buf.set_timeout(seconds)
    return seconds


def vllm_clean_buffers(state):
    """What vLLM's DeepEPLLAll2AllManager.clean_buffers does to the Buffer (vllm#43637, the
    fault-tolerance retry; vllm/distributed/device_communicators/all2all.py), in its order and
    through the public API only: the whole RDMA buffer (get_local_buffer_tensor(int8,
    use_rdma_buffer=True)) zeroed, a device synchronisation, low_latency_clean_mask_buffer(), a
    device synchronisation; never clean_low_latency_buffer. Returns the mask afterwards."""
    buf = state["ep_buf"]
    buf.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True).zero_()
    if _device(buf) == "cuda":
        torch.cuda.synchronize()
    buf.low_latency_clean_mask_buffer()
    if _device(buf) == "cuda":
        torch.cuda.synchronize()
    return mask(state, "query")


def lone_dispatch(state, spec):
    """One low-latency dispatch (and its hook) with no combine after it, on the ranks this job
    runs on: they end one LL call ahead of the others (the two LL buffers alternate per call)."""
    buf = state["ep_buf"]
    mine = _inputs(spec, buf.group_size)[buf.rank]
    hook = _dispatch(buf, spec, mine, False)[3]
    if hook is not None:
        hook()
    return buf.masked_ranks()


def clean(state, spec):
    buf = state["ep_buf"]
    buf.clean_low_latency_buffer(spec["t_max"], spec["hidden"], spec["num_experts"])
    return buf.masked_ranks() if buf.enable_shrink else []


def scribble(state, byte):
    """Use the whole RDMA buffer as scratch (callers do, between LL phases): fill it with `byte`."""
    buf = state["ep_buf"]
    t = buf.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
    t.fill_(byte)
    return t.numel()


# --- driver (runs in the test process, not in the ranks) -----------------------------------------
TWO_RANK_ROUNDS = (dict(seed=3, t_max=8, hidden=256, topk=4, num_experts=8, holes=2, tagged=True),
                   dict(seed=4, t_max=8, hidden=256, topk=4, num_experts=8, use_fp8=True, hook=True))


def two_rank_rounds(transport, env, recv_pool_bytes=0):
    """Two rank processes (tests/mp_ranks.py) with ``env``: a Buffer over ``transport`` (with a
    receive pool of ``recv_pool_bytes``), then a tagged BF16 round with -1 holes and an FP8 round
    with hooks; every rank's dispatch equals gpunet.ep.reference's and combine is within DeepEP's
    calc_diff bounds. Returns the init info, each rank's with "heap" (heap_paths after the rounds)
    and "in_pool" (per round, whether its recv_x lay in the pool: the direct dispatch) added."""
    from mp_ranks import Ranks

    r = Ranks(2, env=env)
    try:
        nbytes = Buffer.get_low_latency_rdma_size_hint(8, 256, 2, 8)
        info = r.run("ep_jobs:init", transport, nbytes, 60.0, False, None, None, None,
                     recv_pool_bytes, timeout=300)
        for i in info:
            i["in_pool"] = []
        for spec in TWO_RANK_ROUNDS:
            for rank, o in enumerate(r.run("ep_jobs:round_", spec, timeout=300)):
                assert o["raised"] is None and o["bad"] == [], (rank, o)
                assert o["calc_diff"] < (9e-4 if spec.get("use_fp8") else 1e-5), (rank, o["calc_diff"])
                info[rank]["in_pool"].append(o["in_pool"])
        for i, h in zip(info, r.run("ep_jobs:heap_paths", timeout=60)):
            i["heap"] = h
        r.run("ep_jobs:close", timeout=120)
    finally:
        r.close()
    return info
