"""The p2p transport on the CPU: ranks map each other's soft-NIC heap (the arena, by name) and
the HOST arm's device threads store into it (transport/p2p.cuh; gpunet/transports.py).

Rank processes (mp_ranks.py) in worlds of 2 and 4 over p2p, and of 3 and 4 mixing p2p, ibgda
and proxy per pair (p2p_jobs.mixed). The API's generated exchange against the sequential
reference, atomics and signal-implies-payload are tests/test_api.py's, run on these worlds;
this file adds warp puts at warp sizes 32 and 64, the c500 store-only rule, mapping errors and
what close leaves behind.
"""
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import test_api
from mp_jobs import SLOT_ELEMS, _pattern
from mp_ranks import Ranks

WORLDS = [(2, "p2p"), (4, "p2p"), (3, "mixed"), (4, "mixed")]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda p: "%dranks-%s" % p)
def ranks(request):
    world, kind = request.param
    r = Ranks(world)
    try:
        info = r.run("p2p_jobs:init_mixed") if kind == "mixed" else r.run("init", kind)
        kinds = set(k for i in info for k in i["transports"].values())
        assert kinds == ({"p2p", "ibgda", "proxy"} if kind == "mixed" else {"p2p"}), info
        r.world, r.transport, r.info = world, kind, info
        yield r
    finally:
        r.close()


class TestP2pVerbs(test_api.TestAcrossRanks):
    """tests/test_api.py's put / get / put_signal against the sequential reference, atomics
    exact across ranks and signal-implies-payload, over the p2p and mixed worlds above."""


def _rows():
    """(src_off, dst_off, nbytes) of warp puts: sizes 0..6000 bytes, offsets 0..300 chosen
    independently, so every common alignment of source and destination (1..16 bytes) occurs."""
    def row(s, d, n):
        n = min(n, SLOT_ELEMS - max(s, d))
        return (s, d, n)
    off = st.integers(0, 300)
    return st.lists(st.builds(row, off, off, st.one_of(st.integers(0, 40), st.integers(0, 6000))),
                    min_size=1, max_size=4)


@pytest.mark.parametrize("warp_size", [32, 64])
@settings(max_examples=max(3, settings().max_examples // 10), deadline=None,
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(data=st.data())
def test_warp_put_lands_exactly_at_any_alignment(ranks, warp_size, data):
    """Generated: lists of (src offset, dst offset, size) put with one warp of 32 or 64 lanes
    (put_nbi_warp: lanes share the copy, 16-byte stores where source and destination share the
    alignment, narrower ones elsewhere) from each rank to the next. Invariant: the next rank's
    slot holds exactly what the sequential reference writes (later rows over earlier ones), and
    nothing else changed."""
    rows = data.draw(_rows())
    rnd = 5000 + data.draw(st.integers(0, 1 << 20))
    out = ranks.run("p2p_jobs:warp_put", warp_size, rows, rnd)
    n = ranks.world
    for d in range(n):
        s = (d - 1) % n
        expect = torch.zeros(2 * n * SLOT_ELEMS, dtype=torch.uint8)
        src = _pattern(s, rnd, SLOT_ELEMS)
        for so, do, nb in rows:
            expect[s * SLOT_ELEMS + do: s * SLOT_ELEMS + do + nb] = src[so:so + nb]
        assert torch.equal(out[d], expect), (d, rows)


def test_c500_store_only_rule_refuses_get_and_add():
    """GPUNET_PROFILE=c500, 2 ranks over p2p: a get, an atomic_add and an ADD signal to the peer
    each raise ConfigError naming the store-only rule and the way out, and touch nothing there
    (the get's destination stays zero, the counter stays 0, no ADD reached the signal word);
    put, SET signals (seen by wait_until) and barriers work."""
    r = Ranks(2, env={"GPUNET_PROFILE": "c500"})
    try:
        r.run("init", "p2p")
        out = r.run("p2p_jobs:store_only")
        a, b = out
        for what in ("get", "atomic_add", "signal_add"):
            assert a[what]["raised"] == "ConfigError", (what, a[what])
            assert "store" in a[what]["msg"] and "c500" in a[what]["msg"], a[what]["msg"]
        assert a["get_untouched"]
        assert a["signal_set"]["raised"] is None and a["put"]["raised"] is None, a
        assert a["barrier"]["raised"] is None and b["barrier"]["raised"] is None
        assert b["wait_set"]["raised"] is None, b["wait_set"]
        assert b["ctr"] == 0
        d = b["dst"]
        assert bool((d[:128] == 0).all()), "the refused ADD put_signal moved its payload"
        assert bool((d[128:192] == 7).all()) and bool((d[256:288] == 7).all())
    finally:
        r.close()


def test_a_peer_that_cannot_be_mapped_raises_on_every_rank():
    """transport='p2p' where rank 1's heap cannot be mapped (its export names an arena file that
    does not exist): init raises ConfigError on both ranks, naming peer 1 and what to use."""
    r = Ranks(2)
    try:
        out = r.run("p2p_jobs:init_with_unmappable", 1)
        for o in out:
            assert o["raised"] == "ConfigError", o
        assert "cannot map its heap" in out[0]["msg"] and "peer 1" in out[0]["msg"], out[0]
    finally:
        r.close()


def test_close_unmaps_every_peer_heap():
    """4 ranks over p2p: before close each rank maps the 3 other ranks' arenas (a p2p mapping,
    and the NIC's own); after ctx.close() /proc/self/maps names none of them."""
    r = Ranks(4)
    try:
        info = r.run("init", "p2p")
        arenas = [i["arena"] for i in info]
        out = r.run("p2p_jobs:close_and_count_mappings", arenas)
        for rank, o in enumerate(out):
            assert len(o["heaps"]) == 3, o
            assert all(v >= 1 for v in o["before"].values()), o
            assert all(v == 0 for v in o["after"].values()), (rank, o)
    finally:
        r.close()
