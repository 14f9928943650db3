"""gpunet.ep.reference against independent naive loops.

The references are what Buffer's tests, the bench and the demo trust, so each is checked here
against a plain Python loop written from the contract (docs/EP.md), never against itself.
"""
import math
import struct

import pytest
import torch
from hypothesis import given, settings, strategies as st

from gpunet.errors import ConfigError
from gpunet.ep import reference as ref

N = settings().max_examples


# ---------------------------------------------------------------------------------------------
# naive models

def naive_dispatch(topks, num_experts, rank):
    """Per local expert: the list of (source rank, token) in layout order, from Python loops."""
    r = len(topks)
    e_loc = num_experts // r
    out = []
    for le in range(e_loc):
        ge = rank * e_loc + le
        rows = []
        for j in range(r):
            for t, row in enumerate(topks[j].tolist()):
                if ge in row:
                    rows.append((j, t))
        out.append(rows)
    return out


def naive_combine(expert_outs, topk, w, handles, rank, masked=()):
    """combined[t] = sum_k w * expert_out[owner][le, pos] with pos found by scanning src_info."""
    r = len(expert_outs)
    num_experts = handles[0][4]
    e_loc = num_experts // r
    t_n, k_n = topk.shape
    h = expert_outs[0].shape[2]
    out = torch.zeros(t_n, h, dtype=torch.float64)
    for t in range(t_n):
        for k in range(k_n):
            e = int(topk[t, k])
            if e < 0 or e // e_loc in masked:
                continue
            o, le = divmod(e, e_loc)
            rng = int(handles[o][1][le, rank])
            begin, n = rng >> 32, rng & 0xFFFFFFFF
            hits = [p for p in range(begin, begin + n) if int(handles[o][0][le, p]) == t]
            assert len(hits) == 1
            out[t] += float(w[t, k]) * expert_outs[o][le, hits[0]].double()
    return out


@st.composite
def ep_cases(draw):
    """R in {1,2,3,4}, E_loc in 1..4, K in 1..min(E, 6), T_max in 1..12, per-rank T in 0..T_max,
    H in {128, 256, 384}, 0..4 holes per rank, optional masked rank."""
    r = draw(st.integers(1, 4))
    e = r * draw(st.integers(1, 4))
    k = draw(st.integers(1, min(e, 6)))
    t_max = draw(st.integers(1, 12))
    h = 128 * draw(st.integers(1, 3))
    holes = draw(st.integers(0, 4))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    ts = [draw(st.integers(0, t_max)) for _ in range(r)]
    masked = draw(st.sets(st.integers(0, r - 1), max_size=1)) if r > 1 else set()
    return dict(r=r, e=e, k=k, t_max=t_max, h=h, holes=holes, seed=seed, ts=ts, masked=masked)


def build(c):
    xs, tks, ws = [], [], []
    for j, t in enumerate(c["ts"]):
        g = torch.Generator().manual_seed(c["seed"] + j)
        xs.append(torch.randn(t, c["h"], generator=g).to(torch.bfloat16))
        tks.append(ref.random_routing(t, c["k"], c["e"], c["seed"] * 31 + j, holes=c["holes"]))
        ws.append(torch.rand(t, c["k"], generator=g))
    return xs, tks, ws


# ---------------------------------------------------------------------------------------------
# dispatch

