"""Plain-torch, single-process references for MoE expert-parallel dispatch / combine.

What the tests, bench/ep.py and the ep-demo compare gpunet.ep.Buffer against. This module imports
nothing from gpunet.ep.buffer: a reference that shared code with the thing it checks could share
its bugs. Everything runs on the CPU or on whatever device the inputs are on.

The low-latency packed layout (DeepEP V1's, pinned in docs/EP.md):
  E_loc = num_experts // R; global expert e lives on rank e // E_loc as local expert e % E_loc.
  For local expert e and source rank j, the rows of j's tokens t that select e (any k with
  topk[t, k] == e; a token selecting the same expert twice counts once) sit in increasing t order at
  positions [begin_j, begin_j + count_j) with begin_j = sum of count_i for i < j;
  layout_range[e, j] = begin_j << 32 | count_j; src_info[e, pos] = t; packed_recv_count[e] = sum_j
  count_j. A masked rank contributes count 0. The layout is a function of the routing alone, so
  same-seed reruns hash identically.
"""

import torch

from gpunet.errors import ConfigError

FP8_E4M3_MAX = 448.0          # largest finite float8_e4m3fn value: the per-group scale maps amax here
FP8_GROUP = 128               # columns sharing one scale (DeepEP's per-token, per-128-channel blocks)
UE8M0_PER_INT32 = 4           # UE8M0 exponents packed per int32, byte i = group 4k+i
AMAX_FLOOR = 1e-4             # amax clamp, so an all-zero group gets a finite, nonzero scale
TAG_OFFSET = 128              # DeepEP's tagged rows hold rank - 128 (bf16 integers exact to 256)


# ---------------------------------------------------------------------------------------------
# metrics and hashes

def calc_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """DeepEP's similarity metric: 1 - 2<a+1, b+1> / (|a+1|^2 + |b+1|^2), in float64.

    a, b: tensors of one shape, any float dtype. 0 means equal; DeepEP's bounds are 1e-5 for BF16
    and 9e-4 for FP8 paths. NaN in either input gives NaN (callers check for it)."""
    if a.shape != b.shape:
        raise ConfigError("calc_diff: shapes differ: %s vs %s" % (tuple(a.shape), tuple(b.shape)))
    x = a.detach().to(torch.float64).cpu() + 1.0
    y = b.detach().to(torch.float64).cpu() + 1.0
    den = float((x * x + y * y).sum())
    if den == 0.0:
        return 0.0
    return 1.0 - 2.0 * float((x * y).sum()) / den


def hash_tensor(t: torch.Tensor) -> int:
    """An order-sensitive 64-bit digest of a tensor's bytes (for same-seed rerun checks).

    Same bytes in the same positions -> same hash; any tensor, any dtype (read as raw bytes)."""
    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).to(torch.int64)
    if raw.numel() == 0:
        return 0
    pos = torch.arange(raw.numel(), dtype=torch.int64)
    # (byte + 1) * an odd multiplier that depends on the position; the sum wraps in int64
    mult = (pos * 0x9E3779B1 + 0x7F4A7C15) | 1
    return int(((raw + 1) * mult).sum()) & 0xFFFFFFFFFFFFFFFF


def selection_bytes(hidden: int, op: str) -> int:
    """Bytes DeepEP's low-latency test counts per selection (a (token, k) with topk_idx != -1):
    "dispatch bf16" 2H, "dispatch fp8" H + H/128*4 + 16 (payload, scales, per-token metadata),
    "combine" (BF16) 2H. These include local traffic ("logical" bandwidth)."""
    if op == "dispatch fp8":
        return hidden + hidden // FP8_GROUP * 4 + 16
    if op in ("dispatch bf16", "combine", "combine bf16"):
        return 2 * hidden
    raise ConfigError("selection_bytes: unknown op %r" % (op,))


# ---------------------------------------------------------------------------------------------
# FP8 per-token casts and UE8M0 packing

