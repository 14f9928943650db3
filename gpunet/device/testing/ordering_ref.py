"""Test and benchmark support, not the API: the sequential reference of the ordering SCHEDULE
kernel (kernels/schedule.cu), written independently in numba, and the checks of its invariants.

Given the schedule parameters, it re-expands every thread's operation list with the same stateless
hash (splitmix64-based ``mix64``) and applies the operations in each thread's program order to
expected images of the memory. The schedule is designed so that this is well defined whatever the
interleaving: each thread (and each warp, for warp puts) writes only its own ranges, gets read
ranges nobody writes, and atomics only add (they commute); per-thread order is preserved by the
in-order QP. Returns the expected put / get / warp destinations, signal counts, and the list of
atomic (counter, addend, slot) triples for the exactly-once chain check. :func:`check_schedule`
checks one launch against it (tests/test_ordering.py, bench/device_post.py).
"""
import numpy as np
from numba import njit

from gpunet.device.abi import MAX_INLINE
from gpunet.device.testing.schedule import (K_ATOMIC, K_FENCE, K_GET, K_INLINE, K_PUT, K_QUIET,
                                            K_SIGNAL, K_WARP)

_TABLE = np.array([0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 5], dtype=np.int64)
M64 = (1 << 64) - 1


@njit(cache=True, inline="always")
def splitmix64(x):
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@njit(cache=True, inline="always")
def mix64(seed, a, b, c):
    return splitmix64(np.uint64(seed) ^ splitmix64(np.uint64(a) ^ splitmix64(np.uint64(b) ^ splitmix64(np.uint64(c)))))


@njit(cache=True)
def expand(seed, rounds, nops, nthreads, region, max_size, mix, ncounters, warp_region, ws,
           src, wsrc, get_src, put_dst, get_dst, warp_dst, sig, atomics):
    """Apply the schedule to the expected images (all uint8 / uint64 arrays, zeroed by the caller).

    atomics: int64[rounds * nthreads * nops, 3] filled with (counter, add, 1) per atomic op slot,
    (-1, 0, 0) elsewhere. Returns the number of WQEs the schedule posts (for accounting).
    """
    table = _TABLE
    nwarps = (nthreads + ws - 1) // ws
    wqes = 0
    seed = np.uint64(seed)
    for r in range(rounds):
        for g in range(nthreads):
            gw = g // ws
            for i in range(nops):
                slot = (r * nthreads + g) * nops + i
                atomics[slot, 0] = -1
                atomics[slot, 1] = 0
                atomics[slot, 2] = 0
                wh = mix64(seed, 0x1000 + r, gw, i)
                if ((mix >> K_WARP) & 1) != 0 and (wh & np.uint64(7)) == 0:
                    size = np.int64((wh >> np.uint64(8)) % np.uint64(warp_region + 1))
                    off = np.int64((wh >> np.uint64(32)) % np.uint64(warp_region - size + 1))
                    if g % ws == 0:          # the warp puts once; apply it once
                        d0 = (r * nwarps + gw) * warp_region + off
                        s0 = gw * warp_region + off
                        for k in range(size):
                            warp_dst[d0 + k] = wsrc[s0 + k]
                    continue
                h = mix64(seed, r, g, i)
                kind = table[np.int64(h & np.uint64(15))]
                if kind == K_QUIET and ((h >> np.uint64(4)) & np.uint64(1)) != 0:
                    kind = K_FENCE
                if ((mix >> kind) & 1) == 0:
                    kind = K_PUT
                size = np.int64((h >> np.uint64(8)) % np.uint64(max_size + 1))
                if kind == K_INLINE and size > MAX_INLINE:
                    size = MAX_INLINE
                off = np.int64((h >> np.uint64(24)) % np.uint64(region - size + 1))
                soff = np.int64((h >> np.uint64(44)) % np.uint64(region - size + 1))
                s0 = g * region + soff
                d0 = (r * nthreads + g) * region + off
                if kind == K_PUT or kind == K_INLINE or kind == K_SIGNAL:
                    for k in range(size):
                        put_dst[d0 + k] = src[s0 + k]
                    if size > 0:
                        wqes += 1
                    if kind == K_SIGNAL:
                        sig[r * nthreads + g] += 1
                        wqes += 1
                elif kind == K_GET:
                    for k in range(size):
                        get_dst[d0 + k] = get_src[s0 + k]
                    if size > 0:
                        wqes += 1
                elif kind == K_ATOMIC:
                    atomics[slot, 0] = np.int64((h >> np.uint64(20)) % np.uint64(ncounters))
                    atomics[slot, 1] = np.int64(1 + (h >> np.uint64(32)) % np.uint64(1000))
                    atomics[slot, 2] = 1
                    wqes += 1
    return wqes


