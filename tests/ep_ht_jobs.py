"""Jobs the high-throughput EP tests run on every rank (tests/mp_ranks.py runs "ep_ht_jobs:<name>"):
build a gpunet.ep.Buffer with an HT buffer, run get_dispatch_layout / dispatch / combine on inputs
every rank regenerates from one seed, and check them DeepEP's way (EP-ANCHORS.md §B) and against
gpunet.ep.reference's plain-torch HT references. Each job takes the rank's ``state`` first and
returns its findings (an empty ``bad`` list: everything held).

A round's ``spec`` (a dict): seed, tokens, hidden, topk, num_experts; routing knobs holes,
hot_expert, hot_fraction, empty_experts, vary_tokens, tagged; modes fp8, no_topk (dispatch without
top-k), alignment, biases (0-2), worst (extra rows of num_worst_tokens past the exact count, or
None), cached, async_finish, prev_event, config (Config arguments); failures: masked, die =
(rank, "dispatch" | "combine") or (rank, seconds) (that rank exits that long after its round
starts, wherever it is: see _dispatch_after_failures for what the others then expect); victim_masks,
slow = (rank, seconds[, "combine"]) (the sleep is after the barrier before dispatch, or before
combine) and masked_by_rank: as tests/ep_jobs.py's (one parser, ep_jobs.Failures); routing =
"rank_repeats" (ep_jobs.rank_repeating_routing), wire (record the messages per destination and
per source the dispatch counted: round_'s "wire"). round_ reports t_dispatch / t_combine (s).
"""
import gc
import itertools
import time

import torch
import torch.distributed as dist

from gpunet.device import ep as dep
from gpunet.ep import Buffer, Config, EPTimeout
from gpunet.ep import _layout as lay
from gpunet.ep import reference as ref

import ep_jobs  # tests/ep_jobs.py: make_buffer, close, the LL round

BF16_BOUND = 5e-6       # DeepEP's intranode test: combined / fan-out vs x (tagged or random BF16)
FP8_BOUND = 5e-4        # with random FP8 rows
WEIGHT_BOUND = 1e-9     # the reduced top-k weights vs the originals


def init(state, transport, num_nvl_bytes, timeout_s=20.0, shrink=False, warp_size=32,
         num_rdma_bytes=0, low_latency_mode=False, recv_pool_bytes=0):
    """Make this rank's Buffer with an HT buffer of num_nvl_bytes (and an LL buffer of
    num_rdma_bytes when low_latency_mode; a receive pool of recv_pool_bytes). ``transport`` as
    ep_jobs.make_buffer's."""
    return ep_jobs.make_buffer(state, transport, num_nvl_bytes=num_nvl_bytes,
                               num_rdma_bytes=num_rdma_bytes, low_latency_mode=low_latency_mode,
                               enable_shrink=shrink, timeout_s=timeout_s, warp_size=warp_size,
                               recv_pool_bytes=recv_pool_bytes)


close = ep_jobs.close


def _inputs(spec, world):
    inp = ep_jobs.spec_rank_inputs(spec, world, spec["tokens"])
    if spec.get("hot_fraction") is not None:
        # a heavier skew than make_rank_inputs' default (EP-ANCHORS.md §B.10): most tokens of
        # every rank pick the hot expert, whose rank then receives nearly everything
        for j, d in enumerate(inp):
            d["topk_idx"] = ref.random_routing(d["topk_idx"].shape[0], spec["topk"], spec["num_experts"],
                                               spec["seed"] * 7919 + j, holes=spec.get("holes", 0),
                                               hot_expert=spec["hot_expert"],
                                               hot_fraction=spec["hot_fraction"])
    ep_jobs.with_routing(spec, inp, world)
    if spec.get("fp8"):
        for d in inp:
            d["x_fp8"] = ref.per_token_cast_to_fp8(d["x"])
    return inp


def _x(spec, d):
    return d["x_fp8"] if spec.get("fp8") else d["x"]


