"""Several warps publishing on ONE QP through qp.cuh's doorbell turn, on the HOST arm.

The kernel is gpunet.device.testing's post_rate.cu k_post (the one bench/device_post.py times on
the H200) against the soft NIC, which executes every WQE it is rung for. Its mixed mode makes the
warps' reservations differ in size (inline WRITEs of 1 to 4 WQEBBs, a few lanes idle per post), so
the turn's owner scans reservations of other warps, tagged or not yet written, and
rings for several warps at once.
"""
import ctypes
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpunet import errors
from gpunet.device import abi
from gpunet.device.testing import loopback as L
from gpunet.device.testing import post_rate
from gpunet.device.testing.post_rate import PostArgs
from gpunet.host.softnic import SoftNic

MIXED_BYTES = (8, 40, 100, 200)          # post_rate.cu mixed_bytes
SLOT = 256                               # mixed mode: one 256-byte slot per WQE


@pytest.fixture(scope="module")
def nic():
    with SoftNic(arena_bytes=192 << 20) as n:
        yield n


@pytest.fixture(scope="module")
def post_lib():
    return post_rate.load("host")


def _expected(warps, ws, iters):
    """{slot: nbytes} of every WQE mixed mode posts, and the number of WQEs (post_rate.cu)."""
    want = {}
    for g in range(warps):
        for it in range(iters):
            nposts = ws - (g + it) % 3
            for lane in range(nposts):
                want[(g * iters + it) * ws + lane] = MIXED_BYTES[(lane + it) % 4]
    return want


def _run(nic, lib, warps, ws, iters, depth, collapsed, weak, seed):
    """One k_post launch in mixed mode; returns (Loopback, dst offset, src offset, WQEs executed)."""
    span = warps * iters * ws * SLOT
    lb = L.Loopback(nic, sq_wqebbs=depth, collapsed=collapsed, timeout_s=20.0, heap_bytes=2 * span + (64 << 10))
    src, dst = lb.sym(span), lb.sym(span)
    lb.local[src:src + span] = np.random.default_rng(seed).integers(0, 256, span, dtype=np.uint8)
    lb.remote[dst:dst + span] = 0
    a = PostArgs(qps=lb.qpd.addr, status=ctypes.addressof(lb.status), timeout_ns=int(20e9),
                 raddr=lb.remote_base + dst, laddr=lb.local_base + src, span=span, nqps=1, iters=iters,
                 rkey=lb.remote_mr.rkey, lkey=lb.local_mr.lkey, nbytes=0, do_quiet=1, per_lane=1, mixed=1)
    w0 = nic.stats()["wqes"]
    rc = lib.gpunet_test_post(warps, ws, ws, int(weak), seed, ctypes.addressof(a))
    assert rc == 0, "launch failed (%d)" % rc
    abi.raise_for_status(lb.status, "post kernel")
    return lb, dst, src, nic.stats()["wqes"] - w0


