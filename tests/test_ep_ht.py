"""gpunet.ep high-throughput dispatch / combine across rank processes (HOST arm, soft NIC), checked
DeepEP's way (EP-ANCHORS.md §B) and against gpunet.ep.reference's HT references: the layout against
a token-by-token computation, rows exactly where the reference puts them (source-rank order, token
order, local expert ids, weights), counts against the all-reduced layout, combine / fan-out == x
within DeepEP's bounds and bit-equal to the float32 reference, cached handles, num_worst_tokens,
async and previous-event variants, generated shapes and skewed routings, tokens sent once per
destination rank (not once per expert), HT then LL on one Buffer, a too-small buffer refused,
killed ranks (masked or raised).

Worlds (tests/mp_ranks.py pools running "ep_ht_jobs:*"): 2 ranks ibgda warp 32, 2 ranks proxy
warp 64, 2 ranks p2p warp 64 (also an LL buffer: HT then LL), 4 ranks mixed (ibgda and proxy
pairs) warp 32, 4 ranks p2p and proxy pairs warp 32, and 3-rank worlds that lose a rank (masked:
at combine over the proxy, at dispatch over p2p; raised: at dispatch mixed, at combine over p2p;
a survivor late from waiting out the dead rank, over p2p and ibgda).
"""
import shutil

import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

import torch

from gpunet.device import abi
from gpunet.device import ep as dep
from gpunet.ep import Buffer, Config
from gpunet.ep import reference as ref
from gpunet.errors import ConfigError
from mp_ranks import Ranks
import ep_ht_jobs
import ep_jobs

