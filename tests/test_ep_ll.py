"""gpunet.ep low-latency dispatch / combine across rank processes (HOST arm, soft NIC), checked
DeepEP's way (EP-ANCHORS.md §B) against gpunet.ep.reference: exact packed rows, counts against the
gathered routing, layout ranges, self-describing rows, combine within calc_diff bounds, the mode
matrix, same-seed reruns, two LL calls in flight, and killed ranks (masked, or raised).

Each world (ranks x transport x warp size) is one pool of rank processes (tests/mp_ranks.py) that
runs "ep_jobs:*" jobs (tests/ep_jobs.py); every rank regenerates every rank's inputs from the seed
and compares its own results with the reference, returning findings and hashes. Worlds in CI:
2 ranks ibgda warp 32, 2 ranks proxy warp 64, 4 ranks mixed (ibgda and proxy pairs) warp 32,
4 ranks ibgda warp 64, and 3-rank worlds that lose a rank (ibgda, proxy, mixed).
"""
import itertools

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from gpunet.ep import Buffer
from mp_ranks import Ranks

# Small shapes: the HOST arm runs every device thread as an OS thread on the CI machine's 2 cores.
BASE = dict(t_max=8, hidden=256, topk=4, holes=3)
EXPERTS_PER_RANK = 4
BF16_BOUND = 1e-5          # DeepEP's calc_diff bounds for combine
FP8_BOUND = 9e-4
# The generated test's largest shape (the Buffer of its world is sized for it).
GEN_T_MAX, GEN_HIDDEN, GEN_EXPERTS_PER_RANK = 16, 384, 8


def _pool(world, transport, warp_size, shrink=False, timeout_s=30.0, num_rdma_bytes=None):
    nbytes = num_rdma_bytes or Buffer.get_low_latency_rdma_size_hint(
        BASE["t_max"], BASE["hidden"], world, EXPERTS_PER_RANK * world)
    r = Ranks(world)
    try:
        info = r.run("ep_jobs:init", transport, nbytes, timeout_s, shrink, warp_size, timeout=180)
    except BaseException:
        r.close()
        raise
    r.world, r.transport, r.info = world, transport, info
    return r


def _close(r):
    try:
        r.run("ep_jobs:close", timeout=60)
    finally:
        r.close()


def _spec(world, seed, **kw):
    s = dict(BASE, seed=seed, num_experts=EXPERTS_PER_RANK * world)
    s.update(kw)
    return s


def _assert_round(out, spec, bound=None):
    bound = bound if bound is not None else (FP8_BOUND if spec.get("use_fp8") else BF16_BOUND)
    for rank, o in enumerate(out):
        assert o["raised"] is None, "rank %d raised %r (spec %r)" % (rank, o["raised"], spec)
        assert o["bad"] == [], "rank %d: %s (spec %r)" % (rank, o["bad"], spec)
        assert not o["nan"], "rank %d: NaN in the combined output (spec %r)" % (rank, spec)
        assert o["calc_diff"] < bound, "rank %d: combine calc_diff %.3g >= %.1g (spec %r)" % (
            rank, o["calc_diff"], bound, spec)


# The mode matrix: hook x FP8 (x round_scale x UE8M0) x zero_copy (DeepEP's test_low_latency.py).
MODES = [dict(hook=h, use_fp8=False, zero_copy=z) for h, z in itertools.product((False, True), repeat=2)] + \
    [dict(hook=h, use_fp8=True, round_scale=rs, use_ue8m0=u, zero_copy=z)
     for h, z in itertools.product((False, True), repeat=2)
     for rs, u in ((False, False), (True, False), (True, True))]


def _mode_id(m):
    return "-".join(k for k, v in sorted(m.items()) if v) or "bf16"


@pytest.fixture(scope="module")
def ibgda2():
    r = _pool(2, "ibgda", 32, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(
        GEN_T_MAX, GEN_HIDDEN, 2, GEN_EXPERTS_PER_RANK * 2))
    yield r
    _close(r)


@pytest.fixture(scope="module")
def proxy2():
    r = _pool(2, "proxy", 64)
    yield r
    _close(r)


