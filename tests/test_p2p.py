"""The p2p transport on the CPU: ranks map each other's soft-NIC heap (the arena, by name) and
the HOST arm's device threads store into it (transport/p2p.cuh; gpunet/transports.py).

Rank processes (mp_ranks.py) in worlds of 2 and 4 over p2p, and of 3 and 4 mixing p2p, ibgda
and proxy per pair (p2p_jobs.mixed). The API's generated exchange against the sequential
reference, atomics and signal-implies-payload are tests/test_api.py's, run on these worlds;
this file adds warp and block puts at warp sizes 32 and 64, the bulk put behind large Python
puts, the c500 store-only rule, mapping errors and what close leaves behind.
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


def _block_rows(draw_list):
    """(src_off, dst_off, nbytes) rows for one bulk launch from drawn (src_off, gap, size)
    triples: destinations laid out one after the other with a gap of 0..300 bytes (rows of one
    launch run on different blocks at once, so their destinations must not overlap), clipped to
    the slot; sources anywhere (offsets 0..300: every common alignment of source and
    destination)."""
    rows, end = [], 0
    for s_off, gap, n in draw_list:
        d_off = end + gap
        n = max(0, min(n, SLOT_ELEMS - d_off, SLOT_ELEMS - s_off))
        rows.append((s_off, min(d_off, SLOT_ELEMS), n))
        end = min(d_off + n, SLOT_ELEMS)
    return rows


@pytest.mark.parametrize("warp_size", [32, 64])
@settings(max_examples=max(3, settings().max_examples // 10), deadline=None,
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(data=st.data())
def test_block_put_lands_exactly_at_any_alignment(ranks, warp_size, data):
    """Generated: 1-4 rows (src offset 0..300, size 0..12000 bytes, disjoint destinations) put
    with ops.cu's bulk put: 1-3 blocks of 1-3 warps of 32 or 64 lanes (plus a partial warp of 7
    lanes or not) share the row list cut in chunks of 16..5000 bytes, each chunk moved by one
    block's put_nbi_block (p2p: the block's threads copy; in the mixed worlds the next rank may
    be ibgda: a piece per warp, or proxy: one command). Invariant: the next rank's slot holds
    exactly the rows' source bytes at their destinations and zeros elsewhere, and every op's ok
    is 1."""
    triple = st.tuples(st.integers(0, 300), st.integers(0, 300),
                       st.one_of(st.integers(0, 40), st.integers(0, 12000)))
    rows = _block_rows(data.draw(st.lists(triple, min_size=1, max_size=4)))
    block = warp_size * data.draw(st.integers(1, 3)) + data.draw(st.sampled_from([0, 0, 7]))
    grid = data.draw(st.integers(1, 3))
    chunk = data.draw(st.one_of(st.integers(16, 5000), st.sampled_from([256, 4096])))
    rnd = 7000 + data.draw(st.integers(0, 1 << 20))
    out = ranks.run("p2p_jobs:block_put", warp_size, block, grid, chunk, rows, rnd)
    n = ranks.world
    for d in range(n):
        s = (d - 1) % n
        assert out[d]["ok"] == [1] * len(rows), (d, out[d]["ok"])
        expect = torch.zeros(2 * n * SLOT_ELEMS, dtype=torch.uint8)
        src = _pattern(s, rnd, SLOT_ELEMS)
        for so, do, nb in rows:
            expect[s * SLOT_ELEMS + do: s * SLOT_ELEMS + do + nb] = src[so:so + nb]
        assert torch.equal(out[d]["dst"], expect), (d, rows, block, grid, chunk)


@pytest.mark.parametrize("batch", [0, 3])
def test_a_large_python_put_to_a_p2p_peer_launches_blocks_for_its_size(ranks, batch):
    """gpunet.put of 600 KiB (batch 3: put_batch of three pieces in one call) to the next rank:
    over p2p the launch is the bulk put with bulk_geometry's blocks (2 blocks of one warp on the
    CPU: a launch of one thread would copy it alone), to a NIC peer the one-thread op list (one
    WQE carries any size); every byte lands."""
    from gpunet._launch import bulk_geometry

    nbytes = 600 << 10
    out = ranks.run("p2p_jobs:big_put", nbytes, 3, batch)
    for r, o in enumerate(out):
        assert o["wrong"] == 0, (r, o)
        assert len(o["launches"]) == 1, o["launches"]
        what, bulk, nops = o["launches"][0]
        assert nops == (batch or 1)
        if o["kind"] == "p2p":
            assert bulk == bulk_geometry(nbytes, False, 32) and bulk[0] == 2, o
        else:
            assert bulk is None, o


def test_bulk_geometry_gives_a_gpu_put_blocks_for_its_bytes():
    """bulk_geometry on a GPU of 132 SMs follows the size tiers (BULK_TIERS_GPU): 4 KiB is one
    block, 1 MiB a block per 8 KiB (128), 2 MiB a block per 16 KiB (128), 256 MiB the cap of 8
    blocks per SM (1056); every geometry's chunks cover the bytes (grid * chunk >= n, chunk a
    multiple of 256) and no block is left without a chunk; the variant is Unroll 4 up to 4 MiB,
    Unroll 8 above (16 MiB: 512 blocks of 32 KiB), weak stores in every tier; the CPU takes the
    one-thread launch below 256 KiB."""
    from gpunet._launch import BULK_BLOCK_GPU, bulk_geometry, bulk_tier

    assert bulk_geometry(4096, True, 32, 132) == (1, BULK_BLOCK_GPU, 4096)
    assert bulk_geometry(1 << 20, True, 32, 132)[0] == 128
    assert bulk_geometry(2 << 20, True, 32, 132)[0] == 128
    assert bulk_geometry(256 << 20, True, 32, 132)[0] == 1056
    assert bulk_geometry(16 << 20, True, 32, 132)[0] == 512
    assert [bulk_tier(n)[2] for n in (1, 1 << 20, 4 << 20, (4 << 20) + 1)] == [2, 2, 2, 3]
    for n in (0, 1, 4095, 4096, 100001, 1 << 20, 3 << 20, 256 << 20):
        grid, block, chunk = bulk_geometry(n, True, 32, 132)
        assert block == BULK_BLOCK_GPU and chunk % 256 == 0 and grid * chunk >= n
        assert n == 0 or (grid - 1) * chunk < n, (n, grid, chunk)
    assert bulk_geometry((256 << 10) - 1, False, 64) is None
    assert bulk_geometry(1 << 20, False, 64) == (2, 64, 512 << 10)


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


def test_a_killed_p2p_peer_is_named_and_close_unmaps():
    """2 ranks over p2p, a 2 s device timeout; rank 1 exits without closing anything (a crash).
    Rank 0's put to it still returns (a store into its heap, still mapped here: no NIC checks a
    p2p peer), its barrier raises gpunet.TimeoutError within the bound and the message names p2p
    peer 1 as gone; ctx.close() then leaves no mapping of rank 1's arena in /proc/self/maps."""
    r = Ranks(2)
    try:
        info = r.run("init", "p2p", 8 << 20, 2.0)
        for q in r.inboxes:
            q.put(("die_if", (1,)))
        assert r.outboxes[0].get(timeout=60) == ("ok", "alive")
        r.procs[1].join(timeout=30)
        r.inboxes[0].put(("p2p_jobs:after_peer_died", (1, info[1]["arena"])))
        status, res = r.outboxes[0].get(timeout=120)
        assert status == "ok", res
        assert res["put"]["raised"] is None, res["put"]
        b = res["barrier"]
        assert b["raised"] == "TimeoutError" and b["seconds"] < 20, b
        assert "p2p peer 1" in b["msg"] and "gone" in b["msg"], b["msg"]
        assert res["before"] >= 1, res
        assert res["after"] == 0, res
    finally:
        r.lose(1)
        r.close()


