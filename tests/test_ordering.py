"""Ordering of GPU-initiated operations: hypothesis-generated schedules on the HOST arm + soft NIC.

What is generated (hypothesis draws compact parameters; the kernel expands them, see
gpunet/device/testing/kernels/schedule.cu ``k_schedule``, and gpunet.device.testing.ordering_ref mirrors
the expansion):
  - T threads in 1-2 blocks of 1-2 warps, warps of 32 or 64 lanes;
  - each thread: ROUNDS schedules back to back (own memory per round, quiet between), each a
    sequence of 2-8 operations drawn from put / inline put / get / put_signal / atomic fetch-add /
    quiet / fence, random sizes 0..256 and offsets; warp-collective bulk puts (put_nbi_warp);
  - ring depths 8/16/64 (small enough to fill and wrap), both CQ modes, both posting modes
    (qp.cuh: batched hand-over by tags, serial turn by db_head);
  - the weak-memory model on or off, with its drain order and seed;
  - on the c500 profile: finegrained (NIC-coherent) heaps with eviction events drawn anywhere.
Invariants checked after every launch:
  - final memory equals the sequential reference (each thread / warp writes its own ranges,
    atomics commute), for puts, gets and warp puts;
  - every operation completed exactly once: the fetched values of each atomic counter form a
    chain 0, a1, a1+a2, ... ending at the counter, signal words equal the number of put_signals;
  - a receiver that sees signal >= k sees the payload of the k-th put_signal (checked in-kernel:
    ``violations``);
  - no WQEBB reused before completion: resv_head == ready_head == db_head == done_head at the end,
    the NIC's consumer index equals it (mod 2^16), the QP never went to error (a reused slot
    would corrupt a WQE: wrong data or an error CQE), and the count of WQEBBs is >= the reference's
    WQE count;
  - no failure recorded (the Status block), no hang (every device wait is bounded).
Scale: each hypothesis example runs ROUNDS schedules in one launch; the CI profile runs
``max_examples * EXAMPLES_PER_PROFILE_EXAMPLE`` examples of the main test, so at least 10,000
schedules (the count is printed and asserted by the last test).
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpunet import errors
from gpunet.device import abi
from gpunet.device import ops as dops
from gpunet.device.testing import loopback as L
from gpunet.device.testing import schedule as S
from gpunet.device.testing.ordering_ref import check_schedule, prepare_schedule
from gpunet.host.softnic import SoftNic, u8_view

ROUNDS = 16                           # schedules per launch (each thread runs them back to back)
EXAMPLES_PER_PROFILE_EXAMPLE = 13     # ci: 50 * 13 = 650 examples * 16 rounds = 10,400 schedules
HEAP = 4 << 20
_count = {"schedules": 0, "launches": 0}


def _examples(k=EXAMPLES_PER_PROFILE_EXAMPLE):
    return settings().max_examples * k


@pytest.fixture(scope="module")
def world():
    """One NIC per profile and a cache of Loopbacks per (profile, depth, collapsed, kind, post_mode)."""
    # idle_spin_us=0: a spinning engine (pure spin) would starve the emulator's threads on 2 cores;
    # the default yields for a few passes, then sleeps between examples.
    nics = {"nvidia": SoftNic(arena_bytes=512 << 20, idle_spin_us=0)}
    lbs = {}

    def get(profile="nvidia", depth=16, collapsed=False, kind="host", post_mode="batched"):
        if profile not in nics:
            nics[profile] = SoftNic(profile=profile, arena_bytes=256 << 20, idle_spin_us=0)
        key = (profile, depth, collapsed, kind, post_mode)
        if key in lbs and not _healthy(lbs[key]):
            del lbs[key]                  # a failed example left it stuck or in error: rebuild
        if key not in lbs:
            lb = L.Loopback(nics[profile], sq_wqebbs=depth, collapsed=collapsed, timeout_s=20,
                            heap_bytes=HEAP, kind=kind, post_mode=post_mode)
            lb.keep = lb._top
            lbs[key] = lb
        lb = lbs[key]
        lb.reset_heap(lb.keep)
        return lb
    get.nics = nics
    yield get
    for n in nics.values():
        n.close()


def _healthy(lb):
    """A cached Loopback may be reused only if the last example left it clean."""
    resv, ready, db, done = lb.heads()
    return (lb.status.code == 0 and resv == ready == db == done and lb.nic.qp_state(lb.a) == "RTS"
            and lb.nic.qp_sq_ci(lb.a) == resv & 0xFFFF)


@pytest.fixture(scope="module")
def lib():
    return S.load()


def run_case(lib, lb, seed, blocks, warps_per_block, ws, nops, mix=S.MIX_ALL, weak=False,
             weak_seed=0, order=0, check_every=4, evict=None, check=True):
    """Run ROUNDS schedules in one launch on ``lb`` and check every invariant
    (ordering_ref.check_schedule) and that no failure was recorded; returns the heap offsets."""
    T = blocks * warps_per_block * ws
    nwarps = blocks * warps_per_block
    R = ROUNDS
    p = abi.alloc_struct(S.SchedParams)
    o, sources = prepare_schedule(lb, p, seed, R, T, nwarps, nops, mix, check_every, L.PEER)
    if evict is not None:
        evict("before")
    results = np.zeros(R * T * nops, dtype=np.uint64)
    violations = np.zeros(T, dtype=np.uint64)
    p.results, p.violations = results.ctypes.data, violations.ctypes.data
    heads0 = lb.heads()
    S.run_schedule(lib, lb, p, dops.Launch(grid=blocks, block=warps_per_block * ws, warp_size=ws, weak=weak,
                                           seed=weak_seed, order=order), check=check)
    _count["launches"] += 1
    _count["schedules"] += R
    if evict is not None:
        evict("after")
    check_schedule(lb, o, sources, seed, R, nops, T, ws, mix, results, violations, heads0, lb.heads())
    assert lb.status.code == 0
    return o


schedule_params = dict(
    seed=st.integers(0, (1 << 63) - 1),
    blocks=st.integers(1, 2),
    warps_per_block=st.just(1),        # 2 warps per block: test_schedules_many_warps
    ws=st.sampled_from([32, 32, 32, 64]),   # 64-lane warps cost 2x the OS threads: drawn 1 in 4
    nops=st.integers(2, 8),
    depth=st.sampled_from([8, 16, 64]),
    collapsed=st.booleans(),
    post_mode=st.sampled_from(["batched", "serial"]),
    weak=st.booleans(),
    weak_seed=st.integers(0, 1 << 32),
    order=st.sampled_from([0, 1, 2]),
)


@settings(max_examples=_examples(), deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=False)
@given(**schedule_params)
def test_schedules_match_sequential_reference(world, lib, seed, blocks, warps_per_block, ws, nops, depth,
                                              collapsed, post_mode, weak, weak_seed, order):
    """Generated schedules (see the module docstring) leave exactly the sequential reference's memory,
    complete every operation exactly once and never show a signal before its payload. Warps of 64
    run as one block (64 OS threads; 2 blocks of 64: test_schedules_many_warps)."""
    if ws == 64:
        blocks = 1
    lb = world(depth=depth, collapsed=collapsed, post_mode=post_mode)
    run_case(lib, lb, seed, blocks, warps_per_block, ws, nops, weak=weak, weak_seed=weak_seed, order=order)


@settings(max_examples=max(2, settings().max_examples // 16), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(**dict(schedule_params, blocks=st.just(2), warps_per_block=st.just(2)))
def test_schedules_many_warps(world, lib, seed, blocks, warps_per_block, ws, nops, depth, collapsed,
                              post_mode, weak, weak_seed, order):
    """As above with 2 blocks x 2 warps (up to 256 threads): fewer examples, they cost more here.
    On a serial QP the posts of 4 warps and their lanes wait for each other's turn."""
    lb = world(depth=depth, collapsed=collapsed, post_mode=post_mode)
    run_case(lib, lb, seed, blocks, warps_per_block, ws, nops, weak=weak, weak_seed=weak_seed, order=order)