@pytest.fixture(scope="module")
def mixed4():
    r = _pool(4, "mixed", 32)
    yield r
    _close(r)


@pytest.fixture(scope="module")
def ibgda4():
    r = _pool(4, "ibgda", 64)
    yield r
    _close(r)


# ---- 2 ranks, ibgda, warps of 32 ----------------------------------------------------------------
def test_tagged_bf16_rows_land_exactly_where_the_reference_puts_them(ibgda2):
    """DeepEP's self-describing rows (rank - 128 in every column, the token index in the last 128),
    -1 holes: every rank receives exactly the reference's packed rows, src_info, counts (also
    against the gathered routing) and layout ranges, and every row's columns name its source rank
    and token; combine is within DeepEP's BF16 bound of the float32 reference."""
    spec = _spec(2, seed=11, tagged=True)
    _assert_round(ibgda2.run("ep_jobs:round_", spec), spec)


@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_mode_matrix_over_ibgda(ibgda2, mode):
    """Every combination of hook, FP8, round_scale, UE8M0 and zero_copy: the dispatch rows (fp8
    bytes and scales bit for bit, the scales column-major) and layout equal the reference's, and
    combine is within DeepEP's bound (BF16 1e-5, FP8 9e-4). Each mode runs twice, so both LL
    buffers are dirty when it is checked."""
    for seed in (21, 22):
        spec = _spec(2, seed=seed, **mode)
        _assert_round(ibgda2.run("ep_jobs:round_", spec), spec)


def test_same_seed_reruns_hash_identically(ibgda2):
    """The same inputs give bit-identical outputs on every rerun (DeepEP's pressure test): the
    packed rows, counts, layouts, src_info and the combined output (a fixed reduction order)."""
    for mode in (dict(), dict(use_fp8=True, round_scale=True, use_ue8m0=True)):
        spec = _spec(2, seed=5, hot_expert=1, **mode)
        first = [o["hashes"] for o in ibgda2.run("ep_jobs:round_", spec)]
        for _ in range(4):
            again = [o["hashes"] for o in ibgda2.run("ep_jobs:round_", spec)]
            assert again == first, "a rerun of %r hashed differently" % spec
        other = [o["hashes"] for o in ibgda2.run("ep_jobs:round_", dict(spec, seed=6))]
        assert other != first, "a different seed hashed the same: the hashes see nothing"


def test_two_dispatches_in_flight_use_both_buffers(ibgda2):
    """Dispatch A and B before receiving either (hooks), then both combines: each result is its
    own reference's (the two LL buffers keep them apart)."""
    a = _spec(2, seed=31)
    b = _spec(2, seed=32, use_fp8=True, topk=2)
    for rank, res in enumerate(ibgda2.run("ep_jobs:two_in_flight", a, b)):
        for name in ("a", "b"):
            assert res[name]["bad"] == [], "rank %d dispatch %s: %s" % (rank, name, res[name]["bad"])
            bound = FP8_BOUND if name == "b" else BF16_BOUND
            assert res[name]["calc_diff"] < bound, (rank, name, res[name]["calc_diff"])


def test_receive_stats_accumulate_the_counts_and_per_peer_waits(ibgda2):
    """cumulative_local_expert_recv_stats += the counts; the [R, R] wait-cost matrices get this
    rank's row only, non-negative (checked in the job), for dispatch and combine."""
    spec = _spec(2, seed=41, stats=True)
    out = ibgda2.run("ep_jobs:round_", spec)
    _assert_round(out, spec)
    for o in out:
        assert len(o["dispatch_wait"]) == 2 and all(v >= 0 for v in o["dispatch_wait"])
        assert len(o["combine_wait"]) == 2 and all(v >= 0 for v in o["combine_wait"])


def test_empty_and_hot_experts_and_ranks_without_tokens(ibgda2):
    """Experts nobody selects (count 0, empty ranges), a hot expert half the tokens select, and
    token counts that vary by rank (some rank may send nothing): still the reference's layout."""
    for seed in (51, 52, 53):
        spec = _spec(2, seed=seed, hot_expert=5, empty_experts=(0, 6), vary_tokens=True, holes=6)
        _assert_round(ibgda2.run("ep_jobs:round_", spec), spec)