def test_put_batch_checks_every_pair_before_posting_and_lands_them():
    """One rank over p2p (to itself): put_batch of an empty list does nothing; a list with a bad
    item (not a pair, a tensor outside the heap, a remote too small) raises ConfigError and moves
    no byte of the good pairs before it; three pieces of one tensor land in one launch."""
    import gpunet

    with gpunet.init(transport="p2p", heap_bytes=1 << 20, timeout_s=5.0) as ctx:
        src = ctx.alloc((3000,), torch.uint8)
        dst = ctx.alloc((3000,), torch.uint8)
        src[:] = torch.arange(3000) % 251 + 1
        gpunet.put_batch([])
        good = (ctx.remote(0, dst), src[:10])
        outside = torch.ones(4, dtype=torch.uint8)              # not in the heap
        for bad in ([good, "oops"], [good, (ctx.remote(0, dst), outside)],
                    [good, (ctx.remote(0, dst, 2990), src[:20])]):
            with pytest.raises(gpunet.ConfigError):
                gpunet.put_batch(bad)
            gpunet.quiet()
            assert int(torch.count_nonzero(dst)) == 0, "a refused batch moved bytes"
        cuts = ((0, 7), (7, 1500), (1500, 3000))
        gpunet.put_batch([(ctx.remote(0, dst, a), src[a:b]) for a, b in cuts])
        gpunet.quiet()
        assert torch.equal(dst, src)