@settings(max_examples=max(4, settings().max_examples // 6), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(warps=st.integers(1, 6), ws=st.sampled_from([32, 64]), iters=st.integers(1, 6),
       depth_log2=st.integers(7, 9), collapsed=st.booleans(), weak=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_multi_warp_publish_rings_every_wqe_once_and_never_early(nic, post_lib, warps, ws, iters,
                                                                depth_log2, collapsed, weak, seed):
    """Generated: 1-6 warps of 32 or 64 lanes posting 1-6 rounds each on ONE QP (rings of 128-512
    WQEBBs, so it wraps and back-pressure holds posters), owner-bit or collapsed CQ, strong or weak
    memory (seeded). Invariant: every WQE executed exactly once (the NIC's count == the WQEs posted,
    heads equal at the end), each slot holds exactly its source bytes and the bytes after them in
    the slot are untouched (a doorbell covering an unwritten or stale WQE executes old bytes,
    writes elsewhere, or fails the QP), and the QP stays in RTS."""
    depth = max(1 << depth_log2, 4 * ws)            # a warp's reservation is up to 4 * ws WQEBBs
    lb, dst, src, executed = _run(nic, post_lib, warps, ws, iters, depth, collapsed, weak, seed)
    want = _expected(warps, ws, iters)
    total_bb = sum((36 + n + 63) // 64 for n in want.values())
    resv, ready, db, done = lb.heads()
    assert resv == ready == db == done == total_bb, (lb.heads(), total_bb)
    assert executed == len(want), (executed, len(want))
    assert nic.qp_state(lb.a) == "RTS"
    R, S = lb.remote, lb.local
    for k in range(warps * iters * ws):
        o = k * SLOT
        n = want.get(k, 0)
        assert (R[dst + o:dst + o + n] == S[src + o:src + o + n]).all(), "slot %d: payload" % k
        assert not R[dst + o + n:dst + o + SLOT].any(), "slot %d: bytes past the payload" % k


@pytest.mark.parametrize("ws", [32, 64])
def test_many_warps_on_one_small_ring(nic, post_lib, ws):
    """Fixed: 12 warps x 8 rounds on a ring of 4 * ws WQEBBs (a warp's reservation is up to 4x
    its width, so the ring holds one or a few at once and posters wait for space behind the
    holder's rings). Same invariant as the generated test, strong memory."""
    lb, dst, src, executed = _run(nic, post_lib, 12, ws, 8, 4 * ws, False, False, 7)
    want = _expected(12, ws, 8)
    assert executed == len(want)
    assert lb.heads()[0] == lb.heads()[3]
    assert nic.qp_state(lb.a) == "RTS"
    for k, n in want.items():
        assert (lb.remote[dst + k * SLOT:dst + k * SLOT + n] == lb.local[src + k * SLOT:src + k * SLOT + n]).all()


def test_a_failed_status_makes_posts_fail_fast(nic, post_lib):
    """A failure already recorded in the Status: each warp's first post sees it with its
    reservation in flight, fills the reserved WQEBBs with NOPs and publishes them (the ring stays
    whole and the doorbell turn moves on), returns false and posts nothing more. So the heads stop
    at the two reservations, the NIC consumes exactly those WQEBBs, no byte reaches the peer, and
    the host raises the failure."""
    span = 1 << 16
    # 256 WQEBBs hold both reservations (156): with the Status failed, a post that had to wait for
    # space would give up at once and leave its reservation a hole (qp.cuh wait_room).
    lb = L.Loopback(nic, sq_wqebbs=256, timeout_s=5.0, heap_bytes=1 << 20)
    lb.remote[:span] = 0
    lb.status.code, lb.status.valid, lb.status.site = abi.STATUS_TIMEOUT, 1, abi.SITE_QUIET
    a = PostArgs(qps=lb.qpd.addr, status=ctypes.addressof(lb.status), timeout_ns=int(5e9),
                 raddr=lb.remote_base, laddr=lb.local_base, span=span, nqps=1, iters=2,
                 rkey=lb.remote_mr.rkey, lkey=lb.local_mr.lkey, nbytes=0, do_quiet=1, per_lane=1, mixed=1)
    w0 = nic.stats()["wqes"]
    assert post_lib.gpunet_test_post(2, 32, 32, 0, 0, ctypes.addressof(a)) == 0
    first = {k: n for k, n in _expected(2, 32, 2).items() if (k // 32) % 2 == 0}   # it == 0 of each warp
    nops = sum((36 + n + 63) // 64 for n in first.values())
    resv, ready, db, _ = lb.heads()
    assert resv == ready == db == nops, (lb.heads(), nops)
    deadline = time.monotonic() + 10
    while nic.qp_sq_ci(lb.a) != nops and time.monotonic() < deadline:
        time.sleep(0.01)
    assert nic.qp_sq_ci(lb.a) == nops and nic.stats()["wqes"] - w0 == nops
    assert nic.qp_state(lb.a) == "RTS"
    assert not lb.remote[:span].any()
    with pytest.raises(errors.GpunetError):
        abi.raise_for_status(lb.status, "post kernel")


def test_a_warp_reservation_larger_than_the_ring_is_a_bad_argument(nic, post_lib):
    """post_warp of more WQEBBs than the ring holds (64 lanes of up to 4 WQEBBs on 128): the post
    fails before reserving, the Status names a bad argument, the host raises it."""
    lb = L.Loopback(nic, sq_wqebbs=128, timeout_s=5.0, heap_bytes=1 << 20)
    a = PostArgs(qps=lb.qpd.addr, status=ctypes.addressof(lb.status), timeout_ns=int(5e9),
                 raddr=lb.remote_base, laddr=lb.local_base, span=1 << 16, nqps=1, iters=1,
                 rkey=lb.remote_mr.rkey, lkey=lb.local_mr.lkey, nbytes=0, do_quiet=1, per_lane=1, mixed=1)
    assert post_lib.gpunet_test_post(1, 64, 64, 0, 0, ctypes.addressof(a)) == 0
    assert lb.heads() == (0, 0, 0, 0)
    assert lb.status.code == abi.STATUS_BAD_ARGUMENT
    with pytest.raises(errors.GpunetError):
        abi.raise_for_status(lb.status, "post kernel")
