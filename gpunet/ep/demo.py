"""``python -m gpunet ep-demo``: a small MoE layer over N rank processes with gpunet.ep.Buffer.

Each rank holds T tokens. A random router (softmax over experts, top-k, weights renormalised)
picks experts; ``low_latency_dispatch`` moves every token to the ranks of its experts, packed per
local expert; each rank runs a tiny MLP per local expert (H -> F -> H, SiLU) on its packed rows;
``low_latency_combine`` brings the outputs back, weighted. The parent process then computes the
same layer in plain torch, in one process, for every rank's tokens, and checks each rank's output
with ``torch.testing.assert_close(atol=rtol=6e-2)`` (vLLM's bound for its DeepEP MoE test). It
prints a table of dispatch / combine times (median of --iters calls, a barrier before each) and
of the check.

On the CPU (the default) the ranks run on soft mlx5 NICs and the kernels on the HOST arm: the
times show the stack working end to end, not a network.
"""
import argparse
import json
import statistics
import time

import torch

MOE_ATOL = MOE_RTOL = 6e-2     # vLLM tests/kernels/moe/test_deepep_moe.py's bound for a DeepEP MoE


def buffer_transport(buf):
    """The transports a Buffer's Context uses, e.g. "ibgda" or "ibgda+proxy" (a mixed world)."""
    ctx = getattr(buf, "runtime", None)
    kinds = sorted(set(getattr(ctx, "transports", {}).values())) if ctx is not None else []
    return "+".join(kinds) or "?"


def make_layer(hidden, ffn, num_experts, seed):
    """The layer's parameters, identical on every rank (one seed): router [H, E], w1 [E, H, F],
    w2 [E, F, H], all float32."""
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(hidden, num_experts, generator=g) / hidden ** 0.5
    w1 = torch.randn(num_experts, hidden, ffn, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, ffn, hidden, generator=g) / ffn ** 0.5
    return router, w1, w2


def make_tokens(rank, num_tokens, hidden, seed):
    """Rank ``rank``'s input tokens: bf16 [T, H]."""
    g = torch.Generator().manual_seed(seed * 7919 + rank + 1)
    return torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)


def route(x, router, num_topk):
    """Top-k routing: (topk_idx int64 [T, K], topk_weights float32 [T, K], renormalised)."""
    probs = torch.softmax(x.float() @ router, dim=1)
    w, idx = probs.topk(num_topk, dim=1)
    return idx.to(torch.int64), (w / w.sum(1, keepdim=True)).float()


def expert_mlp(rows, w1, w2):
    """One expert on rows [n, H] (any float dtype): silu(rows @ w1) @ w2 in float32."""
    return torch.nn.functional.silu(rows.float() @ w1) @ w2


def run_local_experts(rows, count, rank, w1, w2):
    """Rank ``rank``'s experts on their packed rows: rows [E_loc, N, H] (float or bf16), count
    [E_loc] int32 -> bf16 [E_loc, N, H] with MLP outputs in the first count rows, zeros after."""
    e_loc = rows.shape[0]
    out = torch.zeros(rows.shape, dtype=torch.bfloat16)
    for le in range(e_loc):
        n = int(count[le])
        if n:
            ge = rank * e_loc + le
            out[le, :n] = expert_mlp(rows[le, :n], w1[ge], w2[ge]).to(torch.bfloat16)
    return out


def torch_moe(x, topk_idx, topk_weights, w1, w2):
    """The layer in one process: out[t] = sum_k w[t, k] * MLP_{topk_idx[t, k]}(x[t]); bf16 [T, H]."""
    out = torch.zeros(x.shape[0], w2.shape[2])
    for e in topk_idx.unique().tolist():
        sel = topk_idx == e
        toks = sel.any(1).nonzero().view(-1)
        wt = (topk_weights * sel).sum(1)[toks]
        out[toks] += wt.view(-1, 1) * expert_mlp(x[toks], w1[e], w2[e])
    return out.to(torch.bfloat16)


def _rank_main(rank, world, args):
    """One rank: dispatch -> expert MLPs on the packed rows -> combine, timed; returns this rank's
    output and times to the parent (through rank 0)."""
    import torch.distributed as dist

    from gpunet.ep import Buffer
    from gpunet.ep.reference import per_token_cast_back

    E, H, T = args["experts"], args["hidden"], args["tokens"]
    e_loc = E // world
    router, w1, w2 = make_layer(H, args["ffn"], E, args["seed"])
    x = make_tokens(rank, T, H, args["seed"])
    topk_idx, topk_w = route(x, router, args["topk"])
    hint = Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    buf = Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True, num_qps_per_rank=e_loc,
                 explicitly_destroy=True, transport=args["transport"], timeout_s=args["timeout_s"])
    times = {"dispatch": [], "combine": []}
    try:
        for _ in range(args["iters"]):
            dist.barrier()
            t0 = time.perf_counter()
            recv, count, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, T, E,
                                                                 use_fp8=args["fp8"])
            times["dispatch"].append(time.perf_counter() - t0)
            if args["fp8"]:
                q, s = recv
                rows = per_token_cast_back(q.reshape(-1, H), s.reshape(-1, s.shape[2]))
                rows = rows.view(q.shape)
            else:
                rows = recv
            expert_out = run_local_experts(rows, count, rank, w1, w2)
            dist.barrier()
            t0 = time.perf_counter()
            out = buf.low_latency_combine(expert_out, topk_idx, topk_w, handle)[0]
            times["combine"].append(time.perf_counter() - t0)
        mine = {"rank": rank, "out": out, "times": times,
                "selections": int((topk_idx != -1).sum()),
                "transport": buffer_transport(buf)}
    finally:
        buf.destroy()
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone if rank == 0 else None