def test_close_waits_for_the_peers_that_map_its_heap():
    """2 ranks over p2p, a 10 s bound. Rank 0 puts into rank 1, signals it and closes at once;
    rank 1 goes on reading rank 0's heap and putting into it for 1.5 s, then closes. Rank 0's
    close returns only after rank 1's close began (it waited for the peer that maps its heap,
    so its heap stayed alive under rank 1's loads and stores), within the bound and without the
    warning of an expired one; every byte rank 1 read or wrote back through its mapping was
    right, and rank 0's put had landed."""
    r = Ranks(2)
    try:
        r.run("init", "p2p", 8 << 20, 10.0)
        r0, r1 = r.run("p2p_jobs:close_while_peer_works", 1.5)
        assert r1["landed"] and r1["rounds"] >= 1 and r1["bad"] == 0, r1
        assert r0["close_end"] >= r1["close_start"], (r0, r1)
        assert r0["close_end"] - r0["close_start"] < 10.0, r0
        assert r0["warnings"] == [] and r1["warnings"] == [], (r0, r1)
    finally:
        r.close()


def test_close_is_bounded_when_a_peer_never_closes_and_prompt_when_it_died():
    """2 ranks over p2p, a 2 s bound. Rank 1 stays alive and open for 6 s: rank 0's close gives
    up after the bound (>= 2 s, well before 6 s) with a warning naming peer 1, and rank 1's later
    close returns at once (rank 0 said it was done with rank 1's heap before it waited). Then a
    new pair where rank 1 exits without closing (a crash): rank 0's close does not wait for it
    (its rank is gone: no warning, far below the bound)."""
    r = Ranks(2)
    try:
        r.run("init", "p2p", 8 << 20, 2.0)
        r0, r1 = r.run("p2p_jobs:close_alone", 0, 6.0)
        assert 2.0 <= r0["close_s"] < 6.0, r0
        assert len(r0["warnings"]) == 1 and "peer(s) [1]" in r0["warnings"][0], r0
        assert r1["close_s"] < 2.0 and r1["warnings"] == [], r1
        r.run("init", "p2p", 8 << 20, 8.0)
        for q in r.inboxes:
            q.put(("die_if", (1,)))
        assert r.outboxes[0].get(timeout=60) == ("ok", "alive")
        r.procs[1].join(timeout=30)
        r.inboxes[0].put(("p2p_jobs:close_alone", (0, 0.0)))
        status, res = r.outboxes[0].get(timeout=120)
        assert status == "ok", res
        assert res["close_s"] < 4.0 and res["warnings"] == [], res
    finally:
        r.lose(1)
        r.close()


def replace_rank(r, rank, env=None):
    """Start a new process for ``rank`` of ``r`` (its old one is gone) in a NEW torch.distributed
    group on a new port, and move ``r``'s other ranks there (p2p_jobs.rejoin); ``r`` then runs
    jobs on the new world. Returns the new process."""
    from gpunet.host.bootstrap import free_port
    from mp_ranks import start_rank

    port = free_port()
    for i, q in enumerate(r.inboxes):
        if i != rank:
            q.put(("p2p_jobs:rejoin", (port, r.world, i)))
    proc, inbox, outbox = start_rank(rank, r.world, port, env)
    for i, q in enumerate(r.outboxes):
        if i != rank:
            status, res = q.get(timeout=120)
            assert status == "ok" and res == "joined", (i, status, res)
    r.inboxes[rank], r.outboxes[rank], r.procs[rank] = inbox, outbox, proc
    return proc