@settings(max_examples=N)
@given(ep_cases())
def test_dispatch_layout_matches_naive_loop(c):
    """Generated: rank count, experts, top-k, hidden (multiples of 128), per-rank token counts,
    -1 holes, a masked rank. Invariants on every rank: counts equal the routing's per-expert counts
    (masked sources sending 0); layout ranges tile [0, count) in source-rank order; each
    (source rank, token) selecting the expert lands exactly once, in increasing token order, with its
    row copied bit for bit; rows past the count are zero."""
    xs, tks, _ = build(c)
    for rank in range(c["r"]):
        x, cnt, src, lay = ref.ll_dispatch_ref(xs, tks, c["e"], c["t_max"], rank,
                                               masked_ranks=c["masked"])
        e_loc = c["e"] // c["r"]
        assert x.shape == (e_loc, c["r"] * c["t_max"], c["h"]) and x.dtype == torch.bfloat16
        assert cnt.dtype == torch.int32 and src.dtype == torch.int32 and lay.dtype == torch.int64
        want = naive_dispatch([tk if j not in c["masked"] else tk[:0] for j, tk in enumerate(tks)],
                              c["e"], rank)
        assert torch.equal(cnt, ref.ll_expected_counts(tks, c["e"], rank, c["masked"]))
        for le in range(e_loc):
            rows = want[le]
            assert int(cnt[le]) == len(rows)
            begin, count = ref.unpack_layout_range(lay[le])
            assert int(begin[0]) == 0
            assert torch.equal(begin[1:], (begin + count)[:-1])          # ranges tile [0, count)
            assert int((begin + count)[-1]) == len(rows)
            for pos, (j, t) in enumerate(rows):
                assert int(begin[j]) <= pos < int(begin[j] + count[j])
                assert int(src[le, pos]) == t
                assert torch.equal(x[le, pos], xs[j][t])
            assert not bool(x[le, len(rows):].any())


