"""gpunet/transports.py: per-peer transport wiring across ranks (spawned rank processes, gloo).

The jobs below run in the rank processes (tests/mp_ranks.py, "test_transports:<job>").
"""
import pytest
import torch

import gpunet
from mp_ranks import Ranks

N = 1024


def _pair_proxy_01(a, b):
    """Ranks 0 and 1 reach each other through the proxy; every other pair (and every rank to
    itself) by ibgda: rank 2 never uses the proxy at all."""
    return "proxy" if {a, b} == {0, 1} else "ibgda"


def job_exchange_all_pairs(state):
    """Every rank puts N int32 (its rank * 1000 + peer) into its slot on every peer with a
    signal, waits for every peer's signal, and returns what landed and the transports."""
    with gpunet.init(transport=_pair_proxy_01, heap_bytes=4 << 20, timeout_s=20.0) as ctx:
        me, n = ctx.rank, ctx.world_size
        src = ctx.alloc((n, N), torch.int32)
        dst = ctx.alloc((n, N), torch.int32)
        sig = ctx.alloc((1,), torch.int64)
        for p in range(n):
            src[p] = me * 1000 + p
        ctx.barrier()
        for p in range(n):
            gpunet.put_signal(ctx.remote(p, dst, me * N), src[p], ctx.remote(p, sig))
        gpunet.wait_until(sig, n)
        gpunet.quiet()
        landed = [int(v) for v in dst[:, 0]]
        whole = all(bool((dst[r] == r * 1000 + me).all()) for r in range(n))
        ctx.barrier()
        return {"transports": dict(ctx.transports), "landed": landed, "whole": whole}


@pytest.fixture(scope="module")
def three():
    r = Ranks(3)
    yield r
    r.close()


def test_a_rank_that_never_uses_the_proxy_beside_one_that_does(three):
    """3 ranks: 0 <-> 1 over the proxy, every pair with rank 2 over ibgda, so rank 2 makes no
    proxy QPs while ranks 0 and 1 make one towards it. Init connects only QPs whose peer made a
    partner (before: KeyError on ranks 0 and 1), and every pair exchanges data over its kind."""
    res = three.run("test_transports:job_exchange_all_pairs")
    assert [r["transports"] for r in res] == [
        {0: "ibgda", 1: "proxy", 2: "ibgda"}, {0: "proxy", 1: "ibgda", 2: "ibgda"},
        {0: "ibgda", 1: "ibgda", 2: "ibgda"}]
    for me, r in enumerate(res):
        assert r["landed"] == [s * 1000 + me for s in range(3)], (me, r["landed"])
        assert r["whole"], me