def test_a_dead_peers_mapping_is_closed_and_a_new_world_maps_the_new_peer():
    """2 ranks over p2p, a 2 s device timeout; rank 1 exits without closing anything. Rank 0's
    barrier raises a gpunet error within the bound, its close() returns cleanly and leaves no
    mapping of rank 1's arena in /proc/self/maps. Then rank 0 (the same process) and a NEW rank
    1 process form a new world: rank 0 maps the new rank 1's arena (not the dead one's, whose
    file is still in /dev/shm), and puts both ways land byte for byte."""
    r = Ranks(2)
    try:
        info = r.run("init", "p2p", 8 << 20, 2.0)
        old_arena = info[1]["arena"]
        for q in r.inboxes:
            q.put(("die_if", (1,)))
        assert r.outboxes[0].get(timeout=60) == ("ok", "alive")
        r.procs[1].join(timeout=30)
        r.inboxes[0].put(("p2p_jobs:survive_dead_peer", (1,)))
        status, res = r.outboxes[0].get(timeout=120)
        assert status == "ok", res
        assert res["barrier"]["raised"] == "TimeoutError" and res["barrier"]["seconds"] < 20, res
        assert res["close"]["raised"] is None, res["close"]
        assert res["before"][1][2] == old_arena, res["before"]
        r.inboxes[0].put(("p2p_jobs:maps_naming", ([old_arena],)))
        assert r.outboxes[0].get(timeout=60) == ("ok", {old_arena: 0})
        replace_rank(r, 1)
        info2 = r.run("init", "p2p", 8 << 20, 10.0)
        assert info2[0]["pid"] == info[0]["pid"] and info2[1]["pid"] != info[1]["pid"]
        assert info2[1]["arena"] != old_arena
        out = r.run("p2p_jobs:put_both_ways", 7)
        for rank, o in enumerate(out):
            assert all(v == 0 for v in o["wrong"].values()), (rank, o["wrong"])
        assert out[0]["mapped"][1][2] == info2[1]["arena"], out[0]["mapped"]
        maps = r.run("p2p_jobs:maps_naming", [old_arena])
        assert maps[0][old_arena] == 0, maps
    finally:
        r.close()


@pytest.mark.parametrize("warp_size", [32, 64])
@settings(max_examples=max(5, settings().max_examples // 2), deadline=None)
@given(src_off=st.integers(0, 64), dst_off=st.integers(0, 64),
       nbytes=st.one_of(st.integers(0, 64), st.integers(0, 40000)),
       variant=st.integers(0, 3), grid=st.integers(1, 3), warps=st.integers(1, 2),
       chunk_lines=st.integers(1, 40))
def test_p2p_copy_kernel_lands_exactly_for_every_variant_and_geometry(
        warp_size, src_off, dst_off, nbytes, variant, grid, warps, chunk_lines):
    """ops.cu k_put_p2p (one gpunet.put to a p2p peer) on the HOST arm, called directly on plain
    memory. Generated: source and destination offsets 0..64 (every common alignment), sizes
    0..40000 bytes, each variant (Unroll 4 / 8, volatile / weak stores), grids of 1..3 blocks of
    1..2 warps and chunks of 256..10240 bytes (fewer chunks than blocks, or more: blocks take
    several). Invariant: the destination holds exactly the source bytes, nothing around it
    changed."""
    import numpy as np

    from gpunet.device.ops import load_ops

    lib = load_ops("host")
    rng = np.random.default_rng(nbytes * 131 + src_off * 7 + dst_off)
    src = rng.integers(0, 256, nbytes + 128, dtype=np.uint8)
    dst = np.full(nbytes + 128, 0xA5, dtype=np.uint8)
    want = dst.copy()
    want[dst_off:dst_off + nbytes] = src[src_off:src_off + nbytes]
    rc = lib.gpunet_put_p2p_launch(grid, warps * warp_size, warp_size,
                                   dst.ctypes.data + dst_off, src.ctypes.data + src_off, nbytes,
                                   256 * chunk_lines, variant, None, 1)
    assert rc == 0
    assert np.array_equal(dst, want), (nbytes, src_off, dst_off, variant, grid, chunk_lines)
    # bad arguments are refused, nothing launched
    assert lib.gpunet_put_p2p_launch(1, 32, warp_size, dst.ctypes.data, src.ctypes.data, 8, 100,
                                     0, None, 1) != 0
    assert lib.gpunet_put_p2p_launch(1, 32, warp_size, dst.ctypes.data, src.ctypes.data, 8, 256,
                                     4, None, 1) != 0