@settings(max_examples=_examples(1), deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, (1 << 63) - 1), ws=st.sampled_from([32, 64]), nops=st.integers(2, 6),
       collapsed=st.booleans(), kind=st.sampled_from(["finegrained", "host"]),
       evict_before=st.booleans(), evict_after=st.booleans())
def test_c500_coherent_kinds_any_eviction(world, lib, seed, ws, nops, collapsed, kind, evict_before,
                                          evict_after):
    """c500 profile, NIC-touched heaps in finegrained / host memory: correct for every eviction
    choice (including never) — the protocol does not rely on evictions."""
    lb = world(profile="c500", depth=16, collapsed=collapsed, kind=kind)

    def evict(when):
        if (when == "before" and evict_before) or (when == "after" and evict_after):
            lb.nic.evict(lb.local_mr)
            lb.nic.evict(lb.remote_mr)
    run_case(lib, lb, seed, 1, 1, ws, nops, evict=evict)


def test_c500_device_kind_payload_is_stale(world, lib):
    """Negative: on c500, payload in `device` memory that was never evicted is stale at the NIC:
    the receiver gets the HBM image (zeros), not what the SMs wrote. This is why the coherence
    policy puts NIC-read payload in finegrained memory."""
    lb = world(profile="c500", depth=16, collapsed=False, kind="device")
    with pytest.raises(AssertionError, match="differs|chain|signal"):
        run_case(lib, lb, 12345, 1, 1, 32, 8, mix=(1 << S.K_PUT) | (1 << S.K_GET), check_every=0)