def check_atomic_chains(atomics, results, counters):
    """Exactly once: for every counter, the fetched old values sorted form the chain 0, a1,
    a1+a2, ... and the final counter is the sum of the addends. ``results`` is the kernel's
    per-op-slot old values (~0 where no atomic ran); ``counters`` the final values."""
    res = np.asarray(results, dtype=np.uint64)
    for c in range(len(counters)):
        sel = (atomics[:, 0] == c) & (atomics[:, 2] == 1)
        olds = res[sel].astype(np.int64)
        adds = atomics[sel, 1]
        assert (res[sel] != np.uint64(M64)).all(), "an atomic reported no result"
        order = np.argsort(olds, kind="stable")
        olds, adds = olds[order], adds[order]
        expect = np.concatenate([[0], np.cumsum(adds)[:-1]]) if len(adds) else np.zeros(0, np.int64)
        assert (olds == expect).all(), "counter %d: fetched values are not a chain (lost/duplicated atomic)" % c
        assert int(counters[c]) == int(adds.sum()), "counter %d: %d != sum of adds %d" % (
            c, int(counters[c]), int(adds.sum()))
    unused = (atomics[:, 2] == 0)
    assert (res[unused] == np.uint64(M64)).all(), "a result slot of a non-atomic op was written"


# --- laying a launch of schedules out in a Loopback's heaps, and checking it -------------------
REGION = 256            # bytes each thread owns per schedule for puts / gets
WARP_REGION = 2048      # bytes each warp owns per schedule for warp puts
NCOUNTERS = 4           # shared atomic counters


def schedule_sizes(rounds, nthreads, nwarps):
    """Bytes of each buffer a launch of ``rounds`` schedules needs."""
    return {"src": nthreads * REGION, "wsrc": nwarps * WARP_REGION, "get_src": nthreads * REGION,
            "get_dst": rounds * nthreads * REGION, "put_dst": rounds * nthreads * REGION,
            "warp_dst": rounds * nwarps * WARP_REGION, "sig": rounds * nthreads * 8,
            "counters": NCOUNTERS * 8}


def prepare_schedule(lb, params, seed, rounds, nthreads, nwarps, nops, mix, check_every, pe):
    """Allocate the launch's buffers in ``lb``'s symmetric heaps, fill the sources with bytes
    seeded by ``seed``, zero the destinations, and fill ``params`` (a schedule.SchedParams) except
    its results / violations addresses, which live where the caller's device can write them.
    Returns ({name: heap offset}, (src, wsrc, get_src)): the offsets and copies of the source
    bytes, which ``expand`` needs for the reference."""
    sizes = schedule_sizes(rounds, nthreads, nwarps)
    o = {k: lb.sym(n) for k, n in sizes.items()}
    rng = np.random.default_rng(seed & 0xFFFFFFFF)
    local, remote = lb.local, lb.remote
    sources = []
    for name, side in (("src", local), ("wsrc", local), ("get_src", remote)):
        sources.append(rng.integers(0, 256, sizes[name], dtype=np.uint8))
        side[o[name]:o[name] + sizes[name]] = sources[-1]
    for name, side in (("get_dst", local), ("put_dst", remote), ("warp_dst", remote),
                       ("sig", remote), ("counters", remote)):
        side[o[name]:o[name] + sizes[name]] = 0
    p = params
    p.seed, p.rounds, p.ops, p.nthreads = seed, rounds, nops, nthreads
    p.region, p.max_size, p.mix, p.ncounters = REGION, REGION, mix, NCOUNTERS
    p.warp_region, p.check_every, p.pe = WARP_REGION, check_every, pe
    b = lb.local_base
    for name in ("src", "wsrc", "get_src", "get_dst", "put_dst", "warp_dst", "sig", "counters"):
        setattr(p, name, b + o[name])
    p.peer_view = lb.remote_base
    return o, tuple(sources)