BASE = dict(tokens=24, hidden=256, topk=4, holes=3)
EXPERTS_PER_RANK = 4
BF16_BOUND, FP8_BOUND, WEIGHT_BOUND = 5e-6, 5e-4, 1e-9
# Small rings (48 slots, chunks of 4) so rounds wrap them; one channel (2 blocks: every device
# thread is an OS thread on the CI machine's 2 cores), TWO where a test says so.
SMALL = (2, 4, 48)
TWO_CHANNELS = (4, 4, 48)
HIDDEN_MAX = 384
# The generated test runs on these pools (fixtures of this module, started for other tests too):
# ibgda, all p2p, and a mixed world (p2p and proxy pairs), so every transport is generated over.
GEN_WORLDS = ("ibgda2", "p2p2", "p2p_proxy4")
# Its example budget: what the one ibgda world had (max_examples // 10, at least 3), split over
# the worlds, at least 2 each (CI: 2 + 2 + 2 against 5 before; each example is a round trip).
GEN_EXAMPLES = max(2, -(-max(3, settings().max_examples // 10) // len(GEN_WORLDS)))
# The p2p pool's LL buffer (test_ht_then_ll_with_a_clean_between's LL round).
LL_BYTES = Buffer.get_low_latency_rdma_size_hint(8, 256, 2, 8)
# The receive pool (Buffer's recv_pool_bytes) of the p2p worlds below: p2p peers store their rows
# straight into its receive tensors (ht.cuh "the receive pool"); room for several rounds' tensors.
RECV_POOL = 8 << 20
# A peer bound for waits that must not run out: a rank can lag by seconds on a loaded CI machine.
LONG_TIMEOUT_S = 20.0


def _nbytes(world, config=TWO_CHANNELS, hidden=HIDDEN_MAX):
    return Config(*config).get_nvl_buffer_size_hint(hidden * 2, world)


def _pool(world, transport, warp_size, shrink=False, timeout_s=30.0, env=None, num_nvl_bytes=None,
          num_rdma_bytes=0, low_latency_mode=False, recv_pool_bytes=0):
    """Rank processes with an HT Buffer each (ep_ht_jobs.init); transport "p2p-pool": p2p with a
    receive pool of RECV_POOL bytes."""
    if transport == "p2p-pool":
        transport, recv_pool_bytes = "p2p", recv_pool_bytes or RECV_POOL
    return Ranks.start(world, "ep_ht_jobs:init", transport, num_nvl_bytes or _nbytes(world), timeout_s,
                       shrink, warp_size, num_rdma_bytes, low_latency_mode, recv_pool_bytes, env=env,
                       timeout=180)


def _close(r):
    r.close_with("ep_ht_jobs:close")


def _spec(world, seed, **kw):
    s = dict(BASE, seed=seed, num_experts=EXPERTS_PER_RANK * world, config=SMALL)
    s.update(kw)
    return s


def _assert_round(out, spec, why=""):
    """Every rank's round output raised nothing, found nothing and combined within the bound;
    ``why`` ends each message (a test's timings)."""
    bound = FP8_BOUND if spec.get("fp8") else BF16_BOUND
    for rank, o in enumerate(out):
        assert o["raised"] is None, "rank %d raised %r (spec %r) %s" % (rank, o["raised"], spec, why)
        assert o["bad"] == [], "rank %d: %s (spec %r) %s" % (rank, o["bad"], spec, why)
        assert not o["nan"], "rank %d: NaN in combined_x %s" % (rank, why)
        assert o["calc_diff"] < bound, "rank %d: combine / fan-out vs x calc_diff %.3g >= %.1g (spec %r) %s" % (
            rank, o["calc_diff"], bound, spec, why)
        if o["weights_diff"] is not None:
            assert o["weights_diff"] < WEIGHT_BOUND, (rank, o["weights_diff"], why)


def test_the_c500_profile_runs_ht_rounds_over_p2p():
    """GPUNET_PROFILE=c500 (p2p store-only: no remote load, no remote atomic), 2 ranks over p2p:
    a tagged BF16 and an FP8 high-throughput round are exact (the LL side, its clean included:
    tests/test_ep_ll.py test_the_c500_profile_runs_rounds_and_cleans_over_p2p)."""
    r = _pool(2, "p2p", 32, env={"GPUNET_PROFILE": "c500"})
    try:
        for spec in (_spec(2, seed=30, tagged=True), _spec(2, seed=31, fp8=True)):
            outs = r.run("ep_ht_jobs:round_", spec)
            _assert_round(outs, spec)
            assert not any(o["in_pool"] for o in outs)      # no receive pool: the rings
    finally:
        _close(r)


# ht.cuh ht_reduce_bulk (the combine receiver with warps of 32) sums a token's rows in stages of
# 4 KB / rows bytes of each; 4 rows (2 biases, 2 ranks) of this hidden are 4 stages, so the third
# buffer's successor reuses the first (at HIDDEN_MAX a stage holds the whole row).
WIDE_HIDDEN = 2048


@pytest.fixture(scope="module")
def ibgda2():
    r = _pool(2, "ibgda", 32, num_nvl_bytes=max(_nbytes(2), _nbytes(2, SMALL, WIDE_HIDDEN)))
    yield r
    _close(r)


@pytest.fixture(scope="module")
def proxy2():
    r = _pool(2, "proxy", 64, shrink=True)
    yield r
    _close(r)


@pytest.fixture(scope="module")
def mixed4():
    r = _pool(4, "mixed", 32)
    yield r
    _close(r)


@pytest.fixture(scope="module")
def p2p2():
    """2 ranks, all p2p, warps of 64, with an LL buffer beside the HT one and a receive pool (rows
    stored in place)."""
    r = _pool(2, "p2p", 64, num_nvl_bytes=_nbytes(2), num_rdma_bytes=LL_BYTES, low_latency_mode=True,
              recv_pool_bytes=RECV_POOL)
    yield r
    _close(r)


@pytest.fixture(scope="module")
def p2p_proxy4():
    """4 ranks, pairs with an even sum p2p, the others through the proxy, warps of 32, with a
    receive pool: the p2p sources store rows in place, the proxy ones go through the rings."""
    r = _pool(4, "p2p+proxy", 32, num_nvl_bytes=_nbytes(4), num_rdma_bytes=0, low_latency_mode=False,
              recv_pool_bytes=RECV_POOL)
    yield r
    _close(r)


@pytest.fixture(scope="module", params=GEN_WORLDS)
def gen_world(request):
    """One of GEN_WORLDS' pools (the same pool objects the other tests use)."""
    return request.getfixturevalue(request.param)


# ---- without ranks ---------------------------------------------------------------------------------
def test_size_hint_is_the_layout_and_independent_of_the_token_count():
    """Config.get_nvl_buffer_size_hint is exactly the HT layout's size (signals, headers, two
    kinds of send + receive rings of num_max_nvl_chunked_recv_tokens messages per channel and
    rank), grows with ranks, channels, ring and hidden, and does not depend on tokens: with 4
    channels of 48-slot rings, DeepEP's 4096 x 7168 BF16 benchmark on 2 ranks moves more than
    twice the buffer's bytes per rank (and 8x as many tokens, 16x)."""
    from gpunet.ep import _layout as lay
    c = Config(20, 6, 256)
    h = c.get_nvl_buffer_size_hint(7168 * 2, 2)
    assert h == lay.ht_size_hint(7168, 2, 10, 256)
    msg = lay.msg_stride(7168, False)[0]
    assert h == lay.ht_fixed_bytes(2) + 2 * lay.align(2 * 10 * 2 * 256 * msg)
    assert h < c.get_nvl_buffer_size_hint(7168 * 2, 4) and h < Config(40, 6, 256).get_nvl_buffer_size_hint(7168 * 2, 2)
    assert h < Config(20, 6, 512).get_nvl_buffer_size_hint(7168 * 2, 2) < Config(20, 6, 512).get_nvl_buffer_size_hint(8192 * 2, 2)
    # DeepEP's rule: no RDMA buffer up to 8 ranks (callers that allocate both hints get one
    # region); gpunet's flat HT group past that takes the NVL layout's bytes
    assert c.get_rdma_buffer_size_hint(7168 * 2, 2) == c.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    assert c.get_rdma_buffer_size_hint(7168 * 2, 9) == c.get_nvl_buffer_size_hint(7168 * 2, 9) > 0
    small = Config(8, 8, 48).get_nvl_buffer_size_hint(7168 * 2, 2)
    assert small == lay.ht_size_hint(7168, 2, 4, 48) and 2 * small < 4096 * 7168 * 2


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH: the CUDA arm cannot be compiled")
def test_ht_kernels_compile_for_the_cuda_arm_with_the_mirrored_layout():
    """gpunet/device/kernels/ep_ht.cu builds with nvcc (sm_90) and its HtParams / EpStatus / DevCtx sizes
    are the ones gpunet/device/ep.py mirrors (load_ep_ht checks them), as the HOST build's are."""
    import ctypes
    for arch in ("host", "cuda"):
        lib = dep.load_ep_ht(arch)
        assert lib.gpunet_ep_ht_abi_size(0) == ctypes.sizeof(dep.HtParams) == dep.HT_SIZES["HtParams"]


def test_the_references_on_a_hand_computed_example():
    """The plain-torch references on 3 tokens of each of 2 ranks, 4 experts (2 per rank), worked
    out by hand: the layout (a token counts once per rank and expert), rank 1's received rows
    (source 0 first, tokens in order, local ids, weights 0 where -1) and counts aligned to 2, and
    combine's per-token sum of the rows that came back, biases first."""
    tk = [torch.tensor([[0, 2], [1, 1], [-1, 3]]), torch.tensor([[3, -1], [0, 1], [2, 3]])]
    w = [torch.tensor([[.5, .25], [1., 2.], [3., 4.]]), torch.tensor([[5., 6.], [7., 8.], [9., 10.]])]
    x = [torch.arange(6.).view(3, 2).repeat(1, 64).to(torch.bfloat16) + 10 * j for j in range(2)]
    ntr, nte, inr = ref.ht_layout_ref(tk[0], 4, 2)
    assert ntr.tolist() == [2, 2] and nte.tolist() == [1, 1, 1, 1]
    assert inr.tolist() == [[True, True], [True, False], [False, True]]
    r1 = ref.ht_dispatch_ref(x, tk, w, 4, 1, expert_alignment=2)
    assert r1["src_idx"].tolist() == [0, 2, 0, 2] and r1["rank_prefix"].tolist() == [0, 2, 4]
    assert r1["recv_topk_idx"].tolist() == [[-1, 0], [-1, 1], [1, -1], [0, 1]]
    assert r1["recv_topk_weights"].tolist() == [[0, .25], [0, 4], [5, 0], [9, 10]]
    assert r1["counts"] == [2, 4]                              # 2 and 3, aligned to 2
    assert torch.equal(r1["recv_x"], torch.stack([x[0][0], x[0][2], x[1][0], x[1][2]]))
    refs = [ref.ht_dispatch_ref(x, tk, w, 4, d) for d in range(2)]
    ys = [r["recv_x"] * (d + 1) for d, r in enumerate(refs)]   # rank d's experts scale by d + 1
    bias = torch.ones(3, 128, dtype=torch.bfloat16)
    out, ow = ref.ht_combine_ref(ys, refs, inr, 0, biases=(bias,), ys_weights=[r["recv_topk_weights"] for r in refs])
    want = torch.stack([1 + x[0][0].float() * 3, 1 + x[0][1].float(), 1 + x[0][2].float() * 2])
    assert torch.equal(out, want.to(torch.bfloat16))
    assert ow.tolist() == [[.5, .25], [1, 2], [0, 4]]
    out_m, _ = ref.ht_combine_ref(ys, refs, inr, 0, masked_ranks=(1,))
    assert torch.equal(out_m[1], x[0][1]) and bool((out_m[2] == 0).all())


def test_a_buffer_the_garbage_collector_frees_frees_its_host_mapped_words_too():
    """explicitly_destroy=False (DeepEP's default): when the Buffer is collected, its Context AND
    the host-mapped allocations it made (the mask mirror, the HT notify's mailbox: cudaHostAlloc on
    GPUs) are freed. Before, the finalizer closed the Context alone."""
    import gc
    cfg = Config(2, 4, 48)
    b = Buffer(None, num_nvl_bytes=cfg.get_nvl_buffer_size_hint(256 * 2, 1), timeout_s=10.0)
    x = torch.randn(5, 256).to(torch.bfloat16)
    b.dispatch(x, is_token_in_rank=torch.ones(5, 1, dtype=torch.bool), config=cfg)
    held = [b._hflags_mem, b._ht_mail[0], b.runtime]
    assert not any(m.closed for m in held)
    del b
    gc.collect()
    assert all(m.closed for m in held), held


def test_one_rank_round_trip_without_topk_and_a_too_small_buffer():
    """A world of one: a dispatch without top-k (is_token_in_rank only) returns no top-k tensors and
    the rows in order; combine of them is the rows again (fan-out 1). A Config whose rings do not
    fit the buffer, a ring smaller than 2 * chunk + 32, num_tokens_per_rdma_rank, a handle together
    with topk_idx, and bad dtypes raise ConfigError naming the problem."""
    cfg = Config(2, 4, 48)
    b = Buffer(None, num_nvl_bytes=cfg.get_nvl_buffer_size_hint(256 * 2, 1), explicitly_destroy=True,
               timeout_s=10.0)
    try:
        x = torch.randn(9, 256).to(torch.bfloat16)
        in_rank = torch.tensor([[True]] * 7 + [[False]] * 2)
        rx, tk, w, counts, handle, ev = b.dispatch(x, is_token_in_rank=in_rank, config=cfg)
        assert tk is None and w is None and ev.event is None and torch.equal(rx, x[:7])
        out, ow, _ = b.combine(rx, handle, config=cfg)
        assert ow is None and torch.equal(out[:7], x[:7]) and bool((out[7:] == 0).all())
        cases = [
            (lambda: b.dispatch(x, is_token_in_rank=in_rank, config=Config(2, 4, 4096)), "get_nvl_buffer_size_hint"),
            (lambda: b.dispatch(x, is_token_in_rank=in_rank, config=Config(2, 16, 40)), "2 \\* send chunk"),
            (lambda: b.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_rdma_rank=in_rank.int()), "rdma"),
            (lambda: b.dispatch(x, handle=handle, topk_idx=torch.zeros(9, 1, dtype=torch.int64)), "cached"),
            (lambda: b.dispatch(x.float(), is_token_in_rank=in_rank), "bfloat16"),
            (lambda: b.dispatch(x, is_token_in_rank=in_rank.int()), "bool"),
            (lambda: b.combine(rx[:3], handle), "shape"),
            (lambda: b.get_dispatch_layout(torch.zeros(3, 2, dtype=torch.int64), 0), "num_experts"),
        ]
        for fn, words in cases:
            with pytest.raises(ConfigError, match=words):
                fn()
    finally:
        b.destroy()
    nb = Buffer(None, num_rdma_bytes=1 << 20, low_latency_mode=True, explicitly_destroy=True)
    try:
        with pytest.raises(ConfigError, match="num_nvl_bytes"):
            nb.dispatch(x, is_token_in_rank=in_rank)
    finally:
        nb.destroy()


def test_launch_parameters_come_from_a_template_per_shape_and_follow_the_timeout():
    """The HT launch parameters are a copy of a template per call shape (Buffer._template, as the
    LL kernels'): a second combine of the same shape launches with its own output tensor and
    otherwise the same fields; set_timeout reaches the next launch's peer bound (the timeout is
    part of the template's key)."""
    cfg = Config(2, 4, 48)
    b = Buffer(None, num_nvl_bytes=cfg.get_nvl_buffer_size_hint(256 * 2, 1), explicitly_destroy=True,
               timeout_s=10.0)
    seen, launch = [], b._ht_launch

    def record(P, grid, block, what):
        seen.append((what, P.peer_timeout_ns, P.out_x, P.base.timeout_ns))
        launch(P, grid, block, what)
    b._ht_launch = record
    try:
        x = torch.randn(5, 256).to(torch.bfloat16)
        in_rank = torch.ones(5, 1, dtype=torch.bool)
        rx, _, _, _, handle, _ = b.dispatch(x, is_token_in_rank=in_rank, config=cfg)
        outs = [b.combine(rx, handle, config=cfg)[0] for _ in range(2)]
        b.set_timeout(4.0)
        outs.append(b.combine(rx, handle, config=cfg)[0])
        combines = [s for s in seen if s[0] == "combine"]
        assert [c[1] for c in combines] == [10 * 10**9, 10 * 10**9, 4 * 10**9]
        assert combines[0][3] == combines[1][3] > combines[2][3]
        assert len({c[2] for c in combines}) == 3 and all(torch.equal(o, x) for o in outs)
    finally:
        b.destroy()


def test_set_num_sms_bounds_the_channels():
    """The kernels use no more blocks than the Config's num_sms (2 per channel), Buffer.num_sms
    (set_num_sms) feeds the default Configs, and the HOST arm caps the channels at 2."""
    b = Buffer(None, num_nvl_bytes=Config(8, 4, 48).get_nvl_buffer_size_hint(512, 1), explicitly_destroy=True)
    old = Buffer.num_sms
    try:
        Buffer.set_num_sms(2)
        assert Buffer.get_dispatch_config(2).num_sms == 2 and Buffer.get_combine_config(8).num_sms == 2
        assert b._ht_geometry(Config(2, 4, 48))[0] == 1
        assert b._ht_geometry(Config(8, 4, 48))[0] == 2
        x = torch.randn(5, 256).to(torch.bfloat16)
        _, _, _, _, handle, _ = b.dispatch(x, is_token_in_rank=torch.ones(5, 1, dtype=torch.bool),
                                           config=Config(2, 4, 48))
        assert handle[6]["nc"] == 1 and tuple(handle[5].shape) == (1, 1)
    finally:
        Buffer.num_sms = old
        b.destroy()


@pytest.mark.parametrize("ranks", [1, 2, 3, 8, 160])
def test_the_default_configs_fit_a_buffer_sized_for_deepeps_and_the_geometry(ranks):
    """get_dispatch_config / get_combine_config (what a caller that passes no Config gets; at 2
    ranks gpunet's send chunk, buffer.py HT_DEFAULT_CHUNK_2_RANKS, not DeepEP's). Invariant, for
    each rank count: the size hint equals that of DeepEP's Config of the same rank count (the ring
    and the channels are DeepEP's: a buffer sized from either holds the other), and the Buffer's
    geometry check accepts ours (chunk <= HT_MAX_CHUNK, ring >= 2 * chunk + 32) and reads back
    their ring and chunk."""
    b = Buffer(None, num_nvl_bytes=Config(8, 4, 48).get_nvl_buffer_size_hint(512, 1), explicitly_destroy=True)
    try:
        deepep = (Config(Buffer.num_sms, 6 if ranks > 2 else 24, 256, 6, 128),
                  Config(Buffer.num_sms, 4 if ranks > 2 else 10, 256, 6, 128))
        for ours, theirs in zip((Buffer.get_dispatch_config(ranks), Buffer.get_combine_config(ranks)), deepep):
            assert ours.num_sms == Buffer.num_sms
            for hidden_bytes in (256, 7168 * 2):
                assert ours.get_nvl_buffer_size_hint(hidden_bytes, ranks) == \
                    theirs.get_nvl_buffer_size_hint(hidden_bytes, ranks)
            _, ring, chunk, _ = b._ht_geometry(ours)
            assert (ring, chunk) == (256, 48 if ranks <= 2 else theirs.num_max_nvl_chunked_send_tokens)
    finally:
        b.destroy()


# ---- 2 ranks, ibgda, warps of 32 ----------------------------------------------------------------
@pytest.mark.parametrize("mode", [dict(tagged=True), dict(fp8=True), dict(no_topk=True, tagged=True),
                                  dict(alignment=4, biases=2, cached=True),
                                  dict(async_finish=True, prev_event=True, fp8=True, cached=True,
                                       config=TWO_CHANNELS)],
                         ids=["tagged-bf16", "fp8", "no-topk", "align-bias-cached", "async-prev-fp8"])
def test_mode_matrix_over_ibgda(ibgda2, mode):
    """DeepEP's HT mode matrix: tagged / random BF16, FP8, with and without top-k, expert
    alignment, two biases, a cached-handle dispatch, async_finish and previous_event: the layout
    equals the token-by-token reference, the rows, local expert ids, weights and aligned counts
    equal the reference (counts also the all-reduced layout's), tagged rows come in source-rank and
    token order, combine equals the float32 reference bit for bit and (combined - biases) /
    fan-out is within DeepEP's bound of x; the reduced weights equal the originals."""
    spec = dict(_spec(2, seed=11), **mode)
    _assert_round(ibgda2.run("ep_ht_jobs:round_", spec), spec)


def test_a_wide_combine_through_the_bulk_stages_is_exact(ibgda2):
    """Hidden 2048 with two biases over ibgda, warps of 32: the combine receiver's bulk reduce
    (ht.cuh ht_reduce_bulk) takes each token's up to 4 rows in 4 stages through its 3 buffers
    (so a buffer is loaded again while the others are in flight); tagged rows, combine within
    the BF16 bound and the weights exact on both ranks."""
    spec = _spec(2, seed=52, tokens=12, hidden=WIDE_HIDDEN, biases=2, tagged=True)
    _assert_round(ibgda2.run("ep_ht_jobs:round_", spec), spec)


def test_num_worst_tokens_prefix_equals_the_exact_run_and_tail_is_minus_one(ibgda2):
    """num_worst_tokens (no host sync): the receive tensors have exactly that many rows, their
    prefix equals the exact dispatch, the tail of recv_topk_idx is -1, the count list is empty;
    combine from the padded rows matches too. Too few rows raise a clear error on that rank."""
    for fp8 in (False, True):
        spec = _spec(2, seed=13, worst=7, fp8=fp8, cached=True)
        _assert_round(ibgda2.run("ep_ht_jobs:round_", spec), spec)
    spec = _spec(2, seed=14, worst=0, hot_expert=1)
    _assert_round(ibgda2.run("ep_ht_jobs:round_", spec), spec)


def test_same_seed_reruns_hash_identically(ibgda2):
    """Same inputs, bit-identical recv_x and combined_x on every rerun; another seed differs."""
    spec = _spec(2, seed=5, hot_expert=2)
    first = [o["hashes"] for o in ibgda2.run("ep_ht_jobs:round_", spec)]
    for _ in range(2):
        assert [o["hashes"] for o in ibgda2.run("ep_ht_jobs:round_", spec)] == first
    assert [o["hashes"] for o in ibgda2.run("ep_ht_jobs:round_", dict(spec, seed=6))] != first


@settings(max_examples=GEN_EXAMPLES, deadline=None,
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(data=st.data())
def test_generated_shapes_and_skewed_routings(gen_world, data):
    """Generated, on each world of GEN_WORLDS (2 ranks ibgda warp 32, 2 ranks p2p warp 64, 4
    ranks p2p and proxy pairs warp 32): tokens per rank (0..40, varying by rank, so some rank
    may send nothing), hidden (128..384), experts per rank (1..8), top-k (1..min(16, E)), -1
    holes, a hot expert with a skew up to every token of every rank (EP-ANCHORS.md §B.10: the
    skew that broke DeepEP's counts), BF16 or FP8, a Config with 1 or 2 channels and rings of
    34..48 slots in chunks of 1..4. Invariant: every check of the round holds on every rank.
    (GEN_EXAMPLES a world in CI; no shrinking: each costs a round trip through the ranks.)"""
    world = gen_world.world
    epr = data.draw(st.integers(1, 8), "experts per rank")
    e = epr * world
    k = data.draw(st.integers(1, min(16, e)), "topk")
    hot = data.draw(st.one_of(st.none(), st.integers(0, e - 1)), "hot")
    chunk = data.draw(st.integers(1, 4), "chunk")
    spec = dict(seed=data.draw(st.integers(0, 2 ** 20), "seed"),
                tokens=data.draw(st.integers(0, 40), "tokens"),
                hidden=128 * data.draw(st.integers(1, HIDDEN_MAX // 128), "hidden/128"),
                topk=k, num_experts=e, holes=data.draw(st.integers(0, 8), "holes"),
                vary_tokens=data.draw(st.booleans(), "vary"),
                fp8=data.draw(st.booleans(), "fp8"),
                config=(data.draw(st.sampled_from([2, 4]), "num_sms"), chunk,
                        data.draw(st.integers(2 * chunk + 32, 48), "ring")))
    if hot is not None and e - 1 >= k:
        spec.update(hot_expert=hot, hot_fraction=data.draw(st.sampled_from([0.5, 0.9, 1.0]), "skew"))
    _assert_round(gen_world.run("ep_ht_jobs:round_", spec), spec)


def test_a_token_goes_once_to_each_destination_rank_not_once_per_expert(gen_world):
    """DeepEP's rule: a token that selects several experts on one rank is sent to that rank ONCE.
    A routing where every token picks 2..4 experts on one rank, every rank being some token's
    (ep_jobs.rank_repeating_routing, with holes and a token with no expert; 24 tokens a rank),
    BF16 and FP8, on every world of GEN_WORLDS. From topk_idx alone, plain torch counts the
    unique (token, destination rank) pairs; they must equal, on every rank, the messages it sent
    to each destination (the notify step's send_cnt summed over channels), get_dispatch_layout's
    num_tokens_per_rank, the total each source's header announced, and the rows received from
    each source (the handle's rank prefix), whose source token indices are exactly that source's
    tokens for this rank, in order, none twice. The routing is checked to have more (token,
    expert) pairs than (token, rank) pairs for EVERY (source, destination), so a dispatch that
    sent a row per expert fails here on every rank; the round's usual checks hold too."""
    world = gen_world.world
    for seed, fp8 in ((111, False), (112, True)):
        spec = _spec(world, seed=seed, routing="rank_repeats", wire=True, fp8=fp8)
        # the jobs' inputs (spec["routing"] applied), counted by plain torch
        per_rank, per_expert, tokens = ep_jobs.telling_pairs(
            [d["topk_idx"] for d in ep_ht_jobs._inputs(spec, world)], spec["num_experts"])
        out = gen_world.run("ep_ht_jobs:round_", spec)
        _assert_round(out, spec)
        for d, o in enumerate(out):
            w = o["wire"]
            why = "rank %d: %%s; unique (token, rank) pairs %s, (token, expert) pairs %s (spec %r)" % (
                d, per_rank.tolist(), per_expert.tolist(), spec)
            assert w["sent"] == per_rank[d].tolist(), why % ("sent per destination %s" % w["sent"])
            assert w["ntr"] == per_rank[d].tolist(), why % ("num_tokens_per_rank %s" % w["ntr"])
            assert w["nrecv"] == per_rank[:, d].tolist(), why % ("announced per source %s" % w["nrecv"])
            assert w["rows_from"] == per_rank[:, d].tolist(), why % ("rows per source %s" % w["rows_from"])
            assert w["src_idx"] == sum((tokens[j, d] for j in range(world)), []), \
                why % ("source tokens of the received rows %s" % w["src_idx"])


# ---- 2 ranks, proxy (warps of 64) and p2p ---------------------------------------------------------
@pytest.mark.parametrize("mode", [dict(tagged=True, vary_tokens=True), dict(fp8=True, worst=3, biases=1)],
                         ids=["tagged-vary", "fp8-worst-bias"])
def test_over_the_proxy_with_warps_of_64(proxy2, mode):
    """The round through the CPU proxy with 64-lane warps (ballots over 64 tokens)."""
    spec = _spec(2, seed=21, hot_expert=3, **mode)
    _assert_round(proxy2.run("ep_ht_jobs:round_", spec), spec)


def test_ht_then_ll_with_a_clean_between(p2p2):
    """One Buffer with both buffers (SGLang's normal -> low-latency switch), 2 ranks all p2p: an
    HT round, then clean_low_latency_buffer and an LL round (tests/ep_jobs.py's checks), then HT
    again."""
    r = p2p2
    assert {t for i in r.info for t in i["transports"].values()} == {"p2p"}
    spec = _spec(2, seed=31, tagged=True)
    outs = r.run("ep_ht_jobs:round_", spec)
    _assert_round(outs, spec)
    assert [o["in_pool"] for o in outs] == [True, True]     # the rows were stored in place
    # an all-p2p world runs ep_ht.cu built with the p2p transport only (Buffer._kernel_kinds)
    p2p_only = str(dep.load_ep_ht("host", kinds={abi.TRANSPORT_P2P}).gpunet_path)
    assert p2p_only != str(dep.load_ep_ht("host").gpunet_path)
    assert [o["ht_lib"] for o in outs] == [p2p_only, p2p_only]
    ll = dict(seed=32, t_max=8, hidden=256, topk=4, num_experts=8, holes=2, use_fp8=True)
    for rank, o in enumerate(r.run("ep_ht_jobs:ll_round", ll)):
        assert o["raised"] is None and o["bad"] == [] and o["calc_diff"] < 9e-4, (rank, o)
    spec = _spec(2, seed=33, fp8=True)
    _assert_round(r.run("ep_ht_jobs:round_", spec), spec)


# ---- 4 ranks ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [dict(tagged=True), dict(fp8=True, cached=True, biases=2)],
                         ids=["tagged", "fp8-cached-bias"])
def test_four_ranks_mixed_transports(mixed4, mode):
    """4 ranks, pairs with an odd sum through the proxy, the others by ibgda: varying tokens (some
    rank may send none), holes, a hot expert; every check of the round holds on every rank."""
    assert {t for i in mixed4.info for t in i["transports"].values()} == {"ibgda", "proxy"}
    spec = _spec(4, seed=41, vary_tokens=True, hot_expert=5, **mode)
    _assert_round(mixed4.run("ep_ht_jobs:round_", spec), spec)


def test_four_ranks_p2p_and_proxy_peers(p2p_proxy4):
    """4 ranks, pairs with an even sum p2p (rows stored straight into the peer's mapped ring, tails
    and credits SET with no fence before them), the others through the proxy (staged, put, fenced):
    every rank has both kinds of peer. BF16 tagged with varying tokens and a hot expert, then FP8
    with a cached dispatch and two biases; every check of the round holds on every rank."""
    r = p2p_proxy4
    assert {t for i in r.info for t in i["transports"].values()} == {"p2p", "proxy"}
    for spec in (_spec(4, seed=45, vary_tokens=True, hot_expert=5, tagged=True),
                 _spec(4, seed=46, fp8=True, cached=True, biases=2)):
        outs = r.run("ep_ht_jobs:round_", spec)
        _assert_round(outs, spec)
        assert all(o["in_pool"] for o in outs)


def _assert_combine_ring_rows(outs, spec, in_place_peer):
    """Every rank's round is exact, its receive tensors lie in its pool, and its combine ring held
    no row of each peer d with in_place_peer(rank, d) and some rows of every other peer (the
    round's ring probe: ep_ht_jobs._ring_probe; the shapes give each peer rows in every channel)."""
    _assert_round(outs, spec)
    for rank, o in enumerate(outs):
        assert o["in_pool"], (rank, spec)
        for d, n in enumerate(o["ring_rows"]):
            if d != rank:
                assert (n == 0) == in_place_peer(rank, d), (rank, d, o["ring_rows"], spec)


def test_a_combine_of_the_received_rows_reads_them_in_place(p2p2):
    """2 ranks, all p2p (the nvidia profile: a peer's heap may be loaded), warps of 64, a receive
    pool: combine is given the dispatch's recv_x and recv_topk_weights themselves, which lie in the
    pool. Invariant: the round is exact (the same reference as the ring's) and no row came
    through the combine ring: each peer stored only its descriptor and this rank loaded the rows
    from the peer's pool (ht.cuh "the in-place combine"); with and without top-k (the weights come
    the same way). With the in-place path off (Buffer._ht_pull, GPUNET_EP_HT_PULL=0) the same
    round is exact and its rows are in the ring: the probe sees rows when they come.

    The split (ht.cuh "the split in-place combine"): with every row in place, each channel's
    sender block or its receiver block claims the upper half of the tokens (state 1 or 3 per
    channel), and across these rounds a sender block reduced some (a 1: its rows are then part of
    the exact result); without the in-place path nothing claims (0); with GPUNET_EP_HT_SPLIT off
    (Buffer._ht_split) the in-place round is exact and nothing claims."""
    helped = 0
    for spec, pull in ((_spec(2, seed=80, in_place=True, ring_probe=True, tagged=True, biases=2), True),
                       (_spec(2, seed=81, in_place=True, ring_probe=True, no_topk=True), True),
                       (_spec(2, seed=86, in_place=True, ring_probe=True, tagged=True, config=(4, 4, 48)), True),
                       (_spec(2, seed=80, in_place=True, ring_probe=True, tagged=True, pull=False), False),
                       (_spec(2, seed=87, in_place=True, ring_probe=True, tagged=True, split=False), None)):
        outs = p2p2.run("ep_ht_jobs:round_", spec)
        _assert_combine_ring_rows(outs, spec, lambda r_, d: pull is not False)
        states = [st for o in outs for st in o["split"]]
        assert set(states) <= ({1, 3} if pull else {0}), (spec, states)
        helped += states.count(1)
    assert helped > 0


def test_a_combine_of_expert_outputs_in_empty_combine_x_reads_them_in_place(p2p2, proxy2):
    """Buffer.empty_combine_x: 2 ranks; the expert outputs (the received rows) are copied into the
    fresh tensor it returns, then recv_x is overwritten with NaN, and that tensor is combined, with
    recv_topk_weights. Invariant: on p2p with a receive pool the tensor lies in the pool, the round
    is exact (no NaN: the rows came from the new tensor, not recv_x) and no row came through the
    combine ring (the peer loaded them in place); on the proxy without a pool it is ordinary
    memory and the round is exact through the rings."""
    spec = _spec(2, seed=84, in_place=True, empty_x=True, ring_probe=True, tagged=True, biases=1)
    outs = p2p2.run("ep_ht_jobs:round_", spec)
    _assert_combine_ring_rows(outs, spec, lambda r_, d: True)
    assert all(o["x_in_pool"] for o in outs), outs
    spec = _spec(2, seed=85, in_place=True, empty_x=True, tagged=True)
    outs = proxy2.run("ep_ht_jobs:round_", spec)
    _assert_round(outs, spec)
    assert not any(o["x_in_pool"] or o["nan"] for o in outs), outs


def test_an_in_place_combine_in_a_world_of_p2p_and_proxy_peers(p2p_proxy4):
    """4 ranks, pairs with an even sum p2p, the others through the proxy, warps of 32, a receive
    pool, combine given the received rows themselves, varying tokens. Invariant: exact on every
    rank; the p2p peers' rows were loaded in place (none in the ring), the proxy peers' came
    through the ring (a NIC peer's heap cannot be loaded)."""
    spec = _spec(4, seed=82, in_place=True, ring_probe=True, vary_tokens=True, tagged=True)
    outs = p2p_proxy4.run("ep_ht_jobs:round_", spec)
    _assert_combine_ring_rows(outs, spec, lambda r_, d: (r_ + d) % 2 == 0)
    # every rank sends rows through a ring (to its proxy peers): no sender block reduces (ht.cuh
    # "the split in-place combine"); a receiver block may still claim its whole channel (3)
    assert all(set(o["split"]) <= {0, 3} for o in outs), [o["split"] for o in outs]


def test_a_combine_in_place_on_one_rank_and_through_the_ring_on_the_other():
    """2 ranks over p2p with receive pools, warps of 32: rank 0 combines its received rows (in its
    pool: rank 1 loads them), rank 1 a copy in torch memory (its rows come through rank 0's ring).
    Invariant: exact on both; rank 0's ring holds rank 1's rows and rank 1's none of rank 0's;
    rank 0's sender block, which has nothing to stage, does not reduce half its channel: a source
    comes through the ring, whose credits follow the order of the rows read (state 2 or 3, never
    1); rank 1, not in place, claims nothing."""
    r = _pool(2, "p2p-pool", 32)
    try:
        for seed in (88, 89):
            spec = _spec(2, seed=seed, in_place=True, in_place_ranks=[0], ring_probe=True, tagged=True)
            outs = r.run("ep_ht_jobs:round_", spec)
            _assert_combine_ring_rows(outs, spec, lambda r_, d: d == 0)
            assert set(outs[0]["split"]) <= {2, 3} and set(outs[1]["split"]) == {0}, \
                [o["split"] for o in outs]
    finally:
        _close(r)


def test_the_c500_profile_never_loads_a_peers_rows_in_combine():
    """GPUNET_PROFILE=c500 (p2p store-only), 2 ranks over p2p with a receive pool, combine given
    the received rows themselves (in the pool). Invariant: exact, and every peer's rows came
    through the ring: on a store-only peer the in-place combine, which loads the peer's rows, is
    never taken (transport/p2p.cuh's rule; gpunet.cuh ptr_load gives no address)."""
    r = _pool(2, "p2p-pool", 32, env={"GPUNET_PROFILE": "c500"})
    try:
        spec = _spec(2, seed=83, in_place=True, ring_probe=True, tagged=True)
        _assert_combine_ring_rows(r.run("ep_ht_jobs:round_", spec), spec, lambda r_, d: False)
    finally:
        _close(r)


def test_a_token_side_given_up_while_it_loads_in_place_fails_instead_of_returning():
    """2 ranks over p2p with receive pools, enable_shrink, a 1 s bound: combine of recv_x (in place,
    ht.cuh "the in-place combine"); rank 1's token side stalls 9 s after loading rank 0's rows and
    before its final credit (GPUNET_TEST_HT_PULL_STALL_NS), past rank 0's bound for a silent peer
    (3 s without a beat). Invariant: rank 0 masks rank 1 and returns its combine exact (it read
    rank 1's rows before rank 1 went quiet: rank 1 beats until rank 0's final credit); its sender,
    giving rank 1 up, SET rank 1's tail back (ht_pull_revoke), and rank 1, reading its tail again
    before the credit, raises naming the combine row's check instead of returning rows rank 0's
    caller may have overwritten by then."""
    r = _pool(2, "p2p-pool", 32, shrink=True, timeout_s=1.0)
    try:
        spec = _spec(2, seed=84)
        (raised0, masked0, bad0, w0), (raised1, _, _, w1) = r.run(
            "ep_ht_jobs:in_place_combine_stalled", spec, 1, 9_000_000_000, timeout=120)
        assert w0 == [] and w1 == [], (w0, w1)   # the warm-up round masked no rank
        assert raised0 is None and bad0 == [] and masked0 == [1], (raised0, bad0, masked0)
        assert raised1 is not None and "high-throughput combine row" in raised1, raised1
    finally:
        _close(r)


def test_a_receive_pool_without_room_falls_back_to_the_ring(p2p2):
    """Rank 1's receive pool held full by a tensor of its own: its receive tensors come from
    torch and rank 0 stages its rows into rank 1's ring, while rank 1 stores its rows straight
    into rank 0's pool; both exact (BF16 tagged, then FP8 with a cached dispatch). The tensor
    dropped, both go in place again."""
    r = p2p2
    used = r.run("ep_ht_jobs:hold_pool", [False, True])
    assert used[0] < RECV_POOL - (1 << 20) < used[1], used
    try:
        for spec in (_spec(2, seed=34, tagged=True, vary_tokens=True), _spec(2, seed=35, fp8=True, cached=True)):
            outs = r.run("ep_ht_jobs:round_", spec)
            _assert_round(outs, spec)
            assert [o["in_pool"] for o in outs] == [True, False], spec
    finally:
        r.run("ep_ht_jobs:hold_pool", [False, False])
    spec = _spec(2, seed=36, tagged=True)
    outs = r.run("ep_ht_jobs:round_", spec)
    _assert_round(outs, spec)
    assert [o["in_pool"] for o in outs] == [True, True]


def _guess_rounds(r, specs):
    """Run ``specs`` (one kind of dispatch) back to back and check each call against the guess
    rule: from the second call on, a rank allocated its receive tensors while its notify ran, for
    1/8 more rows than its last call got (Buffer._ht_recv_guess_rows), and launched its data phase
    into them behind the notify (ht.cuh run_ht "The prelaunched data phase"). Invariants: every
    round exact (the views of a larger allocation included); a call takes views of that allocation
    iff its rows fit it and fill at least half of it, else an allocation of its own rows
    (rows_held == rows), in the pool either way; the prelaunched data phase ran (the notify's go
    word) exactly in the calls that fit, else the data phase launched again did. Returns the
    per-call list of which ranks' guesses fitted."""
    outs = [r.run("ep_ht_jobs:round_", spec) for spec in specs]
    for spec, out in zip(specs, outs):
        _assert_round(out, spec)
    fitted = [[] for _ in outs]
    for rank in range(len(outs[0])):
        rows = [o[rank]["n_recv"] for o in outs]
        held = [o[rank]["rows_held"] for o in outs]
        assert held[0] >= rows[0], (rank, rows, held)   # the module's earlier rounds may leave a guess
        for i in range(1, len(rows)):
            guess = rows[i - 1] + -(-rows[i - 1] // 8)
            fits = guess // 2 <= rows[i] <= guess
            assert held[i] == (guess if fits else rows[i]), (rank, i, rows, held)
            assert outs[i][rank]["prelaunched"] == int(fits), (rank, i, rows)
            if fits:
                fitted[i].append(rank)
        assert all(o[rank]["in_pool"] for o in outs)
    return fitted, [[o[k]["n_recv"] for o in outs] for k in range(len(outs[0]))]


def test_receive_tensors_allocated_during_the_notify_are_used_when_the_rows_fit(p2p2):
    """Dispatches of one kind (BF16, hidden, top-k) back to back with 24, 24, 40, 8 and 8 tokens a
    rank, checked by _guess_rounds: the sequence has both kinds of call on each rank, a guess used
    (24 after 24, 8 after 8), a guess too small (40 after 24) and one far too large (8 after 40)."""
    specs = [_spec(2, seed=40 + i, tokens=t, tagged=True) for i, t in enumerate((24, 24, 40, 8, 8))]
    fitted, rows = _guess_rounds(p2p2, specs)
    assert sum(map(len, fitted)) >= 4 and sum(not f for f in fitted[1:]) >= 2, rows


def test_a_prelaunched_data_phase_runs_beside_a_peer_that_launches_it_again(p2p2):
    """Top-1 routings whose hot expert (on rank 1) takes a growing share: rank 1 then gets more
    rows than its guess (its prelaunched data phase ends at once and its host launches it again,
    tens of us later) while rank 0 gets fewer that still fit (its prelaunched one runs and waits
    for rank 1's descriptors and rows). Checked by _guess_rounds; the sequence has such a call."""
    specs = [_spec(2, seed=50 + i, topk=1, holes=0, tagged=True, **hot)
             for i, hot in enumerate(({}, {}, dict(hot_expert=4, hot_fraction=0.3),
                                      dict(hot_expert=4, hot_fraction=0.3), {}))]
    fitted, rows = _guess_rounds(p2p2, specs)
    assert any(len(f) == 1 for f in fitted[1:]), (fitted, rows)


def test_without_the_prelaunch_the_data_phase_goes_after_the_counts():
    """GPUNET_EP_HT_PRELAUNCH=0 (the A/B of bench/ep_ht.py): the guess is still used (views of
    it when the rows fit) but no data phase is prelaunched, and the rounds are exact."""
    r = _pool(2, "p2p-pool", 32, env={"GPUNET_EP_HT_PRELAUNCH": "0"})
    try:
        specs = [_spec(2, seed=44 + i, tagged=True) for i in range(2)]
        outs = [r.run("ep_ht_jobs:round_", spec) for spec in specs]
        for spec, out in zip(specs, outs):
            _assert_round(out, spec)
        assert [o["prelaunched"] for out in outs for o in out] == [0] * 4
        assert [o["rows_held"] >= o["n_recv"] for o in outs[1]] == [True, True]
    finally:
        _close(r)


def test_a_too_small_buffer_is_refused_on_every_rank(mixed4):
    """A Config whose rings do not fit the HT buffer is refused on every rank, before anything is
    sent, with a ConfigError naming the size hint."""
    for msg in mixed4.run("ep_ht_jobs:too_small", 256):
        assert msg is not None and msg.startswith("ConfigError") and "get_nvl_buffer_size_hint" in msg, msg


# ---- a rank that dies ---------------------------------------------------------------------------
VICTIM = 2
# Bound of the waits on the dead rank: long enough that a LIVE rank lagging on the loaded 2-core CI
# machine is not taken for dead, short enough to keep the test quick.
KILL_TIMEOUT_S = 6.0


def _kill_round(transport, shrink, stage):
    r = _pool(3, transport, 32, shrink=shrink, timeout_s=KILL_TIMEOUT_S)
    spec = _spec(3, seed=61, die=(VICTIM, stage))
    return r.run_losing(VICTIM, "ep_ht_jobs:round_", spec), r, spec


def _close_survivors(r):
    r.close_losing(VICTIM, "ep_ht_jobs:close")


# How long after its round starts the victim may die: a 3-rank round (BASE shapes) lasts about
# this long on the 2-core CI machine, so deaths fall before the notify, amid the data and in combine.
HT_DIE_SPAN_S = 0.5


@settings(max_examples=max(3, settings().max_examples // 15), deadline=None,
          phases=[Phase.explicit, Phase.generate])
@given(transport=st.sampled_from(["ibgda", "proxy", "p2p", "p2p-pool", "mixed"]),
       die_at=st.floats(0.0, HT_DIE_SPAN_S), fp8=st.booleans())
@example(transport="p2p", die_at=0.12, fp8=True)   # the moment of the weights finding (docs/EP.md)
@example(transport="ibgda", die_at=0.2, fp8=False)
@example(transport="p2p-pool", die_at=0.15, fp8=False)   # rows stored in place: holes past the last tail
def test_a_rank_that_dies_at_any_moment_leaves_the_survivors_exact(transport, die_at, fp8):
    """Generated: the world (3 ranks over ibgda, proxy, p2p (with a receive pool: rows stored in
    place, and with BF16 combine given the received rows, which the peers load in place), or
    mixed ibgda and proxy pairs),
    the moment rank 2 exits (die_at seconds after its round starts, wherever its kernels are)
    and BF16 or FP8; enable_shrink. Invariant: each survivor finishes the round without raising
    and masks no rank but the dead one; its dispatch is the reference without each failed source
    whose header never came, and the full layout for the others, each of their rows arrived
    whole or a hole (top-k ids -1, weights 0: ep_ht_jobs._dispatch_after_failures), everything
    else exact; each token's combined row and weights are the reference's without some subset of
    the ranks it marked failed, and (combined - biases) / fan-out is x within DeepEP's bound over
    the ranks live for that token. Then the next round masks rank 2 and equals the reference
    without it.

    Before the heartbeats (ht.cuh "Waits on a peer"), a death amid a dispatch's data got a LIVE
    survivor masked by the other in combine in about 1 death in 10 in that window: one survivor
    had all the dead rank's rows and waited a direct bound for the other's combine rows while
    the other still waited out the dead rank's tail. The first explicit example is the moment of
    a finding not reproduced since (p2p, FP8: combined weights that matched no allowed reference,
    in a run where the survivors had masked each other).
    HYPOTHESIS_PROFILE=deep runs ~130 examples."""
    r = _pool(3, transport, 32, shrink=True, timeout_s=KILL_TIMEOUT_S)
    try:
        # p2p-pool BF16: combine given the received rows themselves, loaded in place by the peers
        spec = _spec(3, seed=63, die=(VICTIM, die_at), fp8=fp8, tagged=not fp8,
                     in_place=transport == "p2p-pool" and not fp8)
        outs = r.run_losing(VICTIM, "ep_ht_jobs:round_", spec)
        for status, o in outs:
            assert status == "ok", o
        _assert_round([o for _, o in outs], spec)
        assert all(set(o["masked"]) <= {VICTIM} for _, o in outs), [o["masked"] for _, o in outs]
        nxt = _spec(3, seed=64, masked=(VICTIM,))
        out = r.run("ep_ht_jobs:round_", nxt)
        _assert_round(out, nxt)
        assert [o["masked"] for o in out] == [[VICTIM]] * 2, [o["masked"] for o in out]
    finally:
        _close_survivors(r)


@pytest.mark.parametrize("transport,stage", [("proxy", "combine"), ("p2p", "dispatch"), ("p2p-pool", "dispatch")])
def test_a_dead_rank_is_masked_and_the_survivors_go_on(transport, stage):
    """enable_shrink: rank 2 exits at the start of dispatch (or combine). The survivors finish the
    round within the timeout with rank 2 masked (nothing received from it; combine leaves its rows
    out) and marked failed in the host-mapped flags (what the host reads on GPUs), and match the
    reference with rank 2 masked; the next two rounds among the survivors too. The second of
    those has a guess of its rows from the first (the same kind) that fits, but a rank is out:
    the notify's go word says no (ht.cuh F_HT_PRE), so nothing is prelaunched and the host
    launches the data phase after the counts."""
    outs, r, spec = _kill_round(transport, True, stage)
    try:
        for status, o in outs:
            assert status == "ok", o
        _assert_round([o for _, o in outs], spec)
        assert all(o["masked"] == [VICTIM] for _, o in outs), outs
        # the failure is mirrored into host memory (what _check reads on GPUs, no heap copy)
        assert all(o["host_failed"] == [VICTIM] for _, o in outs), outs
        nxt = _spec(3, seed=62, masked=(VICTIM,), fp8=True)
        _assert_round(r.run("ep_ht_jobs:round_", nxt), nxt)
        again = r.run("ep_ht_jobs:round_", nxt)
        _assert_round(again, nxt)
        assert [o["prelaunched"] for o in again] == [0, 0], again
    finally:
        _close_survivors(r)


def test_a_rank_whose_host_raises_after_the_notify_keeps_its_epoch_in_step():
    """2 ranks over p2p, enable_shrink: rank 1's receive-tensor allocation raises MemoryError
    between its notify and its data launch. Rank 1 raises it; rank 0 masks rank 1 (no rows came)
    and goes on; both ranks' HT epochs moved on by one (Buffer._ht_skip_op): a rank left one epoch
    behind would read every peer word of the next operation as complete (ht.cuh count_of) and
    return stale rows as received ones."""
    r = _pool(2, "p2p", 32, shrink=True, timeout_s=3.0)
    try:
        spec = _spec(2, seed=77)
        outs = r.run("ep_ht_jobs:dispatch_failing_after_notify", spec, 1)
        (raised0, epoch0, masked0), (raised1, epoch1, masked1) = outs
        assert (raised0, masked0) == (None, [1]) and raised1 == "MemoryError", outs
        assert epoch0 == epoch1 == 2, outs
    finally:
        _close(r)


def test_a_rank_interrupted_after_its_prelaunch_keeps_its_epoch_in_step():
    """2 ranks over p2p, enable_shrink, the same dispatch three times. In the second, rank 1's
    host raises right after it prelaunched the data phase (whose go word says run: its rows fit
    the guess), before it read that word. The data phase ran and bumped the epoch on the device,
    so the host's error path must not bump it again (Buffer._ht_skip_op takes the go word): both
    ranks end the call at the same op epoch, rank 0's prelaunch ran with rank 1's rows, nobody is
    masked, and the third call on both is exact (rank 1 one epoch ahead would have its peer's
    words read as another op's)."""
    r = _pool(2, "p2p", 32, shrink=True, timeout_s=3.0)
    try:
        spec = _spec(2, seed=78)
        (raised0, epoch0, pre0, same0, masked0), (raised1, epoch1, pre1, same1, masked1) = \
            r.run("ep_ht_jobs:interrupted_after_the_prelaunch", spec, 1)
        assert (raised0, raised1) == (None, "_Interrupted"), (raised0, raised1)
        assert (pre0, pre1) == (2, 1), (pre0, pre1)     # rank 1's second is not counted: it raised
        assert epoch0 == epoch1, (epoch0, epoch1)
        assert same0 and same1 and masked0 == masked1 == [], (same0, same1, masked0, masked1)
    finally:
        _close(r)


@pytest.mark.parametrize("op,worst", [("cached", 0), ("combine", 0), ("cached", 96)])
def test_a_rank_left_an_operation_behind_is_told_it_is_out_of_step(op, worst):
    """2 ranks over p2p, enable_shrink. After a dispatch, rank 1 rejects its x in ``op`` (a
    cached dispatch or the combine; a ConfigError before its launch: nothing of the operation
    reached rank 0, so calling it again would resume it); rank 0 runs it and masks rank 1. Both
    unmask (low_latency_clean_mask_buffer) and dispatch other rows, rank 1 one HT operation
    behind. Invariant: no rank returns rows that differ from the reference (with the ranks it
    masked left out); rank 1 raises a GpunetError saying the ranks are out of step (the header's
    op counter, ht.cuh ht_notify), and rank 0 masks rank 1 again (its header is from the earlier
    operation, never the one it waits for). Before: after a cached dispatch rank 1 took rank 0's
    words of that dispatch for this one's and returned its stale ring rows as received; after a
    combine the two ranks masked each other, with nothing saying why. Then, both unmasked, the
    next dispatch is exact on both: the error gave rank 1 the peer's op count and it caught up
    (``worst``: the out-of-step dispatch has num_worst_tokens, its notify and data in one
    launch).

    Peer bounds: 1 s only for the waits that must run out (rank 0's on rank 1 in op and in the
    out-of-step dispatch), LONG_TIMEOUT_S for every wait that must not (a rank can lag by seconds
    on a loaded CI machine; with 1 s everywhere, such a lag masked a rank that was on time)."""
    r = _pool(2, "p2p", 32, shrink=True, timeout_s=LONG_TIMEOUT_S)
    try:
        first = r.run("ep_ht_jobs:reject_one_op", _spec(2, seed=61), 1, op, 1.0)
        assert first[0] is None and first[1].startswith("ConfigError"), first
        # (a job apart: every rank starts it after rank 0 has finished op; other rows than the
        # first dispatch's, so that its stale ring rows would not pass for received ones)
        r.run("ep_jobs:set_timeout", [1.0, LONG_TIMEOUT_S])
        outs = r.run("ep_ht_jobs:dispatch_checked", _spec(2, seed=62), worst)
        assert not any(wrong for _, wrong in outs), outs
        assert outs[1][0] is not None and "out of step" in outs[1][0], outs
        assert outs[0] == (None, False), outs
        # rank 1 caught up with the op count the error named (Buffer._ht_skip_op): once both
        # unmask, the next dispatch is exact on both, nobody masked
        r.run("ep_ht_jobs:unmask_all")
        r.run("ep_jobs:set_timeout", LONG_TIMEOUT_S)
        outs = r.run("ep_ht_jobs:dispatch_checked", _spec(2, seed=63))
        assert outs == [(None, False), (None, False)], outs
        assert r.run("ep_ht_jobs:masked") == [[], []]
    finally:
        _close(r)


@pytest.mark.parametrize("between", [(), ("combine",), ("cached",)])
def test_a_header_of_the_next_dispatch_does_not_overwrite_the_one_being_read(between):
    """2 ranks over p2p, enable_shrink, rank 0's notify stalled 3 s between checking the peers'
    headers and reading them again (the window of a wait for a slow third source). Each rank's
    first dispatch stays on the rank, so rank 1 finishes it without rank 0 (then, per ``between``,
    a combine or a cached dispatch: one more HT op, no notify) and starts the next dispatch,
    whose header (rows for rank 0 now) arrives in the window. Invariant: both dispatches on both
    ranks equal the reference and nobody is masked. With one header slot per source rank 0 read
    the next dispatch's counts for the first and masked rank 1; with a slot per op-epoch parity
    it did so with ops between (ht.cuh ht_rhdr: a slot per notify parity)."""
    r = _pool(2, "p2p", 32, shrink=True, timeout_s=LONG_TIMEOUT_S)    # no wait may run out here
    try:
        outs = r.run("ep_ht_jobs:header_overtaken", _spec(2, seed=41), 3_000_000_000, between)
        for rank, calls in enumerate(outs):
            for step, (raised, masked, bad) in enumerate(calls):
                assert (raised, masked, bad) == (None, [], []), (rank, step, outs)
    finally:
        _close(r)


def test_ranks_whose_configs_differ_in_the_ring_raise_instead_of_mixing_rings():
    """2 ranks over ibgda; rank 1's Config has a 64-token receive ring, rank 0's 48 (the same
    channels). Invariant: both raise ConfigError naming the disagreement (the header carries the
    ring since this session: ht.cuh ht_notify's shape word); before, the channel count alone was
    checked and each rank addressed the other's rings at its own offsets."""
    r = _pool(2, "ibgda", 32, timeout_s=5.0, num_nvl_bytes=_nbytes(2, (2, 4, 64)))
    try:
        outs = r.run("ep_ht_jobs:dispatch_with_config", _spec(2, seed=43), [SMALL, (2, 4, 64)])
        for o in outs:
            assert o is not None and o.startswith("ConfigError") and "Config" in o, outs
    finally:
        _close(r)


@pytest.mark.parametrize("transport", ["p2p", "ibgda"])
def test_ranks_whose_combine_configs_differ_in_the_ring_raise(transport):
    """2 ranks; the dispatch with one Config, then the combine with a 48-token receive ring on
    rank 0 and a 64-token one on rank 1. The combine sends no header: each rank put its rows at
    the offsets its own ring gives. Invariant: neither returns; at least one raises ConfigError
    naming the Config (each combine row carries the op counter and the sender's ring, checked
    once per tail read: ht.cuh ht_recv_combine), and so does the other, unless the first found
    the mismatch before any of its sender blocks had started (a failed launch does not start
    its data phase's later blocks: run_ht): then it sent no row, and the other times out naming
    it silent, within its bound (seen once in ~10 runs on a loaded 2-core machine, the HOST arm's
    blocks being threads). Before the check, each summed rows read at the wrong offsets and
    returned them."""
    r = _pool(2, transport, 32, timeout_s=5.0, num_nvl_bytes=_nbytes(2, (2, 4, 64)))
    try:
        outs = r.run("ep_ht_jobs:combine_with_config", _spec(2, seed=47), [SMALL, (2, 4, 64)])
        named = [o is not None and o.startswith("ConfigError") and "Config" in o and "combine row" in o
                 for o in outs]
        assert any(named), outs
        for rank, o in enumerate(outs):
            assert named[rank] or (o is not None and o.startswith("EPTimeout") and
                                   "peer(s) [%d]" % (1 - rank) in o and "silent" in o), outs
    finally:
        _close(r)


def test_a_late_source_stores_nothing_into_returned_tensors():
    """2 ranks over p2p with receive pools, enable_shrink: rank 1's host stalls 6 s between its
    notify and its data launch (timeout_s 1). Rank 0 masks rank 1 and returns its receive
    tensors (in its pool, where a mapped source stores its rows in place). Invariant: when rank
    1's late data launch has run, rank 0's returned tensors still equal what it returned (rank 0
    revokes its descriptor for a source it ends the dispatch without: ht.cuh ht_revoke_descs,
    ht_desc_current); before, rank 1 took the descriptor and stored its rows into them, which by
    then may belong to another call (docs/EP.md's HT gap (3))."""
    r = _pool(2, "p2p-pool", 32, shrink=True, timeout_s=1.0)
    try:
        outs = r.run("ep_ht_jobs:dispatch_with_late_data", _spec(2, seed=73), 1, 6.0)
        assert outs[0] == (None, [1], True), outs
        # (a job apart: it starts once rank 1's dispatch, and so its data launch, has ended)
        assert r.run("ep_jobs:returned_unchanged") == [True, None]
    finally:
        _close(r)


def _late_rank_spec():
    """Rank 2 masks rank 0 locally before its dispatch and exits before combine; rank 0 sleeps
    0.3 s before combine; rank 0 masks rank 2 in dispatch (no header from it), rank 1 in
    combine (it had rank 2's header and rows)."""
    return _spec(3, seed=95, die=(VICTIM, "combine"), victim_masks=(0,), slow=(0, 0.3, "combine"),
                 masked_by_rank={0: ((VICTIM,), (VICTIM,)), 1: ((), (VICTIM,)), VICTIM: ((0,), (0,))})


_timings = ep_jobs.timings     # per survivor: (t_dispatch, t_combine, masked)


@pytest.mark.parametrize("transport", ["p2p", "ibgda"])
def test_a_rank_late_from_waiting_out_a_dead_one_is_not_masked(transport):
    """enable_shrink, a 3 s bound, 3 ranks. Rank 2 leaves rank 0 out of its last dispatch (its
    local mask: no notify header, no rows to rank 0) and exits before combine: rank 1 gets rank
    2's header and rows, while rank 0's notify waits out rank 2's header (a bound and a half:
    the silent check's second look) and then, 0.3 s slower (its sleep before combine), goes into
    combine too. Invariant: rank 1 does not take the LIVE rank 0 for dead: both survivors mask
    exactly rank 2, rank 0 in dispatch and rank 1 in combine, and their results equal the
    reference so masked (the LL analogue: tests/test_ep_ll.py, same name). It holds by the HT
    dispatch's coupling (ht.cuh "Waits on a peer"): rank 0 sends its rows and credits only after
    its notify, so rank 1's dispatch, which waits for them INDIRECTLY (2 x timeout_s + 1 s,
    heartbeats), ends with rank 0's (both dispatches ~4.5 s here; ~3.05 s when the notify's
    bound was plain, and it held then too); the 0.3 s is within rank 1's direct bound on rank
    0's combine rows."""
    r = _pool(3, transport, 32, shrink=True, timeout_s=3.0)
    try:
        spec = _late_rank_spec()
        outs = r.run_losing(VICTIM, "ep_ht_jobs:round_", spec)
        for status, o in outs:
            assert status == "ok", o
        why = "t_dispatch, t_combine, masked per survivor: %s" % _timings([o for _, o in outs])
        assert [o.get("masked") for _, o in outs] == [[VICTIM], [VICTIM]], why
        _assert_round([o for _, o in outs], spec)
    finally:
        _close_survivors(r)


@pytest.mark.parametrize("transport", ["p2p", "ibgda"])
def test_a_rank_still_waiting_out_a_dead_one_is_not_masked_by_the_next_notify(transport):
    """The round of test_a_rank_late_from_waiting_out_a_dead_one_is_not_masked, then at once
    (each survivor as soon as its combine returned, no barrier: as a training loop's steps) a
    round with rank 2 masked. In the first combine rank 1 still waits on the dead rank 2: its
    receiver for rank 2's rows (a bound and a half), its sender for rank 2's credit (until the
    receiver has given up on rank 2: ht.cuh failed_meanwhile; before it, the indirect bound and a
    half, 2 x timeout_s + 1 s + timeout_s / 2: ~8.5 s), while rank 0, which masked rank 2 in its
    notify, is done once rank 1's receiver has given up on rank 2 (~4.2 s): rank 0's next notify
    then waited ~4 s for rank 1's header. Invariant: both survivors finish both rounds exact and
    mask exactly rank 2, and neither waits out the indirect bound in the first combine (rank 1's
    ~4.5 s, 8.5 s before failed_meanwhile). With a plain bound on the header (wait_until) rank 0
    masked the LIVE rank 1 after timeout_s, and rank 1, its dispatch left without rank 0's rows
    and credits, masked rank 0 in turn; the notify waits as the LL waits do (ll.cuh wait_peer:
    heartbeats, a bound final only while the peer does not beat)."""
    r = _pool(3, transport, 32, shrink=True, timeout_s=3.0)
    try:
        specs = [_late_rank_spec(), _spec(3, seed=96, masked=(VICTIM,))]
        outs = r.run_losing(VICTIM, "ep_ht_jobs:rounds", specs)
        ep_jobs.check_rounds(outs, specs, [VICTIM], _assert_round)
        # and no survivor waits out the indirect bound (2 T + 1 s) on the dead rank in combine once
        # one of its waits has given up on it (ht.cuh failed_meanwhile: ~4.5 s, ~8.5 before)
        assert all(o[0]["t_combine"] < 2 * 3.0 + 1.0 for _, o in outs), _timings([o[0] for _, o in outs])
    finally:
        _close_survivors(r)


@pytest.mark.parametrize("transport,stage", [("mixed", "dispatch"), ("p2p", "combine")])
def test_a_dead_rank_raises_ep_timeout_without_shrink(transport, stage):
    """Without enable_shrink every survivor raises gpunet.EPTimeout from that call naming rank 2
    as silent and the phase, within a bounded time (never a hang); rank 2 is marked failed in the
    host-mapped flags."""
    outs, r, spec = _kill_round(transport, False, stage)
    try:
        for status, o in outs:
            assert status == "ok", o
            assert o["raised"] is not None, "no EPTimeout: %r" % (o,)
            assert o["raised"]["phase"] == stage and o["raised"]["peers_silent"] == [VICTIM], o["raised"]
            assert o["host_failed"] == [VICTIM], o
    finally:
        _close_survivors(r)


# ---- the benchmark's CPU mode ---------------------------------------------------------------------
def test_bench_ht_cpu_mode_checks_and_reports(tmp_path):
    """bench/ep.py --mode ht on the CPU (2 ranks, soft NIC, small sizes): it checks the dispatch
    against the reference (a PASS test row), sweeps the Configs given by --ht-configs, and writes
    the JSON with the BF16 / FP8 dispatch, combine and num_worst_tokens dispatch rows (each with
    its best Config), the torch gather yardstick and the target rows, and whether each rank's
    receive pool ran out. --hold-us runs the "(device)" loop too (on the CPU without a hold: the
    code only a GPU run reached until 5f92927 broke it unseen), with its rows and target rows, at
    the Config --ht-device-config names (the second), which each of those rows reports; a Config
    outside the sweep there is refused."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "ht.json"
    configs = [(4, 4, 48, 2), (4, 8, 64, 2)]        # --ht-configs: the sweep from the command line
    r = subprocess.run([sys.executable, str(root / "bench" / "ep.py"), "--mode", "ht", "--tokens", "24",
                        "--iters", "1", "--warmup", "0", "--hold-us", "1", "--json", str(out),
                        "--ht-configs", ",".join(":".join(map(str, c)) for c in configs),
                        "--ht-device-config", ":".join(map(str, configs[1]))],
                       capture_output=True, text=True, timeout=900, cwd=str(root))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d = json.loads(out.read_text())
    ops = {row["op"] for row in d["rows"]}
    assert {"HT dispatch bf16", "HT dispatch fp8", "HT combine bf16", "HT combine bf16 ring", "HT dispatch bf16 worst",
            "torch gather, all ranks' rows"} <= ops
    assert {tuple(row["config"]) for row in d["rows"] if "config" in row and "default" not in row["op"]} \
        == set(configs)
    # what a caller without a Config gets: get_dispatch_config / get_combine_config, default warps
    assert {"HT dispatch bf16 (default Config)", "HT combine bf16 (default Config)"} <= ops
    tests = [g for g in d["gate"] if g["kind"] == "test"]
    assert tests and all(g["result"] == "PASS" for g in tests), tests
    assert {"HT dispatch bf16 (device)", "HT combine bf16 (device)", "HT dispatch fp8 (device)",
            "HT dispatch bf16 worst (device)", "torch gather (device), all ranks' rows"} <= ops
    assert sum(g["kind"] == "target" for g in d["gate"]) == 4
    assert {tuple(row["config"]) for row in d["rows"] if row["op"].startswith("HT ") and "(device)" in row["op"]} \
        == {configs[1]}
    bad = subprocess.run([sys.executable, str(root / "bench" / "ep.py"), "--mode", "ht", "--ht-configs", "4:4:48:2",
                          "--ht-device-config", "4:8:64:2"], capture_output=True, text=True, timeout=300,
                         cwd=str(root))
    assert bad.returncode != 0 and "not one Config of the sweep" in bad.stderr, bad.stderr[-2000:]
    assert all(run["held_fraction"] == [0.0, 0.0] for run in d["runs"])    # nothing held on a CPU
    assert all(row["GBps"] > 0 for row in d["rows"])
    # whether each rank's receive pool ran out (CUDA's stays out of use then): said per run
    assert all(len(run["pool_ran_out"]) == run["ranks"] for run in d["runs"])
    # the bench sizes its pool for the calls its loops hold at once: it never runs out
    assert not any(any(run["pool_ran_out"]) for run in d["runs"]), d["runs"]