def per_token_cast_to_fp8(x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False):
    """Cast rows to float8_e4m3fn with one float32 scale per 128 columns.

    x: [T, H] (any float dtype, normally bf16), H % 128 == 0.
    Returns (x_fp8 [T, H] torch.float8_e4m3fn, scales [T, H/128] float32) with, per group,
    amax = max|x| clamped to >= 1e-4, scale = amax / 448, rounded up to a power of two when
    round_scale or use_ue8m0, and x_fp8 = x / scale. x ~= x_fp8.float() * scale."""
    if x.dim() != 2:
        raise ConfigError("per_token_cast_to_fp8: x must be [T, H], got %s" % (tuple(x.shape),))
    t, h = x.shape
    if h % FP8_GROUP:
        raise ConfigError("per_token_cast_to_fp8: hidden %d is not a multiple of %d" % (h, FP8_GROUP))
    g = x.float().reshape(t, h // FP8_GROUP, FP8_GROUP)
    amax = g.abs().amax(dim=2).clamp(min=AMAX_FLOOR)
    scale = amax / FP8_E4M3_MAX
    if round_scale or use_ue8m0:
        scale = torch.pow(2.0, torch.ceil(torch.log2(scale)))
    x_fp8 = (g / scale.unsqueeze(2)).reshape(t, h).to(torch.float8_e4m3fn)
    return x_fp8, scale.contiguous()


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Pack float32 power-of-two scales into UE8M0 bytes, four per int32.

    scales: [..., G] float32, every entry a positive power of two (normal float32).
    Returns int32 [..., ceil(G/4)]: byte i (little-endian) of int32 k holds the biased exponent
    (exponent + 127) of group 4k + i; bytes past G are 0."""
    if scales.dtype != torch.float32:
        raise ConfigError("pack_ue8m0: scales must be float32, got %s" % scales.dtype)
    bits = scales.contiguous().view(torch.int32).to(torch.int64)
    if bool(((bits & 0x807FFFFF) != 0).any()) or bool(((bits >> 23) == 0).any()):
        raise ConfigError("pack_ue8m0: every scale must be a positive normal power of two "
                          "(use round_scale/use_ue8m0 in per_token_cast_to_fp8)")
    exp = (bits >> 23) & 0xFF
    g = exp.shape[-1]
    ng = -(-g // UE8M0_PER_INT32)
    pad = ng * UE8M0_PER_INT32 - g
    if pad:
        exp = torch.cat([exp, exp.new_zeros(*exp.shape[:-1], pad)], dim=-1)
    exp = exp.reshape(*exp.shape[:-1], ng, UE8M0_PER_INT32)
    word = exp[..., 0] | (exp[..., 1] << 8) | (exp[..., 2] << 16) | (exp[..., 3] << 24)
    word = torch.where(word >= (1 << 31), word - (1 << 32), word)   # two's complement into int32
    return word.to(torch.int32)


def unpack_ue8m0(packed: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Inverse of pack_ue8m0: int32 [..., ceil(G/4)] -> float32 scales [..., G] (2 ** (byte - 127))."""
    if packed.dtype != torch.int32:
        raise ConfigError("unpack_ue8m0: packed must be int32, got %s" % packed.dtype)
    w = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(UE8M0_PER_INT32, dtype=torch.int64, device=w.device) * 8
    b = (w.unsqueeze(-1) >> shifts) & 0xFF
    b = b.reshape(*packed.shape[:-1], -1)[..., :num_groups]
    return (b.to(torch.int32) << 23).view(torch.float32).contiguous()


def per_token_cast_back(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x_fp8 [T, H] float8_e4m3fn and scales -> float32 [T, H] (x_fp8 * its group's scale).

    scales: float32 [T, H/128], or packed UE8M0 int32 [T, ceil(H/512)] (pack_ue8m0's format).
    Any strides (Buffer returns column-major scale views)."""
    t, h = x_fp8.shape
    ng = h // FP8_GROUP
    s = unpack_ue8m0(scales, ng) if scales.dtype == torch.int32 else scales.float()
    if tuple(s.shape) != (t, ng):
        raise ConfigError("per_token_cast_back: scales shape %s does not fit x [%d, %d]"
                          % (tuple(scales.shape), t, h))
    return (x_fp8.float().reshape(t, ng, FP8_GROUP) * s.reshape(t, ng, 1)).reshape(t, h)


# ---------------------------------------------------------------------------------------------
# routing and inputs

def random_routing(num_tokens: int, num_topk: int, num_experts: int, seed: int, holes: int = 0,
                   hot_expert=None, hot_fraction: float = 0.5, empty_experts=(),
                   device="cpu") -> torch.Tensor:
    """A deterministic top-k routing: int64 [num_tokens, num_topk], distinct experts per token.

    Experts are the top-k of uniform random scores (DeepEP's test does the same with randn), so
    the load is uniform in expectation. holes: that many (token, slot) entries, chosen at random,
    become -1 (no expert). hot_expert: expert id that round(hot_fraction * num_tokens) tokens,
    chosen at random, select (others may select it too).
    empty_experts: ids no token selects. Same arguments -> same tensor."""
    if num_topk < 1 or num_experts < 1 or num_tokens < 0:
        raise ConfigError("random_routing: need num_topk >= 1, num_experts >= 1, num_tokens >= 0")
    empty = sorted(set(int(e) for e in empty_experts))
    if any(e < 0 or e >= num_experts for e in empty):
        raise ConfigError("random_routing: empty_experts %s outside [0, %d)" % (empty, num_experts))
    if hot_expert is not None and (hot_expert in empty or not 0 <= hot_expert < num_experts):
        raise ConfigError("random_routing: hot_expert %r is empty or out of range" % (hot_expert,))
    if num_topk > num_experts - len(empty):
        raise ConfigError("random_routing: top-%d needs %d selectable experts, have %d"
                          % (num_topk, num_topk, num_experts - len(empty)))
    gen = torch.Generator().manual_seed(int(seed))
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    if empty:
        scores[:, empty] = -1.0
    if hot_expert is not None:
        n_hot = int(round(hot_fraction * num_tokens))
        scores[torch.randperm(num_tokens, generator=gen)[:n_hot], hot_expert] = 2.0
    topk = scores.topk(num_topk, dim=1).indices.to(torch.int64)
    n = topk.numel()
    if holes:
        where = torch.randperm(n, generator=gen)[:min(int(holes), n)]
        topk.view(-1)[where] = -1
    return topk.to(device)


def tokens_per_rank(num_ranks: int, num_max_tokens: int, vary: bool = False, seed: int = 0):
    """Token counts per rank: all num_max_tokens, or (vary) DeepEP V2's T - rank pattern with a
    random draw in [0, num_max_tokens] for every third rank, so some rank may send nothing."""
    if not vary:
        return [num_max_tokens] * num_ranks
    gen = torch.Generator().manual_seed(int(seed) + 7)
    out = []
    for r in range(num_ranks):
        if r % 3 == 2:
            out.append(int(torch.randint(0, num_max_tokens + 1, (1,), generator=gen)))
        else:
            out.append(max(0, num_max_tokens - r))
    return out


def tagged_x(rank: int, num_tokens: int, hidden: int, device="cpu") -> torch.Tensor:
    """DeepEP's self-describing rows: bf16 [T, H] = rank - 128 everywhere, the last 128 columns
    holding the token index (exact in bf16 for T <= 256). hidden % 128 == 0."""
    if hidden % FP8_GROUP:
        raise ConfigError("tagged_x: hidden %d is not a multiple of %d" % (hidden, FP8_GROUP))
    x = torch.full((num_tokens, hidden), float(rank - TAG_OFFSET), dtype=torch.bfloat16, device=device)
    x[:, -FP8_GROUP:] = torch.arange(num_tokens, device=device).to(torch.bfloat16).view(-1, 1)
    return x


def make_rank_inputs(num_ranks: int, num_max_tokens: int, hidden: int, num_topk: int,
                     num_experts: int, seed: int, holes: int = 0, hot_expert=None,
                     empty_experts=(), vary_tokens: bool = False, tagged: bool = False,
                     device="cpu"):
    """Every rank's inputs from one seed (pplx style: any rank can rebuild all ranks' data).

    Returns a list over ranks of dicts {x: bf16 [T_j, H], topk_idx: int64 [T_j, K],
    topk_weights: float32 [T_j, K] (|randn|, left as is at -1 holes)}. x is random normal bf16, or
    DeepEP's tagged rows when tagged=True."""
    counts = tokens_per_rank(num_ranks, num_max_tokens, vary_tokens, seed)
    out = []
    for j, t in enumerate(counts):
        rseed = int(seed) * 1_000_003 + j
        gen = torch.Generator().manual_seed(rseed)
        x = (tagged_x(j, t, hidden) if tagged else
             torch.randn(t, hidden, generator=gen).to(torch.bfloat16))
        topk = random_routing(t, num_topk, num_experts, rseed, holes=holes, hot_expert=hot_expert,
                              empty_experts=empty_experts)
        w = torch.randn(t, num_topk, generator=gen).abs().float()
        out.append({"x": x.to(device), "topk_idx": topk.to(device), "topk_weights": w.to(device)})
    return out


# ---------------------------------------------------------------------------------------------
# low-latency dispatch / combine

def _check_routing(xs, topks, num_experts, num_max_dispatch_tokens_per_rank):
    r = len(topks)
    if r < 1 or len(xs) != r:
        raise ConfigError("need one x and one topk_idx per rank (got %d and %d)" % (len(xs), r))
    if num_experts % r:
        raise ConfigError("num_experts %d is not a multiple of the %d ranks" % (num_experts, r))
    for j, (x, tk) in enumerate(zip(xs, topks)):
        if tk.dtype != torch.int64 or tk.dim() != 2:
            raise ConfigError("rank %d: topk_idx must be int64 [T, K], got %s %s"
                              % (j, tk.dtype, tuple(tk.shape)))
        if x.shape[0] != tk.shape[0]:
            raise ConfigError("rank %d: x has %d tokens, topk_idx %d" % (j, x.shape[0], tk.shape[0]))
        if tk.shape[0] > num_max_dispatch_tokens_per_rank:
            raise ConfigError("rank %d: %d tokens > num_max_dispatch_tokens_per_rank %d"
                              % (j, tk.shape[0], num_max_dispatch_tokens_per_rank))
        if tk.numel() and (int(tk.min()) < -1 or int(tk.max()) >= num_experts):
            raise ConfigError("rank %d: topk_idx outside [-1, %d)" % (j, num_experts))
    return r


def ll_dispatch_ref(xs, topks, num_experts: int, num_max_dispatch_tokens_per_rank: int, rank: int,
                    masked_ranks=(), use_fp8: bool = False, round_scale: bool = False,
                    use_ue8m0: bool = False):
    """What rank `rank` must receive from a low-latency dispatch.

    xs[j]: bf16 [T_j, H], topks[j]: int64 [T_j, K] (-1 = no expert), for every rank j.
    Returns (packed_recv_x, packed_recv_count, src_info, layout_range):
      packed_recv_x    bf16 [E_loc, R*T_max, H], rows past the count zero; with use_fp8 the tuple
                       (fp8 [E_loc, R*T_max, H], scales) where scales are float32
                       [E_loc, R*T_max, H/128] or, with use_ue8m0, packed int32
                       [E_loc, R*T_max, ceil(H/512)], both as column-major views (.transpose(1, 2)
                       of a contiguous [E_loc, G, R*T_max]) like Buffer's; rows past the count are 0
      packed_recv_count int32 [E_loc]
      src_info         int32 [E_loc, R*T_max] (source token index; -1 past the count, where Buffer
                       is free to leave anything)
      layout_range     int64 [E_loc, R] = begin << 32 | count
    Masked ranks (masked_ranks) contribute count 0. The layout is described in the module docstring.
    """
    r = _check_routing(xs, topks, num_experts, num_max_dispatch_tokens_per_rank)
    if not 0 <= rank < r:
        raise ConfigError("rank %d outside [0, %d)" % (rank, r))
    hidden = xs[0].shape[1]
    e_loc = num_experts // r
    t_max = num_max_dispatch_tokens_per_rank
    masked = set(int(m) for m in masked_ranks)
    dev = xs[0].device
    recv_x = torch.zeros(e_loc, r * t_max, hidden, dtype=torch.bfloat16, device=dev)
    src_info = torch.full((e_loc, r * t_max), -1, dtype=torch.int32, device=dev)
    layout = torch.zeros(e_loc, r, dtype=torch.int64, device=dev)
    count = torch.zeros(e_loc, dtype=torch.int32, device=dev)
    for le in range(e_loc):
        ge = rank * e_loc + le
        begin = 0
        for j in range(r):
            n = 0
            if j not in masked and topks[j].numel():
                toks = (topks[j] == ge).any(dim=1).nonzero().view(-1)   # increasing t
                n = toks.numel()
                recv_x[le, begin:begin + n] = xs[j][toks].to(torch.bfloat16)
                src_info[le, begin:begin + n] = toks.to(torch.int32)
            layout[le, j] = (begin << 32) | n
            begin += n
        count[le] = begin
    if not use_fp8:
        return recv_x, count, src_info, layout
    q, s = per_token_cast_to_fp8(recv_x.view(-1, hidden), round_scale, use_ue8m0)
    q = q.view(e_loc, r * t_max, hidden)
    s = s.view(e_loc, r * t_max, hidden // FP8_GROUP)
    if use_ue8m0:
        s = pack_ue8m0(s)
    valid = torch.arange(r * t_max, device=dev).view(1, -1) < count.view(-1, 1)
    q = torch.where(valid.unsqueeze(2), q.view(torch.uint8), 0).view(torch.float8_e4m3fn)
    s = torch.where(valid.unsqueeze(2), s, torch.zeros((), dtype=s.dtype, device=dev))
    s = s.transpose(1, 2).contiguous().transpose(1, 2)   # column-major, as Buffer returns it
    return (q, s), count, src_info, layout


def ll_combine_ref(expert_outs, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handles,
                   rank: int, masked_ranks=()) -> torch.Tensor:
    """What low_latency_combine must return on rank `rank`.

    expert_outs[o]: bf16 [E_loc, R*T_max, H], the x that rank o passes to combine (its experts'
      outputs in the packed layout).
    topk_idx: int64 [T, K] and topk_weights: float32 [T, K], rank `rank`'s dispatch routing.
    handles[o]: rank o's dispatch handle (src_info [E_loc, R*T_max] int32, layout_range [E_loc, R]
      int64, T_max, H, num_experts), e.g. ll_dispatch_ref's outputs for rank o.
    Returns bf16 [T, H]: combined[t] = sum over k with topk_idx[t, k] != -1 and the expert's rank
    not masked of w[t, k] * expert_outs[o][e_loc, pos(t, e)], accumulated in float32 and rounded
    to bf16 once; pos is where rank o's layout put (rank, t) for expert e.
    """
    r = len(expert_outs)
    if len(handles) != r:
        raise ConfigError("need one expert output and one handle per rank (%d vs %d)"
                          % (r, len(handles)))
    num_experts = int(handles[0][4])
    hidden = int(handles[0][3])
    if num_experts % r:
        raise ConfigError("num_experts %d is not a multiple of %d ranks" % (num_experts, r))
    e_loc = num_experts // r
    if topk_idx.shape != topk_weights.shape:
        raise ConfigError("topk_idx %s and topk_weights %s differ in shape"
                          % (tuple(topk_idx.shape), tuple(topk_weights.shape)))
    t, k = topk_idx.shape
    masked = set(int(m) for m in masked_ranks)
    acc = torch.zeros(t, hidden, dtype=torch.float32, device=expert_outs[0].device)
    w = topk_weights.float()
    for e in range(num_experts):
        o, le = divmod(e, e_loc)
        if o in masked:
            continue
        sel = topk_idx == e                                   # [T, K]
        if not bool(sel.any()):
            continue
        src_info, layout = handles[o][0], handles[o][1]
        rng = int(layout[le, rank])
        begin, n = rng >> 32, rng & 0xFFFFFFFF
        pos_of = torch.full((t,), -1, dtype=torch.int64, device=acc.device)
        toks = src_info[le, begin:begin + n].to(torch.int64)
        if toks.numel() and (int(toks.min()) < 0 or int(toks.max()) >= t):
            raise ConfigError("rank %d's handle names tokens outside [0, %d) for expert %d"
                              % (o, t, e))
        pos_of[toks] = torch.arange(begin, begin + n, device=acc.device)
        rows_t = sel.any(dim=1).nonzero().view(-1)
        if bool((pos_of[rows_t] < 0).any()):
            raise ConfigError("rank %d's handle misses tokens of rank %d that select expert %d"
                              % (o, rank, e))
        rows = expert_outs[o][le, pos_of[rows_t]].float()      # [n_t, H]
        wsum = (w[rows_t] * sel[rows_t].float()).sum(dim=1)     # duplicates add their weights
        acc[rows_t] += wsum.view(-1, 1) * rows
    return acc.to(torch.bfloat16)


def ll_expected_counts(topks, num_experts: int, rank: int, masked_ranks=()) -> torch.Tensor:
    """int32 [E_loc]: for each of rank `rank`'s local experts, how many (source rank, token) pairs
    select it (a token counted once per expert however many slots name it); masked ranks send 0."""
    r = len(topks)
    e_loc = num_experts // r
    masked = set(int(m) for m in masked_ranks)
    out = torch.zeros(e_loc, dtype=torch.int32)
    for j, tk in enumerate(topks):
        if j in masked or not tk.numel():
            continue
        for le in range(e_loc):
            out[le] += int((tk == rank * e_loc + le).any(dim=1).sum())
    return out


def unpack_layout_range(layout_range: torch.Tensor):
    """layout_range int64 [E_loc, R] -> (begin, count), both int64 [E_loc, R]."""
    return layout_range >> 32, layout_range & 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# high-throughput ("normal") dispatch / combine
#
# The HT layout (DeepEP V1's intranode one, pinned in docs/EP.md): rank `rank` receives every token
# of every live source j that has at least one expert on `rank` (expert e lives on rank
# e // E_loc), ONCE however many of its experts live there; rows from source 0 first, then 1, ...,
# each source's tokens in increasing token order. recv_topk_idx holds LOCAL expert ids
# (e - rank * E_loc) for the token's experts on `rank` and -1 for the others (and for -1 slots);
# recv_topk_weights the token's weight where recv_topk_idx != -1, else 0. The per-expert count of
# local expert le is the number of received tokens naming it (once per token), rounded up to a
# multiple of expert_alignment. combine sends each row back and sums (no weights) per token.

def ht_layout_ref(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """What get_dispatch_layout must return, computed token by token in python.

    topk_idx: int64 [T, K] (-1 = no expert). Returns (num_tokens_per_rank int32 [R],
    num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R]): a token counts once per rank
    and once per expert however many of its slots name them."""
    if num_experts % num_ranks:
        raise ConfigError("num_experts %d is not a multiple of %d ranks" % (num_experts, num_ranks))
    e_loc = num_experts // num_ranks
    t = topk_idx.shape[0]
    per_rank = [0] * num_ranks
    per_expert = [0] * num_experts
    in_rank = torch.zeros(t, num_ranks, dtype=torch.bool)
    for i, row in enumerate(topk_idx.cpu().tolist()):
        experts = sorted(set(e for e in row if 0 <= e < num_experts))
        for e in experts:
            per_expert[e] += 1
        for r in sorted(set(e // e_loc for e in experts)):
            per_rank[r] += 1
            in_rank[i, r] = True
    return (torch.tensor(per_rank, dtype=torch.int32), torch.tensor(per_expert, dtype=torch.int32),
            in_rank)


def ht_dispatch_ref(xs, topks, weights, num_experts: int, rank: int, masked_ranks=(),
                    expert_alignment: int = 1):
    """What rank `rank` must receive from a high-throughput dispatch (layout above).

    xs[j]: bf16 [T_j, H], or the FP8 pair (float8_e4m3fn [T_j, H], float32 scales [T_j, H/128]),
    for every rank j; topks[j]: int64 [T_j, K]; weights[j]: float32 [T_j, K] (or None).
    Returns dict: recv_x (bf16 [N, H] or the FP8 pair [N, H], [N, H/128]), recv_topk_idx int64
    [N, K], recv_topk_weights float32 [N, K] (None without weights), counts (list of E_loc ints,
    aligned), src_idx int32 [N] (the source token of each row), rank_prefix int32 [R + 1] (rows of
    source j are [rank_prefix[j], rank_prefix[j + 1]))."""
    r = len(topks)
    e_loc = num_experts // r
    masked = set(int(m) for m in masked_ranks)
    fp8 = isinstance(xs[0], (tuple, list))
    rows, srow, tk_rows, w_rows, src, prefix = [], [], [], [], [], [0]
    counts = [0] * e_loc
    lo, hi = rank * e_loc, (rank + 1) * e_loc
    for j in range(r):
        if j in masked:
            prefix.append(prefix[-1])
            continue
        tk = topks[j].cpu()
        n = 0
        for t, row in enumerate(tk.tolist()):
            local = [e - lo if lo <= e < hi else -1 for e in row]
            if all(v < 0 for v in local):
                continue
            n += 1
            for le in sorted(set(v for v in local if v >= 0)):
                counts[le] += 1
            if fp8:
                rows.append(xs[j][0][t].cpu())
                srow.append(xs[j][1][t].cpu())
            else:
                rows.append(xs[j][t].cpu())
            tk_rows.append(torch.tensor(local, dtype=torch.int64))
            if weights is not None and weights[j] is not None:
                w = weights[j][t].cpu().float()
                w_rows.append(torch.where(torch.tensor(local) >= 0, w, torch.zeros_like(w)))
            src.append(t)
        prefix.append(prefix[-1] + n)
    h = (xs[0][0] if fp8 else xs[0]).shape[1]
    k = topks[0].shape[1] if topks else 0
    if rows:
        recv = torch.stack(rows)
        recv_s = torch.stack(srow) if fp8 else None
    else:
        recv = torch.empty(0, h, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
        recv_s = torch.empty(0, h // FP8_GROUP, dtype=torch.float32) if fp8 else None
    a = int(expert_alignment)
    return {
        "recv_x": (recv, recv_s) if fp8 else recv,
        "recv_topk_idx": torch.stack(tk_rows) if tk_rows else torch.empty(0, k, dtype=torch.int64),
        "recv_topk_weights": (torch.stack(w_rows) if w_rows else torch.empty(0, k)) if weights is not None else None,
        "counts": [(c + a - 1) // a * a for c in counts],
        "src_idx": torch.tensor(src, dtype=torch.int32),
        "rank_prefix": torch.tensor(prefix, dtype=torch.int32),
    }


def ht_combine_ref(ys, refs, is_token_in_rank: torch.Tensor, rank: int, masked_ranks=(), biases=(),
                   ys_weights=None):
    """What combine must return on rank `rank`.

    ys[d]: bf16 [N_d, H], the x rank d passes to combine (one row per row it received);
    refs[d]: ht_dispatch_ref(...) of rank d (its src_idx and rank_prefix locate rank `rank`'s rows);
    is_token_in_rank: bool [T, R] of rank `rank`; biases: up to two bf16 [T, H]; ys_weights[d]:
    float32 [N_d, K] or None. Returns (combined bf16 [T, H], combined weights float32 [T, K] or
    None): per token, float32 0 + bias0 + bias1 + the rows of the ranks d it went to (not masked),
    d ascending, rounded to bf16 once."""
    t, r = is_token_in_rank.shape
    h = ys[0].shape[1] if ys else 0
    masked = set(int(m) for m in masked_ranks)
    acc = torch.zeros(t, h, dtype=torch.float32)
    for b in biases:
        acc += b.cpu().float()
    k = ys_weights[0].shape[1] if ys_weights is not None else 0
    wacc = torch.zeros(t, k, dtype=torch.float32) if ys_weights is not None else None
    for d in range(r):
        if d in masked:
            continue
        toks = is_token_in_rank[:, d].cpu().nonzero().view(-1)
        b0 = int(refs[d]["rank_prefix"][rank])
        n = int(refs[d]["rank_prefix"][rank + 1]) - b0
        if n != toks.numel():
            raise ConfigError("rank %d's reference holds %d rows of rank %d, is_token_in_rank says %d"
                              % (d, n, rank, toks.numel()))
        if not torch.equal(refs[d]["src_idx"][b0:b0 + n].to(torch.int64), toks):
            raise ConfigError("rank %d's reference rows of rank %d are not its tokens in order" % (d, rank))
        acc[toks] += ys[d][b0:b0 + n].cpu().float()
        if wacc is not None:
            wacc[toks] += ys_weights[d][b0:b0 + n].cpu().float()
    return acc.to(torch.bfloat16), wacc