def test_mask_api_needs_enable_shrink(ibgda2):
    """Without enable_shrink the mask calls raise ConfigError on every rank (DeepEP asserts)."""
    with pytest.raises(AssertionError, match="enable_shrink"):
        ibgda2.run("ep_jobs:mask", "query")


@settings(max_examples=max(3, settings().max_examples // 10), deadline=None,
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(data=st.data())
def test_generated_shapes_and_routings_match_the_reference(ibgda2, data):
    """Generated: hidden (128..384), tokens per rank (1..16, varying by rank), experts per rank
    (1..8), top-k (1..min(16, experts)), -1 holes, a hot expert, empty experts, BF16 or FP8
    (round_scale, UE8M0), hook or not. Invariant: the dispatch equals the reference bit for bit
    on every rank and combine is within DeepEP's bound. (Few examples in CI; no shrinking: each
    costs a round trip through the ranks.)"""
    world = 2
    epr = data.draw(st.integers(1, GEN_EXPERTS_PER_RANK), "experts per rank")
    e = epr * world
    k = data.draw(st.integers(1, min(16, e)), "topk")
    fp8 = data.draw(st.booleans(), "fp8")
    rs = fp8 and data.draw(st.booleans(), "round_scale")
    spec = dict(seed=data.draw(st.integers(0, 2 ** 20), "seed"),
                t_max=data.draw(st.integers(1, GEN_T_MAX), "t_max"),
                hidden=128 * data.draw(st.integers(1, GEN_HIDDEN // 128), "hidden/128"),
                topk=k, num_experts=e, holes=data.draw(st.integers(0, 8), "holes"),
                vary_tokens=data.draw(st.booleans(), "vary"),
                hot_expert=data.draw(st.one_of(st.none(), st.integers(0, e - 1)), "hot"),
                use_fp8=fp8, round_scale=rs, use_ue8m0=rs and data.draw(st.booleans(), "ue8m0"),
                hook=data.draw(st.booleans(), "hook"))
    if spec["hot_expert"] is not None and e - 1 < k:
        spec["hot_expert"] = None
    _assert_round(ibgda2.run("ep_jobs:round_", spec), spec)


# ---- 2 ranks, proxy, warps of 64 ----------------------------------------------------------------
@pytest.mark.parametrize("mode", [m for m in MODES if m["hook"] == m["zero_copy"]], ids=_mode_id)
def test_mode_matrix_over_the_proxy_with_warps_of_64(proxy2, mode):
    """The mode matrix (hook and zero_copy together) through the CPU proxy with 64-lane warps."""
    spec = _spec(2, seed=61, **mode)
    _assert_round(proxy2.run("ep_jobs:round_", spec), spec)


def test_varying_tokens_over_the_proxy(proxy2):
    """Varying token counts per rank, hot and empty experts, through the proxy."""
    spec = _spec(2, seed=62, vary_tokens=True, hot_expert=2, empty_experts=(7,), tagged=True)
    _assert_round(proxy2.run("ep_jobs:round_", spec), spec)


# ---- 4 ranks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [dict(), dict(use_fp8=True, hook=True),
                                  dict(use_fp8=True, round_scale=True, use_ue8m0=True, zero_copy=True)],
                         ids=_mode_id)
def test_four_ranks_mixed_transports(mixed4, mode):
    """4 ranks where the pairs (a, b) with a + b odd go through the proxy and the others by ibgda:
    varying tokens per rank, holes, a hot expert; dispatch exact, combine within bounds."""
    assert {t for i in mixed4.info for t in i["transports"].values()} == {"ibgda", "proxy"}
    spec = _spec(4, seed=71, vary_tokens=True, hot_expert=3, tagged=not mode, **mode)
    _assert_round(mixed4.run("ep_jobs:round_", spec), spec)


def test_four_ranks_two_in_flight_mixed(mixed4):
    """Two dispatches in flight over the mixed world."""
    for rank, res in enumerate(mixed4.run("ep_jobs:two_in_flight", _spec(4, seed=72),
                                          _spec(4, seed=73, topk=3, vary_tokens=True))):
        for name in ("a", "b"):
            assert res[name]["bad"] == [] and res[name]["calc_diff"] < BF16_BOUND, (rank, name, res)


@pytest.mark.parametrize("mode", [dict(), dict(use_fp8=True, round_scale=True, hook=True)],
                         ids=_mode_id)
def test_four_ranks_ibgda_warps_of_64(ibgda4, mode):
    """4 ranks over ibgda with 64-lane warps (a tile of the plan is 64 tokens), top-k 6."""
    spec = _spec(4, seed=81, topk=6, vary_tokens=True, empty_experts=(1, 2), **mode)
    _assert_round(ibgda4.run("ep_jobs:round_", spec), spec)


# ---- a rank that dies ---------------------------------------------------------------------------
VICTIM = 2


def _kill_round(transport, shrink, stage, warp_size=32):
    """3 ranks; rank 2 exits at the start of `stage`. Returns (survivors' outputs, the pool, the
    spec) with the pool reduced to the survivors (the caller closes it)."""
    r = _pool(3, transport, warp_size, shrink=shrink, timeout_s=3.0)
    spec = _spec(3, seed=91, die=(VICTIM, stage))
    for q in r.inboxes:
        q.put(("ep_jobs:round_", (spec,)))
    outs = []
    for i in (0, 1):
        status, val = r.outboxes[i].get(timeout=120)
        outs.append((status, val))
    r.procs[VICTIM].join(timeout=30)
    r.inboxes, r.outboxes = r.inboxes[:VICTIM], r.outboxes[:VICTIM]
    return outs, r, spec


def _close_survivors(r):
    try:
        r.run("ep_jobs:close", timeout=60)
    finally:
        victim = r.procs[VICTIM]
        if victim.is_alive():
            victim.kill()
        r.procs = r.procs[:VICTIM]
        r.close()


@pytest.mark.parametrize("transport,stage", [("ibgda", "dispatch"), ("proxy", "combine")])
def test_a_dead_rank_is_masked_and_the_survivors_go_on(transport, stage):
    """enable_shrink: rank 2 exits at the start of dispatch (or of combine). The survivors finish
    that call within the timeout, with rank 2 counted 0 (dispatch) and its experts left out of
    combine; the mask names it; the next round among the survivors skips it from the start and
    matches the reference with rank 2 masked."""
    outs, r, spec = _kill_round(transport, True, stage)
    try:
        for status, o in outs:
            assert status == "ok", o
        _assert_round([o for _, o in outs], spec)
        for _, o in outs:
            assert o["masked"] == [VICTIM], o["masked"]
        assert r.run("ep_jobs:mask", "query") == [[0, 0, 1]] * 2
        nxt = _spec(3, seed=92, masked=(VICTIM,), use_fp8=True)
        _assert_round(r.run("ep_jobs:round_", nxt), nxt)
        assert r.run("ep_jobs:clean", nxt) == [[VICTIM]] * 2
    finally:
        _close_survivors(r)


@pytest.mark.parametrize("transport,stage", [("mixed", "dispatch"), ("ibgda", "combine")])
def test_a_dead_rank_raises_ep_timeout_without_shrink(transport, stage):
    """Without enable_shrink: rank 2 exits at the start of dispatch (or combine); every survivor
    raises gpunet.EPTimeout from that call, naming rank 2 as silent and the phase, within a
    bounded time."""
    outs, r, spec = _kill_round(transport, False, stage)
    try:
        for status, o in outs:
            assert status == "ok", o
            assert o["raised"] is not None, "no EPTimeout: %r" % (o,)
            assert o["raised"]["phase"] == stage
            assert o["raised"]["peers_silent"] == [VICTIM]
            assert o["raised"]["counts_seen"][VICTIM] is None
    finally:
        _close_survivors(r)
