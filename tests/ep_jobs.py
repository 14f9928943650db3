"""Jobs the EP tests run on every rank (tests/mp_ranks.py runs "ep_jobs:<name>"): build a
gpunet.ep.Buffer, run low-latency dispatch / combine rounds on inputs every rank regenerates from
one seed (so each rank can compute every rank's reference with gpunet.ep.reference), and report
what it checked plus the hashes of what it got. Each job takes the rank's ``state`` dict first."""
import os
import time

import torch
import torch.distributed as dist

import gpunet
from gpunet.ep import Buffer, EPTimeout
from gpunet.ep import reference as ref


def init(state, transport, num_rdma_bytes, timeout_s=20.0, shrink=False, warp_size=32,
         num_blocks=None):
    """Make this rank's Buffer (low-latency mode). ``transport`` is gpunet.init's, or "mixed": the
    pair (a, b) uses the proxy when a + b is odd, ibgda otherwise."""
    if transport == "mixed":
        transport = lambda a, b: "proxy" if (a + b) % 2 else "ibgda"  # noqa: E731 - symmetric per pair
    buf = Buffer(dist.group.WORLD, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                 explicitly_destroy=True, enable_shrink=shrink, transport=transport,
                 timeout_s=timeout_s, warp_size=warp_size, num_blocks=num_blocks)
    state["ep_buf"] = buf
    return {"rank": buf.rank, "transports": dict(buf.runtime.transports), "pid": os.getpid()}


def close(state):
    buf = state.pop("ep_buf", None)
    if buf is not None:
        buf.destroy()
    return "closed"


def _inputs(spec, world):
    return ref.make_rank_inputs(world, spec["t_max"], spec["hidden"], spec["topk"],
                                spec["num_experts"], spec["seed"], holes=spec.get("holes", 0),
                                hot_expert=spec.get("hot_expert"),
                                empty_experts=spec.get("empty_experts", ()),
                                vary_tokens=spec.get("vary_tokens", False),
                                tagged=spec.get("tagged", False))


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


def _hashes(d):
    return {k: ref.hash_tensor(v) for k, v in d.items() if isinstance(v, torch.Tensor)}


def _valid(t, count):
    """The rows [0, count[e]) of every local expert e of a packed tensor (or column-major scales),
    concatenated: what a rerun must reproduce bit for bit (the rest is unspecified)."""
    if t is None:
        return None
    return torch.cat([t[e, :int(count[e])].contiguous().reshape(-1).view(torch.uint8)
                      for e in range(t.shape[0])])


def _check_dispatch(spec, world, rank, inputs, got, masked):
    """Compare a dispatch result with the reference; returns a dict of findings (empty lists = ok)."""
    use_fp8 = spec.get("use_fp8", False)
    recv_x, count, handle = got
    src_info, layout_range = handle[0], handle[1]
    xs = [i["x"] for i in inputs]
    topks = [i["topk_idx"] for i in inputs]
    want_x, want_count, want_src, want_lr = ref.ll_dispatch_ref(
        xs, topks, spec["num_experts"], spec["t_max"], rank, masked_ranks=masked, use_fp8=use_fp8,
        round_scale=spec.get("round_scale", False), use_ue8m0=spec.get("use_ue8m0", False))
    bad = []
    if not torch.equal(count, want_count):
        bad.append("counts %s != reference %s" % (count.tolist(), want_count.tolist()))
    if not torch.equal(layout_range, want_lr):
        bad.append("layout_range differs from the reference")
    # counts against the all-gathered routing, DeepEP's way (independent of the reference's layout)
    e_loc = spec["num_experts"] // world
    exp_counts = ref.ll_expected_counts(topks, spec["num_experts"], rank, masked_ranks=masked)
    if not torch.equal(count, exp_counts):
        bad.append("counts differ from the gathered routing: %s vs %s" % (count.tolist(), exp_counts.tolist()))
    begin, cnt = ref.unpack_layout_range(layout_range)
    if not torch.equal(cnt.sum(dim=1).to(torch.int32), count):
        bad.append("layout_range counts do not add up to recv_count")
    for e in range(e_loc):
        n = int(want_count[e])
        if not torch.equal(src_info[e, :n], want_src[e, :n]):
            bad.append("expert %d: src_info differs" % e)
        if use_fp8:
            q, s = recv_x
            wq, ws = want_x
            if not torch.equal(q[e, :n].view(torch.uint8), wq[e, :n].view(torch.uint8)):
                bad.append("expert %d: fp8 rows differ" % e)
            if not torch.equal(s[e, :n], ws[e, :n]):
                bad.append("expert %d: scales differ" % e)
        else:
            if not torch.equal(recv_x[e, :n], want_x[e, :n]):
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
    return bad, (want_x, want_count, want_src, want_lr)