def _dev(obj, dev):
    """Tensors (also inside tuples) moved to `dev` (the Buffer's device); None stays None."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dev)
    if isinstance(obj, tuple):
        return tuple(_dev(o, dev) for o in obj)
    return obj


def _bias(spec, rank, t, h):
    gen = torch.Generator().manual_seed(spec["seed"] * 31 + rank)
    return tuple(torch.randn(t, h, generator=gen).to(torch.bfloat16) for _ in range(spec.get("biases", 0)))


def _same(a, b):
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b))
    if a.dtype == torch.float8_e4m3fn:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return a.shape == b.shape and torch.equal(a, b)


def _dispatch_ref(spec, inputs, rank, masked):
    no_topk = spec.get("no_topk", False)
    return ref.ht_dispatch_ref([_x(spec, d) for d in inputs], [d["topk_idx"] for d in inputs],
                               None if no_topk else [d["topk_weights"] for d in inputs],
                               spec["num_experts"], rank, masked_ranks=masked,
                               expert_alignment=spec.get("alignment", 1))


def _rows_from(t, src, idx):
    """t with its rows idx taken from src (a tensor, or the FP8 pair)."""
    if isinstance(t, tuple):
        return tuple(_rows_from(a, b, idx) for a, b in zip(t, src))
    t = t.clone()
    t[idx] = src[idx]
    return t


def _dispatch_after_failures(spec, inputs, rank, masked, gone, prefix, got, bad):
    """What a survivor's dispatch must be when the ranks ``gone`` were marked failed during it
    (a rank that died at an arbitrary moment: die = (victim, seconds); or a live one taken for
    dead, ht.cuh "Waits on a peer"). A failed source whose notify header never came has no row
    (``prefix`` = the handle's rank prefix [R + 1]): the reference leaves it out. Any other
    failed source keeps the full layout, and each of its rows arrived whole (the reference's
    row, top-k ids and weights) or not at all: a HOLE, whose recv_topk_idx row is all -1 and
    weights all 0 (its recv_x content unspecified). Holes get the reference's rows here so that
    the exact checks after this compare everything else. Returns (reference, masked in
    dispatch, rx, rtk, rw, number of holes)."""
    rx, rtk, rw = got
    fp = _dispatch_ref(spec, inputs, rank, masked)["rank_prefix"]
    cut = tuple(j for j in gone if int(prefix[j + 1]) == int(prefix[j]) and int(fp[j + 1]) > int(fp[j]))
    r_ = _dispatch_ref(spec, inputs, rank, masked + cut)
    holes = 0
    for j in gone:
        b0, b1 = int(prefix[j]), int(prefix[j + 1])
        idx = torch.arange(b0, b1)[(rtk[b0:b1] == -1).all(1)]
        if j in cut or not idx.numel():
            continue
        if bool((rw[idx] != 0).any()):
            bad.append("a row failed rank %d never sent has non-zero recv_topk_weights" % j)
        rx = _rows_from(rx, r_["recv_x"], idx)
        rtk = _rows_from(rtk, r_["recv_topk_idx"], idx)
        rw = _rows_from(rw, r_["recv_topk_weights"], idx)
        holes += int(idx.numel())
    return r_, masked + cut, rx, rtk, rw, holes


def _expert_out(spec, recv_x):
    """The expert side's output: the received rows themselves (FP8 cast back to bf16)."""
    if spec.get("fp8"):
        q, s = recv_x
        return ref.per_token_cast_back(q, s).to(torch.bfloat16) if q.shape[0] else \
            torch.empty(0, q.shape[1], dtype=torch.bfloat16)
    return recv_x


def _ring_probe(buf, config, handle, hidden):
    """Fills this rank's combine receive rings with 0x5A, then a barrier (no peer's combine has
    begun: each writes only after it), and returns a function giving, per source rank, how many of
    its ring slots past each channel's first the combine wrote: rows that came through the ring.
    An in-place peer (ht.cuh ht_offer_pull) writes only its descriptor, into slot 0."""
    world = buf.group_size
    nc = handle[6]["nc"]
    _, ring, _, _ = buf._ht_geometry(config)
    layout = buf._ht_region(hidden, nc, ring, "probe")
    stride = lay.msg_stride(hidden, False)[0]
    region = buf._ht[layout.recv[1]: layout.recv[1] + nc * world * ring * stride]
    region.fill_(0x5A)
    dist.barrier()

    def written():
        touched = (region.view(nc, world, ring, stride)[:, :, 1:, :].cpu() != 0x5A).any(-1)
        return [int(touched[:, d].sum()) for d in range(world)]
    return written


def _split_states(buf, handle):
    """Per channel, how the last combine's split in-place reduce went on this rank (ht.cuh "the
    split in-place combine": its split word, if that op's): 1 the sender block reduced the upper
    half of the channel's tokens, 2 it saw a ring source, 3 the receiver block took it all, 0
    no claim this op (the split was off, or the sender did not offer)."""
    world, nc = buf.group_size, handle[6]["nc"]
    op = int(buf._ht_epoch[0]) - 1         # the combine's op counter (its last block bumped it)
    at = dep.ht_split_at(world)       # only the claim words leave the device, not the workspace
    words = buf._ht_ws[at:at + nc * (world + 2):world + 2].tolist()
    return [w & 3 if w >> 2 == op else 0 for w in words]


def hold_pool(state, hold_by_rank):
    """Hold this rank's receive pool full (tensors of its own) where ``hold_by_rank[rank]``, else
    drop what was held. Pieces of falling sizes until none fits: on CUDA torch's cached blocks in
    the pool are taken too (it releases them before it reports the pool full). Returns the pool's
    bytes in use."""
    buf = state["ep_buf"]
    state.pop("pool_hold", None)
    gc.collect()                # earlier rounds' receive tensors go back first
    held = state["pool_hold"] = []
    if hold_by_rank[buf.rank]:
        for n in (8 << 20, 1 << 20, 64 << 10, 4096, 512):
            while True:
                t = buf._pool.empty((n,), torch.uint8)
                if t is None:
                    break
                held.append(t)
    return buf._pool.used_bytes()


def round_(state, spec):
    """Layout, dispatch (and the cached / worst-case variants the spec asks for), combine, all
    checked on this rank. Returns {bad, calc_diff, weights_diff, n_recv, hashes, masked, raised,
    host_failed}."""
    buf = state["ep_buf"]
    world, rank = buf.group_size, buf.rank
    f = ep_jobs.Failures(spec, rank)
    masked, victim, stage, die_at = f.masked, f.victim, f.stage, f.die_at
    masked_d, masked_c = f.masked_dispatch, f.masked_combine
    # the torch.distributed collectives (the all-reduced layout, a barrier) run only while every
    # rank is there, decided from the spec alone (the same on every rank)
    collective = not masked and stage != "dispatch" and die_at is None
    quiet = not collective or bool(masked_d)   # no check against the all-reduced layout
    inputs = _inputs(spec, world)
    mine = inputs[rank]
    e = spec["num_experts"]
    cfg = Config(*spec["config"]) if spec.get("config") else None
    out = {"bad": [], "calc_diff": None, "weights_diff": None, "raised": None, "hashes": {}}
    bad = out["bad"]
    dev = "cuda" if buf.runtime.platform.name == "cuda" else "cpu"
    cpu = lambda o: _dev(o, "cpu")  # noqa: E731
    f.start(buf)
    try:
        prev = Buffer.capture() if spec.get("prev_event") else None
        ntr_d, ntrr, ntpe_d, in_rank_d, ev = buf.get_dispatch_layout(
            mine["topk_idx"].to(dev), e, previous_event=prev, async_finish=spec.get("async_finish", False))
        if spec.get("async_finish"):
            ev.current_stream_wait()
        ntr, ntpe, in_rank = cpu(ntr_d), cpu(ntpe_d), cpu(in_rank_d)
        want = ref.ht_layout_ref(mine["topk_idx"], e, world)
        if ntrr is not None or not torch.equal(ntr, want[0]) or not torch.equal(ntpe, want[1]) or \
                not torch.equal(in_rank, want[2]):
            bad.append("get_dispatch_layout differs from the token-by-token reference")
        # the counts against the all-reduced layout (DeepEP's check, independent of the reference)
        all_ntr, all_ntpe = ntr.clone(), ntpe.clone()
        if collective:
            dist.all_reduce(all_ntr)
            dist.all_reduce(all_ntpe)
        topk = None if spec.get("no_topk") else mine["topk_idx"]
        weights = None if spec.get("no_topk") else mine["topk_weights"]
        r_ = _dispatch_ref(spec, inputs, rank, masked_d)
        kw = dict(is_token_in_rank=in_rank_d, num_tokens_per_expert=ntpe_d, topk_idx=_dev(topk, dev),
                  topk_weights=_dev(weights, dev), expert_alignment=spec.get("alignment", 1), config=cfg,
                  previous_event=Buffer.capture() if spec.get("prev_event") else None,
                  async_finish=spec.get("async_finish", False))
        worst = spec.get("worst")
        n_exact = r_["src_idx"].numel()
        if worst is not None:
            kw["num_worst_tokens"] = n_exact + worst if worst >= 0 else max(1, n_exact + worst)
        if collective:
            dist.barrier()      # start together: on a loaded CI machine a rank can lag by seconds
        f.before("dispatch")
        t0 = time.monotonic()
        pre0 = buf._ht_prelaunched
        rx, rtk, rw, counts, handle, ev = buf.dispatch(_dev(_x(spec, mine), dev), **kw)
        out["prelaunched"] = buf._ht_prelaunched - pre0     # its data phase went behind the notify
        # where the receive tensors came from (the receive pool: peers stored rows in place)
        out["in_pool"] = buf._pool is not None and buf._pool.contains(rx[0] if spec.get("fp8") else rx)
        # the rows recv_x's allocation holds (more than its own when a guess made during the
        # notify fitted: Buffer._ht_recv_guess_rows): the receive tensors are parts of one allocation
        # (_pool.packed), recv_x first, and the next part (FP8: the scales, else src_idx, the
        # handle's third) starts after recv_x's rows rounded up to 256 bytes (exact for rows of
        # 256 bytes or more)
        t_ = rx[0] if spec.get("fp8") else rx
        nxt = rx[1] if spec.get("fp8") else handle[2]
        out["rows_held"] = (nxt.data_ptr() - t_.data_ptr()) // max(1, t_.shape[1] * t_.element_size())
        if spec.get("async_finish"):
            if ev.event is None:
                bad.append("async_finish=True returned no event")
            ev.current_stream_wait()
        rx_dev, rw_dev = rx, rw     # the receive tensors themselves (spec "in_place")
        rx, rtk, rw = cpu(rx), cpu(rtk), cpu(rw)
        out["t_dispatch"] = time.monotonic() - t0
        if die_at is not None and rank != victim:
            gone = tuple(j for j in buf.masked_ranks() if j not in masked)
            r_, masked_d, rx, rtk, rw, out["holes"] = _dispatch_after_failures(
                spec, inputs, rank, masked, gone, cpu(handle[0]), (rx, rtk, rw), bad)
            masked_c = masked_d
            n_exact = r_["src_idx"].numel()
        n = n_exact
        if spec.get("wire"):
            # what this dispatch counted as messages: sent per destination (the notify step's
            # send_cnt [nc, R], from is_token_in_rank: what the senders then put), announced per
            # source (each header's total, Buffer._nrecv_np) and the rows received per source
            # (the handle's rank prefix), with the source token of every received row
            pre = cpu(handle[0]).tolist()
            out["wire"] = {"sent": cpu(handle[5]).sum(0).tolist(),
                           "nrecv": [int(v) for v in buf._nrecv_np[:world]],
                           "rows_from": [pre[j + 1] - pre[j] for j in range(world)],
                           "src_idx": cpu(handle[2])[:pre[world]].tolist(), "ntr": ntr.tolist()}
        if worst is not None:
            rows = kw["num_worst_tokens"]
            got_rows = (rx[0] if spec.get("fp8") else rx).shape[0]
            if got_rows != rows or counts != []:
                bad.append("num_worst_tokens: %d rows (want %d), count list %r (want [])"
                           % (got_rows, rows, counts))
            if rtk is not None and not bool((rtk[n:] == -1).all()):
                bad.append("num_worst_tokens: the tail of recv_topk_idx is not all -1")
            if rw is not None and not bool((rw[n:] == 0).all()):
                bad.append("num_worst_tokens: the tail of recv_topk_weights is not all 0")
            cut = lambda t: None if t is None else (tuple(a[:n] for a in t) if isinstance(t, tuple) else t[:n])  # noqa: E731
            rx, rtk, rw = cut(rx), cut(rtk), cut(rw)
        else:
            if counts != r_["counts"]:
                bad.append("counts %r != reference %r" % (counts, r_["counts"]))
            if not quiet:
                el = e // world
                a = spec.get("alignment", 1)
                want_c = [(int(v) + a - 1) // a * a for v in all_ntpe[rank * el:(rank + 1) * el]]
                if counts != want_c:
                    bad.append("counts %r != all-reduced num_tokens_per_expert %r" % (counts, want_c))
                if n != int(all_ntr[rank]):
                    bad.append("received %d rows, the all-reduced num_tokens_per_rank says %d"
                               % (n, int(all_ntr[rank])))
        if not _same(rx, r_["recv_x"]):
            bad.append("recv_x differs from the reference")
        if spec.get("no_topk"):
            if rtk is not None or rw is not None:
                bad.append("dispatch without top-k returned recv_topk_idx / weights")
        else:
            if not torch.equal(rtk, r_["recv_topk_idx"]):
                bad.append("recv_topk_idx differs from the reference")
            if not torch.equal(rw, r_["recv_topk_weights"]):
                bad.append("recv_topk_weights differs from the reference")
            el = e // world
            if rtk.numel() and (int(rtk.min()) < -1 or int(rtk.max()) >= el):
                bad.append("recv_topk_idx outside [-1, E_loc)")
        if spec.get("tagged") and not spec.get("fp8"):
            # rows tagged with their source rank arrive in rank order, tokens in order
            src = (rx[:, 0].float() + ref.TAG_OFFSET).to(torch.int64)
            if src.numel() and not bool((src[1:] >= src[:-1]).all()):
                bad.append("rows are not in source-rank order")
            pre = r_["rank_prefix"]
            for j in range(world):
                b0, b1 = int(pre[j]), int(pre[j + 1])
                if b1 > b0 and not bool((src[b0:b1] == j).all()):
                    bad.append("rows [%d, %d) do not all carry source rank %d" % (b0, b1, j))
                # the token index column: bf16 holds integers exactly up to 256 and rounds
                # monotonically above, so the order check is non-decreasing (exact below 257)
                tok = rx[b0:b1, -128].float()
                if b1 - b0 > 1 and not bool((tok[1:] >= tok[:-1]).all()):
                    bad.append("source %d's rows are not in token order" % j)
                if b1 - b0 > 1 and tok.numel() and float(tok.max()) <= 256 and not bool((tok[1:] > tok[:-1]).all()):
                    bad.append("source %d's rows repeat a token" % j)
        if spec.get("cached"):
            rx2, *rest = buf.dispatch(_dev(_x(spec, mine), dev), handle=handle, config=cfg)
            rx2 = cpu(rx2)
            if any(v is not None for v in rest[:4]):
                bad.append("a cached dispatch returned top-k / counts / handle")
            rx2 = tuple(a[:n] for a in rx2) if isinstance(rx2, tuple) else rx2[:n]
            if not _same(rx2, r_["recv_x"]):
                bad.append("the cached dispatch's recv_x differs")
        f.before("combine")
        # combine the received rows (the expert output is the row itself), with weights and biases
        y = _expert_out(spec, rx)
        rows = handle[6]["rows"]
        if y.shape[0] < rows:
            y = torch.cat([y, torch.zeros(rows - y.shape[0], y.shape[1], dtype=y.dtype)])
        yw = None
        if not spec.get("no_topk"):
            yw = torch.zeros(rows, spec["topk"])
            yw[:n] = rw
        if spec.get("in_place") and rank in spec.get("in_place_ranks", range(world)):
            # the received rows and weights themselves (BF16): with a receive pool they lie in
            # it, and peers that can load from this heap read them there (ht.cuh "the in-place
            # combine"); the expert output is the row itself either way
            if spec.get("fp8") or rx_dev.shape[0] != rows:
                bad.append("in_place needs a BF16 round without worst-case rows")
            y, yw = rx_dev, rw_dev
            if spec.get("empty_x"):
                # the experts' outputs written into a fresh tensor from Buffer.empty_combine_x (in
                # the pool when it has room), then recv_x overwritten with NaN: a combine that read
                # recv_x instead of x would return NaN rows
                y = buf.empty_combine_x(handle)
                y.copy_(rx_dev)
                out["x_in_pool"] = buf._pool is not None and buf._pool.contains(y)
                rx = rx.clone()
                rx_dev.fill_(float("nan"))
        elif spec.get("in_place"):
            y = y.clone()       # a rank left out of in_place_ranks: a copy in torch memory (the rings)
        t, h = mine["x"].shape
        biases = _bias(spec, rank, t, h)
        ccfg = Config(*(spec.get("combine_config") or spec["config"])) if spec.get("config") else None
        probe = _ring_probe(buf, ccfg or Buffer.get_combine_config(world), handle, h) \
            if spec.get("ring_probe") and collective else None
        pull, split = buf._ht_pull, buf._ht_split
        buf._ht_pull = pull and spec.get("pull", True)
        buf._ht_split = split and spec.get("split", True)
        t0 = time.monotonic()
        try:
            comb, comb_w, ev = buf.combine(y.to(dev), handle, topk_weights=_dev(yw, dev),
                                           bias=_dev(biases, dev) or None, config=ccfg,
                                           async_finish=spec.get("async_finish", False),
                                           previous_event=Buffer.capture() if spec.get("prev_event") else None)
        finally:
            buf._ht_pull, buf._ht_split = pull, split
        if spec.get("async_finish"):
            ev.current_stream_wait()
        comb, comb_w = cpu(comb), cpu(comb_w)
        out["t_combine"] = time.monotonic() - t0
        if probe is not None:
            out["ring_rows"] = probe()
        out["split"] = _split_states(buf, handle)
    except EPTimeout as ex:
        out["raised"] = {"phase": ex.phase, "peers_silent": ex.peers_silent,
                         "counts_seen": ex.counts_seen, "msg": str(ex)[:400]}
        out["host_failed"] = _host_failed(buf)
        return out
    # the exact reference: every rank's dispatch reference gives its expert outputs
    refs = [_dispatch_ref(spec, inputs, d, masked if die_at is not None else masked_d)
            for d in range(world)]
    ys = [_expert_out(spec, rr["recv_x"]) for rr in refs]
    yws = None if spec.get("no_topk") else [rr["recv_topk_weights"] for rr in refs]
    combine_ref = lambda m: ref.ht_combine_ref(ys, refs, in_rank, rank, masked_ranks=m,  # noqa: E731
                                               biases=biases, ys_weights=yws)
    # Each token's row is reduced over the ranks it reached that were live FOR IT: after a failure
    # mid-combine (die = (victim, seconds)), a rank marked failed may have sent the rows of some
    # tokens and not others. So each row may leave out any subset of the ranks this rank marked
    # failed; without such a failure, exactly masked_c.
    gone = [] if die_at is None else [j for j in out_masked(buf) if j not in masked and j != rank]
    subsets = [tuple(c) for k in range(len(gone) + 1) for c in itertools.combinations(gone, k)]
    cands = [(masked_c + s_, *combine_ref(masked_c + tuple(x for x in s_ if x not in masked_c)))
             for s_ in subsets]
    # the candidate each row matches, its row and its weights (one message carries both)
    def matches(c_, w_):
        ok = (comb == c_).all(1)
        return ok if comb_w is None or w_ is None else ok & (comb_w == w_).all(1)
    pick = torch.zeros(comb.shape[0], dtype=torch.int64)
    found = matches(*cands[0][1:])
    for i, (_, c_, w_) in enumerate(cands[1:], 1):
        hit = matches(c_, w_) & ~found
        pick[hit], found = i, found | hit
    rows = torch.arange(comb.shape[0])
    want_c = torch.stack([c_ for _, c_, _ in cands])[pick, rows]
    want_w = None if cands[0][2] is None else torch.stack([w_ for _, _, w_ in cands])[pick, rows]
    if not torch.equal(comb, want_c):
        bad.append("combined_x differs from the reference (max |diff| %g)"
                   % float((comb.float() - want_c.float()).abs().max()))
    # DeepEP's check: (combined - biases) / fan-out == x, over the ranks live for each row
    live_of = torch.ones(len(cands), world, dtype=torch.bool)
    for i, (m_, _, _) in enumerate(cands):
        live_of[i, list(m_)] = False
    live = live_of[pick]                                    # [T, R]: the ranks live for each row
    reach = in_rank.bool() & live
    fan = reach.sum(1, keepdim=True).clamp(min=1).float()
    reached = reach.any(1)
    x_ref = mine["x"].float() if not spec.get("fp8") else ref.per_token_cast_back(*mine["x_fp8"])
    core = comb.float() - sum((b.float() for b in biases), torch.zeros_like(comb.float()))
    if bool(reached.any()):
        out["calc_diff"] = ref.calc_diff(core[reached] / fan[reached], x_ref[reached])
    else:
        out["calc_diff"] = 0.0
    if comb_w is not None:
        w0 = torch.where(mine["topk_idx"] >= 0, mine["topk_weights"], torch.zeros_like(mine["topk_weights"]))
        el = e // world
        owner = torch.where(mine["topk_idx"] >= 0, mine["topk_idx"] // el, torch.zeros_like(mine["topk_idx"]))
        w0 = torch.where(torch.gather(live, 1, owner), w0, torch.zeros_like(w0))
        out["weights_diff"] = float((comb_w - w0).abs().max()) if w0.numel() else 0.0
        if not torch.equal(comb_w, want_w):
            bad.append("combined_topk_weights differ from the reference")
    alt = pick != 0
    out["mixed_tokens"] = int(alt.sum())
    out["nan"] = bool(torch.isnan(comb.float()).any())
    out["n_recv"] = n
    out["hashes"] = {"recv_x": ref.hash_tensor(rx[0] if isinstance(rx, tuple) else rx),
                     "combined": ref.hash_tensor(comb)}
    out["masked"] = out_masked(buf)
    out["host_failed"] = _host_failed(buf)
    out["ht_lib"] = str(buf._ht_lib.gpunet_path)
    return out


def rounds(state, specs):
    """The HT round_ for each spec, back to back (ep_jobs.run_rounds: no collective between them,
    the first raised EPTimeout ends it)."""
    return ep_jobs.run_rounds(round_, state, specs)


def out_masked(buf):
    """The ranks this rank's Buffer has masked (none without enable_shrink)."""
    return buf.masked_ranks() if buf.enable_shrink else []


def _host_failed(buf):
    """The peers the kernels marked failed in the host-mapped mirror (LlParams::host_flags), the
    words the host checks after a call on GPUs without copying a device-memory heap."""
    return [p for p in range(buf.group_size) if buf._hflags_np[1 + p]]


def ll_round(state, spec):
    """An LL round (tests/ep_jobs.py) on this Buffer, after clean_low_latency_buffer."""
    buf = state["ep_buf"]
    buf.clean_low_latency_buffer(spec["t_max"], spec["hidden"], spec["num_experts"])
    return ep_jobs.round_(state, spec)


def _dispatch(buf, spec, mine, config, num_worst_tokens=0):
    """get_dispatch_layout, then dispatch of this rank's inputs ``mine`` with ``config`` (a
    Config's arguments): dispatch's tuple."""
    ntr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(mine["topk_idx"], spec["num_experts"])
    return buf.dispatch(_x(spec, mine), num_tokens_per_rank=ntr, is_token_in_rank=in_rank,
                        num_tokens_per_expert=ntpe, topk_idx=mine["topk_idx"],
                        topk_weights=mine["topk_weights"], config=Config(*config),
                        num_worst_tokens=num_worst_tokens)


def dispatch_failing_after_notify(state, spec, failing_rank):
    """One dispatch (the spec's inputs) whose host step between the notify and the data launch
    raises MemoryError on ``failing_rank`` (the receive tensors' allocation). Returns (the
    exception's type name or None, this rank's HT epoch after the call, its masked ranks)."""
    buf = state["ep_buf"]
    world, rank = buf.group_size, buf.rank
    mine = _inputs(spec, world)[rank]
    if rank == failing_rank:
        def no_memory(*a, **kw):
            raise MemoryError("injected: the receive tensors' allocation")
        buf._ht_recv_fit = buf._ht_recv_tensors = no_memory
    raised = None
    try:
        _dispatch(buf, spec, mine, spec["config"])
    except Exception as e:  # noqa: BLE001 - the test checks the type
        raised = type(e).__name__
    finally:
        buf.__dict__.pop("_ht_recv_fit", None)
        buf.__dict__.pop("_ht_recv_tensors", None)
    return raised, int(buf._ht_epoch[0]), out_masked(buf)


class _Interrupted(BaseException):
    """What interrupted_after_the_prelaunch injects: a BaseException, as KeyboardInterrupt is."""


def interrupted_after_the_prelaunch(state, spec, failing_rank):
    """Three dispatches of the spec's inputs on every rank. The first sizes the receive-tensor
    guess; in the second, ``failing_rank``'s host raises right after it prelaunched the data
    phase, before it read the notify's go word (as an interrupt while it polls the mailbox would);
    the third runs everywhere. Returns (the second call's exception type name or None, this
    rank's HT op epoch after it, the prelaunches that ran to the end (Buffer._ht_prelaunched),
    whether the third call's recv_x equals the first's, the masked ranks)."""
    buf = state["ep_buf"]
    world, rank = buf.group_size, buf.rank
    mine = _inputs(spec, world)[rank]
    first = _dispatch(buf, spec, mine, spec["config"])[0].clone()
    if rank == failing_rank:
        early = buf._ht_early

        def interrupted(*a, **kw):
            early(*a, **kw)
            raise _Interrupted("injected: after the prelaunch")
        buf._ht_early = interrupted
    raised = None
    try:
        _dispatch(buf, spec, mine, spec["config"])
    except _Interrupted as e:
        raised = type(e).__name__
    finally:
        buf.__dict__.pop("_ht_early", None)
    epoch = int(buf._ht_epoch[0])
    third = _dispatch(buf, spec, mine, spec["config"])[0]
    return raised, epoch, buf._ht_prelaunched, torch.equal(third, first), out_masked(buf)


def too_small(state, hidden):
    """A dispatch whose Config needs more than the HT buffer holds: the ConfigError's text."""
    buf = state["ep_buf"]
    x = torch.zeros(4, hidden, dtype=torch.bfloat16)
    in_rank = torch.ones(4, buf.group_size, dtype=torch.bool)
    try:
        buf.dispatch(x, is_token_in_rank=in_rank, config=Config(4, 6, 4096))
    except Exception as e:  # noqa: BLE001 - the test checks the type and text
        return "%s: %s" % (type(e).__name__, e)
    return None


def header_overtaken(state, spec, stall_ns, between=()):
    """Two dispatches; this rank's notify (rank 0's only) stalls ``stall_ns`` between reading the
    peers' headers and reading them again (GPUNET_TEST_HT_NOTIFY_STALL_NS: the window a slow third
    source opens). In the first, every rank routes its tokens to its own experts only, so rank 1
    finishes it without rank 0's rows and starts the second, whose header (rank 1's tokens all to
    rank 0) reaches rank 0 during that stall. ``between``: the calls each rank makes between the
    two ("combine": of the first dispatch's rows; "cached": a dispatch with its handle), which
    move the HT epoch but run no notify. Returns (raised, masked ranks, bad) of both dispatches;
    every result is checked against the reference."""
    buf = state["ep_buf"]
    world, rank = buf.group_size, buf.rank
    if rank == 0:
        from gpunet.device import ep as dep
        buf._ht_lib = dep.load_ep_ht("host", defines={"GPUNET_TEST_HT_NOTIFY_STALL_NS": stall_ns},
                                     kinds=buf._build_kinds)
    # the peers start their dispatch once rank 0's build is done: a build on a cold cache takes
    # longer than the peer bound on a loaded CI machine (rank 1 then masked rank 0 in step 0)
    dist.barrier()
    inputs = _inputs(spec, world)
    el, k = spec["num_experts"] // world, spec["topk"]
    out = []
    for step in (0, 1):
        for j, d in enumerate(inputs):   # rank j's tokens to rank `to`'s experts, K distinct ones
            to = 0 if (step, j) == (1, 1) else j
            t = torch.arange(d["topk_idx"].shape[0]).unsqueeze(1) + torch.arange(k)
            d["topk_idx"] = (to * el + t % el).to(d["topk_idx"].dtype)
        mine, bad, raised = inputs[rank], [], None
        try:
            rx, rtk, rw, counts, handle, _ = _dispatch(buf, spec, mine, spec["config"])
            r_ = _dispatch_ref(spec, inputs, rank, ())
            if counts != r_["counts"]:
                bad.append("counts %r != reference %r" % (counts, r_["counts"]))
            if not (_same(rx, r_["recv_x"]) and torch.equal(rtk, r_["recv_topk_idx"])
                    and torch.equal(rw, r_["recv_topk_weights"])):
                bad.append("received rows differ from the reference")
            for call in between if step == 0 else ():
                if call == "combine":
                    buf.combine(rx, handle, topk_weights=rw, config=Config(*spec["config"]))
                else:
                    buf.dispatch(_x(spec, mine), handle=handle, config=Config(*spec["config"]))
        except Exception as e:  # noqa: BLE001 - the test reports it
            raised = "%s: %s" % (type(e).__name__, str(e)[:300])
        out.append((raised, out_masked(buf), bad))
    return out


def in_place_combine_stalled(state, spec, stalling_rank, stall_ns):
    """A dispatch, then combine of its recv_x (in the receive pool: the in-place combine); on
    ``stalling_rank`` the token side stalls ``stall_ns`` after loading its peers' rows and before
    its final credit (GPUNET_TEST_HT_PULL_STALL_NS). Returns (raised, masked ranks, bad, masked
    after the warm-up round): the exception's type and text or None, and what differs from the
    reference."""
    buf = state["ep_buf"]
    world, rank = buf.group_size, buf.rank
    if rank == stalling_rank:
        from gpunet.device import ep as dep
        buf._ht_lib = dep.load_ep_ht("host", defines={"GPUNET_TEST_HT_PULL_STALL_NS": stall_ns},
                                     kinds=buf._build_kinds)
    inputs = _inputs(spec, world)
    mine, bad, raised = inputs[rank], [], None
    # a warm-up round under a long bound whose combine goes through the rings (its x in torch
    # memory: no stall), so that nothing is built during the timed one: on a cold build cache the
    # first round outlasted a 1 s peer bound (a rank was masked in it)
    bound = buf.timeout_s
    buf.set_timeout(60.0)
    dist.barrier()
    rx, rtk, rw, counts, handle, _ = _dispatch(buf, spec, mine, spec["config"])
    buf.combine(rx.clone(), handle, topk_weights=rw.clone(), config=Config(*spec["config"]))
    del rx, rtk, rw, handle
    warm_masked = out_masked(buf)
    buf.set_timeout(bound)
    dist.barrier()
    try:
        rx, rtk, rw, counts, handle, _ = _dispatch(buf, spec, mine, spec["config"])
        if not buf._pool.contains(rx):
            bad.append("recv_x is not in the receive pool")
        comb, _, _ = buf.combine(rx, handle, topk_weights=rw, config=Config(*spec["config"]))
        refs = [_dispatch_ref(spec, inputs, d, ()) for d in range(world)]
        want, _ = ref.ht_combine_ref([rr["recv_x"] for rr in refs], refs, ref.ht_layout_ref(
            mine["topk_idx"], spec["num_experts"], world)[2], rank,
            ys_weights=[rr["recv_topk_weights"] for rr in refs])
        if not torch.equal(comb, want):
            bad.append("combined_x differs from the reference in %d rows" % int((comb != want).any(1).sum()))
    except Exception as e:  # noqa: BLE001 - the test reports it
        raised = "%s: %s" % (type(e).__name__, str(e)[:600])
    return raised, out_masked(buf), bad, warm_masked


def dispatch_with_config(state, spec, configs):
    """One dispatch of the spec's inputs with Config ``configs[rank]`` (ranks may differ).
    Returns the exception's type and text, or None."""
    buf = state["ep_buf"]
    world, rank = buf.group_size, buf.rank
    mine = _inputs(spec, world)[rank]
    try:
        _dispatch(buf, spec, mine, configs[rank])
    except Exception as e:  # noqa: BLE001 - the test checks the type and text
        return "%s: %s" % (type(e).__name__, e)
    return None


def reject_one_op(state, spec, rejecting_rank, op, op_timeout_s=None):
    """A dispatch of the spec's inputs; then ``op`` ("combine" of its rows, or "cached": a
    dispatch with its handle), where ``rejecting_rank`` alone passes an x of the wrong shape (a
    ConfigError before its launch) while the others run it (and mask that rank); then
    low_latency_clean_mask_buffer (vLLM's recovery: here, an HT-only Buffer, it unmasks
    locally). ``op_timeout_s``: the other ranks' peer bound for op (the wait that masks the
    rejecting rank), set after the dispatch, which keeps the Buffer's (a long one lets a rank
    lag on a loaded machine). Returns op's exception (type and text) or None."""
    buf = state["ep_buf"]
    world, rank = buf.group_size, buf.rank
    mine = _inputs(spec, world)[rank]
    rx, _, _, _, handle, _ = _dispatch(buf, spec, mine, spec["config"])
    if op_timeout_s is not None and rank != rejecting_rank:
        buf.set_timeout(op_timeout_s)
    raised = None
    try:
        if op == "combine":
            buf.combine(rx if rank != rejecting_rank else rx[:-1], handle, config=Config(*spec["config"]))
        else:
            x = _x(spec, mine)
            buf.dispatch(x if rank != rejecting_rank else x[:-1], handle=handle, config=Config(*spec["config"]))
    except Exception as e:  # noqa: BLE001 - the test checks the type and text
        raised = "%s: %s" % (type(e).__name__, str(e)[:400])
    unmask_all(state)
    return raised


def unmask_all(state):
    """low_latency_clean_mask_buffer (an HT-only Buffer: unmasks locally)."""
    state["ep_buf"].low_latency_clean_mask_buffer()


def masked(state):
    """This rank's masked ranks."""
    return out_masked(state["ep_buf"])


def dispatch_checked(state, spec, num_worst_tokens=0):
    """A dispatch of the spec's inputs: (its exception's type and text or None, whether recv_x /
    recv_topk_idx differ from the reference with this rank's masked ranks left out; with
    num_worst_tokens, their first rows)."""
    buf = state["ep_buf"]
    world, rank = buf.group_size, buf.rank
    inputs = _inputs(spec, world)
    try:
        rx, rtk, _, _, _, _ = _dispatch(buf, spec, inputs[rank], spec["config"], num_worst_tokens)
    except Exception as e:  # noqa: BLE001 - the test checks the type and text
        return "%s: %s" % (type(e).__name__, str(e)[:400]), False
    want = _dispatch_ref(spec, inputs, rank, tuple(out_masked(buf)))
    n = want["recv_x"].shape[0]
    return None, not (_same(rx[:n], want["recv_x"]) and _same(rtk[:n], want["recv_topk_idx"]))


def combine_with_config(state, spec, configs):
    """A dispatch of the spec's inputs with its Config, then its combine with Config
    ``configs[rank]`` (ranks may differ). Returns the combine's exception (type and text) or None."""
    buf = state["ep_buf"]
    world, rank = buf.group_size, buf.rank
    rx, _, _, _, handle, _ = _dispatch(buf, spec, _inputs(spec, world)[rank], spec["config"])
    try:
        buf.combine(rx, handle, config=Config(*configs[rank]))
    except Exception as e:  # noqa: BLE001 - the test checks the type and text
        return "%s: %s" % (type(e).__name__, e)
    return None


def dispatch_with_late_data(state, spec, late_rank, stall_s):
    """A dispatch of the spec's inputs; on ``late_rank`` the host stalls ``stall_s`` between the
    notify and the data launch (in _ht_recv_fit). The other ranks keep their receive tensors
    (ep_jobs.keep_returned; ep_jobs.returned_unchanged compares them later). Returns (the
    exception's type or None, this rank's masked ranks, whether its recv_x is in the receive
    pool)."""
    buf = state["ep_buf"]
    world, rank = buf.group_size, buf.rank
    mine = _inputs(spec, world)[rank]
    if rank == late_rank:
        fit = buf._ht_recv_fit

        def stalled(*a, **kw):
            time.sleep(stall_s)
            return fit(*a, **kw)
        buf._ht_recv_fit = stalled
    raised, in_pool = None, False
    try:
        rx, rtk, rw, _, _, _ = _dispatch(buf, spec, mine, spec["config"])
        if rank != late_rank:
            ep_jobs.keep_returned(state, (rx, rtk, rw))
            in_pool = buf._pool.contains(rx)
    except Exception as e:  # noqa: BLE001 - the test checks the type
        raised = type(e).__name__
    finally:
        buf.__dict__.pop("_ht_recv_fit", None)
    return raised, out_masked(buf), in_pool