@pytest.mark.parametrize("post_mode", ["batched", "serial"])
@pytest.mark.parametrize("collapsed", [False, True])
def test_fault_mid_schedule_raises_and_drains(lib, collapsed, post_mode):
    """A bad rkey while 2 blocks x 2 warps run schedules: the launch returns (no hang), the status
    names the error CQE, the host raises CompletionError."""
    with SoftNic() as nic:
        lb = L.Loopback(nic, sq_wqebbs=8, collapsed=collapsed, timeout_s=5, heap_bytes=HEAP,
                        post_mode=post_mode)
        lb.peers[L.PEER].rkey ^= 0x40
        with pytest.raises(errors.CompletionError) as ei:
            run_case(lib, lb, 99, 2, 2, 32, 6)
        assert ei.value.qpn == lb.a.qpn


@pytest.mark.parametrize("ws", [32, 64])
def test_bad_pe_by_number_and_by_peer_ref_posts_nothing(lib, ws):
    """A schedule naming pe 7 of a 2-PE world (every verb, half of them by number and half by the
    PeerRef that gpunet::peer_ref took of it, schedule.cu): the host raises ConfigError naming
    pe 7, nothing is posted (the QP's heads do not move) and no destination byte changes."""
    with SoftNic() as nic:
        lb = L.Loopback(nic, sq_wqebbs=16, timeout_s=5, heap_bytes=HEAP)
        p = abi.alloc_struct(S.SchedParams)
        prepare_schedule(lb, p, 7, ROUNDS, ws, 1, 8, S.MIX_ALL, 4, L.PEER)
        p.pe = 7
        results = np.zeros(ROUNDS * ws * 8, dtype=np.uint64)
        violations = np.zeros(ws, dtype=np.uint64)
        p.results, p.violations = results.ctypes.data, violations.ctypes.data
        dst = u8_view(p.put_dst, ROUNDS * ws * p.region)
        before, heads0 = dst.copy(), lb.heads()
        with pytest.raises(errors.ConfigError, match=r"pe 7 is out of range \[0, 2\)"):
            S.run_schedule(lib, lb, p, dops.Launch(grid=1, block=ws, warp_size=ws))
        assert lb.heads() == heads0
        assert np.array_equal(dst, before)


def test_zz_schedule_count(request):
    """Records how many schedules ran (at least 10,000 in the ci profile when the module ran whole)."""
    n = _count["schedules"]
    print("\ntest_ordering: %d schedules in %d launches" % (n, _count["launches"]))
    ran_main = any("test_schedules_match_sequential_reference" in i.nodeid for i in request.session.items)
    if ran_main and settings().max_examples >= 50:
        assert n >= 10_000, n