def test_dispatch_of_tagged_rows_passes_deepeps_checks():
    """DeepEP's self-describing check on the reference: rank columns constant per row, the tail
    equals src_info, and each source rank's slice holds rank - 128."""
    r, e, t_max, h = 3, 6, 10, 256
    ins = ref.make_rank_inputs(r, t_max, h, 3, e, seed=5, holes=4, tagged=True, vary_tokens=True)
    xs = [i["x"] for i in ins]
    tks = [i["topk_idx"] for i in ins]
    for rank in range(r):
        x, cnt, src, lay = ref.ll_dispatch_ref(xs, tks, e, t_max, rank)
        for le in range(e // r):
            n = int(cnt[le])
            body = x[le, :n, :-128].float()
            assert torch.equal(body.amin(1), body.amax(1))
            assert torch.equal(x[le, :n, -128:].float(),
                               src[le, :n].float().view(-1, 1).expand(n, 128))
            begin, count = ref.unpack_layout_range(lay[le])
            for j in range(r):
                sl = body[int(begin[j]):int(begin[j] + count[j])]
                assert bool((sl == j - 128).all())


def test_duplicate_expert_in_one_token_lands_once():
    """A token naming the same expert in two slots is one row (DeepEP sends it once)."""
    xs = [torch.ones(2, 128, dtype=torch.bfloat16)]
    tks = [torch.tensor([[0, 0], [1, -1]])]
    _, cnt, src, _ = ref.ll_dispatch_ref(xs, tks, 2, 2, 0)
    assert cnt.tolist() == [1, 1] and int(src[0, 0]) == 0 and int(src[1, 0]) == 1


def test_same_seed_dispatch_hashes_identically():
    """Same seed -> same inputs and same packed outputs (hash equal); another seed -> different."""
    def run(seed):
        ins = ref.make_rank_inputs(2, 8, 128, 2, 4, seed=seed, holes=3)
        out = ref.ll_dispatch_ref([i["x"] for i in ins], [i["topk_idx"] for i in ins], 4, 8, 1)
        return [ref.hash_tensor(o) for o in out]
    assert run(11) == run(11)
    assert run(11) != run(12)


@settings(max_examples=max(5, N // 5))
@given(ep_cases(), st.booleans(), st.booleans())
def test_fp8_dispatch_is_the_bf16_dispatch_cast_per_row(c, round_scale, use_ue8m0):
    """Generated as in the layout test, plus round_scale / use_ue8m0. Invariant: the FP8 result is
    per_token_cast_to_fp8 of the BF16 packed rows (scales column-major, UE8M0 packed), zero past
    the count, and casts back within DeepEP's FP8 bound."""
    xs, tks, _ = build(c)
    e_loc = c["e"] // c["r"]
    n_rows = c["r"] * c["t_max"]
    for rank in range(c["r"]):
        xb, cnt, _, _ = ref.ll_dispatch_ref(xs, tks, c["e"], c["t_max"], rank)
        (q, s), cnt2, _, _ = ref.ll_dispatch_ref(xs, tks, c["e"], c["t_max"], rank, use_fp8=True,
                                                 round_scale=round_scale, use_ue8m0=use_ue8m0)
        assert torch.equal(cnt, cnt2) and q.dtype == torch.float8_e4m3fn
        ng = c["h"] // 128
        assert s.shape == (e_loc, n_rows, -(-ng // 4) if use_ue8m0 else ng)
        assert s.dtype == (torch.int32 if use_ue8m0 else torch.float32)
        assert s.transpose(1, 2).is_contiguous()                   # column-major scales
        for le in range(e_loc):
            n = int(cnt[le])
            q1, s1 = ref.per_token_cast_to_fp8(xb[le, :n], round_scale, use_ue8m0)
            assert torch.equal(q[le, :n].view(torch.uint8), q1.view(torch.uint8))
            assert torch.equal(s[le, :n], ref.pack_ue8m0(s1) if use_ue8m0 else s1)
            assert not bool(q[le, n:].view(torch.uint8).any()) and not bool(s[le, n:].any())
            if n:
                back = ref.per_token_cast_back(q[le, :n], s[le, :n])
                assert ref.calc_diff(back, xb[le, :n]) < 9e-4


# ---------------------------------------------------------------------------------------------
# combine

@settings(max_examples=max(10, N // 2))
@given(ep_cases())
def test_combine_matches_naive_loop_and_unit_outputs_sum_weights(c):
    """Generated as in the layout test. Invariants: ll_combine_ref equals a naive per-(t, k) loop
    that finds each row by scanning src_info (masked ranks' experts left out); with every expert
    output equal to ones, combined[t] = sum of t's weights at non -1 slots on live experts."""
    xs, tks, ws = build(c)
    disp = [ref.ll_dispatch_ref(xs, tks, c["e"], c["t_max"], o, masked_ranks=c["masked"])
            for o in range(c["r"])]
    handles = [(d[2], d[3], c["t_max"], c["h"], c["e"]) for d in disp]
    g = torch.Generator().manual_seed(c["seed"])
    outs = [torch.randn(d[0].shape, generator=g).to(torch.bfloat16) for d in disp]
    ones = [torch.ones_like(d[0]) for d in disp]
    e_loc = c["e"] // c["r"]
    for rank in range(c["r"]):
        if rank in c["masked"]:
            continue
        got = ref.ll_combine_ref(outs, tks[rank], ws[rank], handles, rank, c["masked"])
        assert got.dtype == torch.bfloat16 and got.shape == xs[rank].shape
        want = naive_combine(outs, tks[rank], ws[rank], handles, rank, c["masked"])
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=1e-2)
        unit = ref.ll_combine_ref(ones, tks[rank], ws[rank], handles, rank, c["masked"])
        live = (tks[rank] != -1)
        for m in c["masked"]:
            live &= (tks[rank] // e_loc != m)
        wsum = (ws[rank] * live).sum(1, keepdim=True).expand_as(unit)
        torch.testing.assert_close(unit.float(), wsum.to(torch.bfloat16).float(), atol=0, rtol=0)


def test_combine_of_dispatched_rows_is_x_times_weight_sum():
    """DeepEP's closed form: feeding the dispatched rows back as expert output gives
    x * sum(weights at non -1 slots), within calc_diff 1e-5 (BF16)."""
    ins = ref.make_rank_inputs(4, 16, 256, 4, 16, seed=3, holes=10, vary_tokens=True)
    xs = [i["x"] for i in ins]
    tks = [i["topk_idx"] for i in ins]
    disp = [ref.ll_dispatch_ref(xs, tks, 16, 16, o) for o in range(4)]
    handles = [(d[2], d[3], 16, 256, 16) for d in disp]
    for rank in range(4):
        got = ref.ll_combine_ref([d[0] for d in disp], tks[rank], ins[rank]["topk_weights"],
                                 handles, rank)
        w = (ins[rank]["topk_weights"] * (tks[rank] != -1)).sum(1, keepdim=True)
        assert ref.calc_diff(got, xs[rank].float() * w) < 1e-5


def test_combine_rejects_a_handle_that_misses_a_token():
    """A handle whose layout lacks a token the routing selects is an error, not a silent zero."""
    xs = [torch.ones(2, 128, dtype=torch.bfloat16)]
    tks = [torch.tensor([[0], [0]])]
    x, cnt, src, lay = ref.ll_dispatch_ref(xs, tks, 1, 2, 0)
    lay = lay.clone()
    lay[0, 0] = 1                                             # claims one row only
    with pytest.raises(ConfigError, match="misses"):
        ref.ll_combine_ref([x], tks[0], torch.ones(2, 1), [(src, lay, 2, 128, 1)], 0)


# ---------------------------------------------------------------------------------------------
# FP8, UE8M0, calc_diff

def naive_cast(x, round_scale):
    t, h = x.shape
    q = torch.empty(t, h, dtype=torch.float8_e4m3fn)
    s = torch.empty(t, h // 128)
    for i in range(t):
        for g in range(h // 128):
            blk = x[i, g * 128:(g + 1) * 128].float()
            sc = float(blk.abs().max().clamp(min=1e-4) / 448.0)      # float32 arithmetic
            if round_scale:
                sc = 2.0 ** math.ceil(math.log2(sc))
            s[i, g] = sc
            q[i, g * 128:(g + 1) * 128] = (blk / torch.tensor(sc, dtype=torch.float32)).to(
                torch.float8_e4m3fn)
    return q, s


@settings(max_examples=max(5, N // 5))
@given(st.integers(1, 6), st.integers(1, 5), st.booleans(), st.integers(0, 2 ** 31 - 1),
       st.floats(1e-6, 1e4))
def test_fp8_cast_matches_naive_group_loop(t, groups, round_scale, seed, mag):
    """Generated: T, H = 128 * groups, round_scale, a magnitude (tiny values exercise the 1e-4
    clamp). Invariant: per_token_cast_to_fp8 equals a per-(token, group) loop of the contract's
    formula; with round_scale every scale is a power of two and >= amax / 448."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, 128 * groups, generator=g) * mag).to(torch.bfloat16)
    q, s = ref.per_token_cast_to_fp8(x, round_scale=round_scale)
    nq, ns = naive_cast(x, round_scale)
    assert torch.equal(s, ns)
    assert torch.equal(q.view(torch.uint8), nq.view(torch.uint8))
    if round_scale:
        m, _ = torch.frexp(s)
        assert bool((m == 0.5).all())
        amax = x.float().view(t, groups, 128).abs().amax(2).clamp(min=1e-4)
        assert bool((s >= amax / 448.0).all())


@settings(max_examples=max(5, N // 5))
@given(st.lists(st.lists(st.integers(-126, 127), min_size=1, max_size=11), min_size=1, max_size=4)
       .filter(lambda rows: len(set(map(len, rows))) == 1))
def test_pack_ue8m0_matches_byte_loop_and_round_trips(exps):
    """Generated: rows of power-of-two exponents (equal lengths G in 1..11). Invariant: int32 k of a
    row has byte i (little-endian) = exponent of group 4k+i + 127, missing groups 0; unpacking
    returns the scales."""
    s = torch.tensor([[2.0 ** e for e in row] for row in exps], dtype=torch.float32)
    p = ref.pack_ue8m0(s)
    g = s.shape[1]
    assert p.shape == (s.shape[0], -(-g // 4)) and p.dtype == torch.int32
    for i, row in enumerate(exps):
        for k in range(p.shape[1]):
            b = [row[4 * k + j] + 127 if 4 * k + j < g else 0 for j in range(4)]
            assert struct.pack("<i", int(p[i, k])) == bytes(b)
    assert torch.equal(ref.unpack_ue8m0(p, g), s)


def test_pack_ue8m0_rejects_non_powers_of_two():
    """A scale that is not a power of two cannot be UE8M0: a ConfigError, not a silent truncation."""
    with pytest.raises(ConfigError, match="power of two"):
        ref.pack_ue8m0(torch.tensor([[1.5]]))


@settings(max_examples=max(5, N // 5))
@given(st.integers(1, 40), st.integers(0, 2 ** 31 - 1))
def test_calc_diff_matches_formula(n, seed):
    """Generated: length and seed. Invariants: calc_diff equals the formula computed in Python
    floats; it is 0 for equal inputs and symmetric."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=g)
    b = torch.randn(n, generator=g)
    xa = [float(v) + 1 for v in a.double()]
    xb = [float(v) + 1 for v in b.double()]
    want = 1 - 2 * sum(p * q for p, q in zip(xa, xb)) / sum(p * p + q * q for p, q in zip(xa, xb))
    assert ref.calc_diff(a, b) == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert ref.calc_diff(a, a) == pytest.approx(0.0, abs=1e-12)
    assert ref.calc_diff(a, b) == ref.calc_diff(b, a)


# ---------------------------------------------------------------------------------------------
# routing generators

@settings(max_examples=max(10, N // 2))
@given(st.integers(0, 64), st.integers(1, 8), st.integers(11, 40), st.integers(0, 20),
       st.integers(0, 2 ** 31 - 1), st.booleans(), st.integers(0, 3))
def test_random_routing_properties(t, k, e, holes, seed, hot, n_empty):
    """Generated: T, K, E, holes, seed, a hot expert or not, 0..3 empty experts. Invariants:
    shape [T, K] int64; ids in [-1, E); exactly min(holes, T*K) entries are -1; no token names an
    expert twice; empty experts never appear; the hot expert is chosen by at least
    round(0.5 * T) tokens less the holes; same seed -> same tensor."""
    empty = list(range(e - n_empty, e))
    hot_e = 0 if hot else None
    tk = ref.random_routing(t, k, e, seed, holes=holes, hot_expert=hot_e, empty_experts=empty)
    assert tk.shape == (t, k) and tk.dtype == torch.int64
    assert int((tk == -1).sum()) == min(holes, t * k)
    for row in tk.tolist():
        ids = [v for v in row if v != -1]
        assert len(ids) == len(set(ids)) and all(0 <= v < e for v in ids)
        assert not set(ids) & set(empty)
    if hot:
        assert int((tk == 0).any(1).sum()) >= round(0.5 * t) - holes
    assert torch.equal(tk, ref.random_routing(t, k, e, seed, holes=holes, hot_expert=hot_e,
                                              empty_experts=empty))


def test_tokens_per_rank_vary_stays_in_range_and_differs():
    """Varying counts are in [0, T_max] and not all equal; without vary every rank has T_max."""
    assert ref.tokens_per_rank(4, 9) == [9] * 4
    v = ref.tokens_per_rank(6, 9, vary=True, seed=1)
    assert all(0 <= n <= 9 for n in v) and len(set(v)) > 1


def test_bad_inputs_raise_config_errors():
    """Hidden not a multiple of 128, experts not divisible by ranks, T above T_max, top-k above the
    selectable experts: each a ConfigError naming the problem."""
    with pytest.raises(ConfigError, match="multiple of 128"):
        ref.per_token_cast_to_fp8(torch.ones(2, 100))
    x = [torch.ones(2, 128, dtype=torch.bfloat16)] * 2
    tk = [torch.zeros(2, 1, dtype=torch.int64)] * 2
    with pytest.raises(ConfigError, match="multiple of the 2 ranks"):
        ref.ll_dispatch_ref(x, tk, 3, 2, 0)
    with pytest.raises(ConfigError, match="num_max_dispatch_tokens_per_rank"):
        ref.ll_dispatch_ref(x, tk, 4, 1, 0)
    with pytest.raises(ConfigError, match="selectable"):
        ref.random_routing(4, 3, 4, 0, empty_experts=[0, 1])