def round_(state, spec):
    """One dispatch + combine round on every rank (spec: seed, t_max, hidden, topk, num_experts,
    holes, hot_expert, empty_experts, vary_tokens, tagged, use_fp8, round_scale, use_ue8m0, hook,
    zero_copy, stats, masked). Returns findings and hashes."""
    buf = state["ep_buf"]
    world, rank = buf.group_size, buf.rank
    masked = spec.get("masked", ())
    inputs = _inputs(spec, world)
    mine = inputs[rank]
    e_loc = spec["num_experts"] // world
    use_fp8 = spec.get("use_fp8", False)
    hook_mode = spec.get("hook", False)
    cum = torch.zeros(e_loc, dtype=torch.int32) if spec.get("stats") else None
    wstats = torch.zeros(world, world, dtype=torch.int64) if spec.get("stats") else None
    t0 = time.monotonic()
    recv_x, count, handle, event, hook = buf.low_latency_dispatch(
        mine["x"], mine["topk_idx"], spec["t_max"], spec["num_experts"],
        cumulative_local_expert_recv_stats=cum, dispatch_wait_recv_cost_stats=wstats,
        use_fp8=use_fp8, round_scale=spec.get("round_scale", False),
        use_ue8m0=spec.get("use_ue8m0", False), return_recv_hook=hook_mode)
    hook()
    t_dispatch = time.monotonic() - t0
    bad, want = _check_dispatch(spec, world, rank, inputs, (recv_x, count, handle), masked)
    if cum is not None and not torch.equal(cum, count):
        bad.append("cumulative_local_expert_recv_stats %s != counts %s" % (cum.tolist(), count.tolist()))
    if wstats is not None and (bool((wstats < 0).any()) or
                               bool((wstats[[r for r in range(world) if r != rank]] != 0).any())):
        bad.append("dispatch wait stats: negative or outside this rank's row")
    # combine: the expert outputs come from what dispatch delivered; the reference's from the
    # reference dispatch of every rank
    x_c = _expert(_decode(recv_x, use_fp8), rank, e_loc)
    if spec.get("zero_copy"):
        zbuf = buf.get_next_low_latency_combine_buffer(handle)
        zbuf.copy_(x_c)
        x_c = zbuf
    cstats = torch.zeros(world, dtype=torch.int64) if spec.get("stats") else None
    t0 = time.monotonic()
    combined, cevent, chook = buf.low_latency_combine(
        x_c, mine["topk_idx"], mine["topk_weights"], handle, zero_copy=spec.get("zero_copy", False),
        return_recv_hook=spec.get("combine_hook", hook_mode), combine_wait_recv_cost_stats=cstats)
    chook()
    t_combine = time.monotonic() - t0
    xs = [i["x"] for i in inputs]
    topks = [i["topk_idx"] for i in inputs]
    expert_outs, handles = [], []
    for o in range(world):
        rx, rc, rs, rl = ref.ll_dispatch_ref(xs, topks, spec["num_experts"], spec["t_max"], o,
                                             masked_ranks=masked, use_fp8=use_fp8,
                                             round_scale=spec.get("round_scale", False),
                                             use_ue8m0=spec.get("use_ue8m0", False))
        expert_outs.append(_expert(_decode(rx, use_fp8), o, e_loc))
        handles.append((rs, rl, spec["t_max"], spec["hidden"], spec["num_experts"]))
    want_c = ref.ll_combine_ref(expert_outs, mine["topk_idx"], mine["topk_weights"], handles, rank,
                                masked_ranks=masked)
    diff = ref.calc_diff(combined, want_c) if combined.numel() else 0.0
    nan = bool(torch.isnan(combined.float()).any())
    out = {"bad": bad, "calc_diff": diff, "nan": nan, "count": count.tolist(),
           "hashes": _hashes({"count": count, "src_info": _valid(handle[0], count),
                              "layout_range": handle[1], "combined": combined,
                              "recv_x": _valid(recv_x[0] if use_fp8 else recv_x, count),
                              "scales": _valid(recv_x[1], count) if use_fp8 else None}),
           "t_dispatch": t_dispatch, "t_combine": t_combine,
           "masked": buf.masked_ranks() if buf.enable_shrink else []}
    if cstats is not None:
        out["combine_wait"] = cstats.tolist()
    return out