def check_schedule(lb, o, sources, seed, rounds, nops, nthreads, ws, mix, results, violations,
                   heads_before, heads_after):
    """Assert every invariant of one launch of ``rounds`` schedules on ``lb`` (AssertionError with
    what broke): memory equals the sequential reference (puts, gets, warp puts), signal words count
    every put_signal, each atomic counter's fetched values form a chain (exactly once), no receiver
    saw a signal before its payload (``violations``), the QP's four heads agree after the launch
    and advanced by at least the reference's WQE count, the NIC's consumer index is at them and
    the QP is in RTS. ``o`` and ``sources`` are :func:`prepare_schedule`'s; ``results`` /
    ``violations`` the kernel's arrays read back; ``heads_*``: (resv, ready, db, done) before and
    after. Returns the reference's WQE count."""
    nwarps = (nthreads + ws - 1) // ws
    src, wsrc, gsrc = sources
    e_put = np.zeros(rounds * nthreads * REGION, np.uint8)
    e_get = np.zeros(rounds * nthreads * REGION, np.uint8)
    e_warp = np.zeros(rounds * nwarps * WARP_REGION, np.uint8)
    e_sig = np.zeros(rounds * nthreads, np.uint64)
    atomics = np.zeros((rounds * nthreads * nops, 3), np.int64)
    wqes = expand(seed, rounds, nops, nthreads, REGION, REGION, mix, NCOUNTERS, WARP_REGION, ws,
                  src, wsrc, gsrc, e_put, e_get, e_warp, e_sig, atomics)
    local, remote = lb.local, lb.remote
    assert (remote[o["put_dst"]:o["put_dst"] + e_put.size] == e_put).all(), \
        "put data differs from the sequential reference"
    assert (local[o["get_dst"]:o["get_dst"] + e_get.size] == e_get).all(), \
        "get data differs from the sequential reference"
    assert (remote[o["warp_dst"]:o["warp_dst"] + e_warp.size] == e_warp).all(), \
        "warp-put data differs from the sequential reference"
    word = ">u8" if lb.nic.atomic_endianness == "big" else "=u8"     # the NIC's atomic order
    sig = remote[o["sig"]:o["sig"] + rounds * nthreads * 8].view(word).astype(np.uint64)
    assert (sig == e_sig).all(), "signal counts differ (a put_signal lost or duplicated)"
    check_atomic_chains(atomics, results, remote[o["counters"]:o["counters"] + NCOUNTERS * 8].view(word))
    assert int(np.asarray(violations).sum()) == 0, "a receiver saw a signal before its payload"
    resv, ready, db, done = heads_after
    assert resv == ready == db == done, "heads differ: %s" % (heads_after,)
    assert resv - heads_before[0] >= wqes, "fewer WQEBBs (%d) than the reference's WQEs (%d)" % (
        resv - heads_before[0], wqes)
    assert lb.nic.qp_sq_ci(lb.a) == resv & 0xFFFF, "the NIC's consumer index is not at the heads"
    assert lb.nic.qp_state(lb.a) == "RTS", "the QP is not in RTS"
    return wqes