def check(results, args, world):
    """Per rank: (max |out - torch_moe|, passed, message) against the one-process torch layer."""
    router, w1, w2 = make_layer(args["hidden"], args["ffn"], args["experts"], args["seed"])
    checks = []
    for r in range(world):
        x = make_tokens(r, args["tokens"], args["hidden"], args["seed"])
        idx, w = route(x, router, args["topk"])
        want = torch_moe(x, idx, w, w1, w2)
        got = results[r]["out"]
        err = float((got.float() - want.float()).abs().max()) if got.numel() else 0.0
        try:
            torch.testing.assert_close(got.float(), want.float(), atol=MOE_ATOL, rtol=MOE_RTOL)
            checks.append((err, True, "OK"))
        except AssertionError as e:
            checks.append((err, False, str(e).splitlines()[0]))
    return checks


def table(results, checks, args, world):
    from gpunet.ep.reference import selection_bytes

    H = args["hidden"]
    lines = ["gpunet ep-demo: %d ranks, %d tokens/rank, hidden %d, %d experts, top-%d, expert MLP "
             "%d->%d->%d, %s dispatch, transport %s, %s"
             % (world, args["tokens"], H, args["experts"], args["topk"], H, args["ffn"], H,
                "FP8" if args["fp8"] else "BF16", results[0]["transport"],
                time.strftime("%Y-%m-%d")),
             "times: median of %d calls, a barrier before each; GB/s with DeepEP's byte count "
             "(selections x %s B dispatch, x %d B combine)"
             % (args["iters"], selection_bytes(H, "dispatch fp8" if args["fp8"] else
                                               "dispatch bf16"), selection_bytes(H, "combine")),
             ""]
    fmt = "%4s %10s %13s %9s %13s %9s %12s  %s"
    lines.append(fmt % ("rank", "selections", "dispatch us", "GB/s", "combine us", "GB/s",
                        "max |err|", "vs torch MoE (atol=rtol=6e-2)"))
    lines.append("-" * 100)
    for r, (res, (err, ok, msg)) in enumerate(zip(results, checks)):
        d = statistics.median(res["times"]["dispatch"])
        c = statistics.median(res["times"]["combine"])
        nd = res["selections"] * selection_bytes(H, "dispatch fp8" if args["fp8"] else
                                                 "dispatch bf16")
        nc = res["selections"] * selection_bytes(H, "combine")
        lines.append(fmt % (r, res["selections"], "%.1f" % (d * 1e6), "%.3f" % (nd / d / 1e9),
                            "%.1f" % (c * 1e6), "%.3f" % (nc / c / 1e9), "%.4f" % err, msg))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpunet ep-demo", description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="rank processes (>= 2)")
    p.add_argument("--tokens", type=int, default=32, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=256, help="a multiple of 128")
    p.add_argument("--experts", type=int, default=8, help="a multiple of --ranks")
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--ffn", type=int, default=128, help="expert MLP inner width")
    p.add_argument("--fp8", action="store_true", help="FP8 dispatch (rows cast back for the MLP)")
    p.add_argument("--iters", type=int, default=5, help="timed dispatch/combine rounds")
    p.add_argument("--transport", default="auto", help="auto | ibgda | proxy")
    p.add_argument("--timeout-s", type=float, default=60.0, help="bound on every device wait")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the table's rows as JSON here")
    a = p.parse_args(argv)
    if a.ranks < 2:
        p.error("--ranks must be >= 2")
    if a.experts % a.ranks:
        p.error("--experts (%d) must be a multiple of --ranks (%d)" % (a.experts, a.ranks))
    if a.hidden % 128:
        p.error("--hidden must be a multiple of 128")
    if not 1 <= a.topk <= a.experts:
        p.error("--topk must be in [1, --experts]")
    if a.iters < 1:
        p.error("--iters must be >= 1")
    args = vars(a)
    from gpunet.demo import run_ranks_cli

    results = run_ranks_cli(_rank_main, a.ranks, args, "gpunet ep-demo")
    if results is None:
        return 1
    checks = check(results, args, a.ranks)
    print(table(results, checks, args, a.ranks))
    ok = all(c[1] for c in checks)
    print("\nMoE output vs the one-process torch layer: %s" % ("PASS" if ok else "FAIL"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": args, "ok": ok,
                       "rows": [{"rank": r["rank"], "selections": r["selections"],
                                 "dispatch_us": [t * 1e6 for t in r["times"]["dispatch"]],
                                 "combine_us": [t * 1e6 for t in r["times"]["combine"]],
                                 "max_abs_err": c[0], "ok": c[1]}
                                for r, c in zip(results, checks)]}, f, indent=1)
    return 0 if ok else 1
