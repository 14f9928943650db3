"""The soft mlx5 NIC (gpunet/host/softnic.py) and the host posting helpers (gpunet/host/wq.py), case by case.

Each test names the property it checks. Two NICs in this process (A requester, B responder, so a
remote access goes through B's MR table and a peer slot) serve most tests; the cross-process tests
spawn a second process that owns the responder NIC.
"""
import multiprocessing as mp
import os
import signal
import sys
import time

import numpy as np
import pytest
from numba import njit

import gpunet
from gpunet import mlx5
from gpunet.host import softnic, wq
from gpunet.host.softnic import Access, SoftNic, remove_stale_arenas
from gpunet.host.wq import CompletionQueue, SendQueue

GUARD = 0xAA
MR_OFF, MR_LEN = 1024, 1024      # every test buffer: guard | MR | guard


@pytest.fixture(scope="module")
def nics():
    a = SoftNic(name="testA-%d" % os.getpid(), retry_timeout_s=0.3)
    b = SoftNic(name="testB-%d" % os.getpid(), retry_timeout_s=0.3)
    yield a, b
    a.close()
    b.close()


class Pair:
    """A fresh RC pair A.qp <-> B.qp with guarded, registered buffers on both sides."""

    def __init__(self, a, b, sq_wqebbs=64, max_inline=256, cqe_cnt=256, laccess=Access.ALL,
                 raccess=Access.ALL, lpd=None, rpd=None, qp_pd=None, rcqe_cnt=256):
        self.a, self.b = a, b
        self.acq, self.bcq = a.create_cq(cqe_cnt), b.create_cq(rcqe_cnt)
        self.aqp = a.create_qp(self.acq, sq_wqebbs=sq_wqebbs, max_inline=max_inline, pd=qp_pd)
        self.bqp = b.create_qp(self.bcq)
        a.connect(self.aqp, self.bqp.info())
        b.connect(self.bqp, self.aqp.info())
        self.lbuf, self.rbuf = a.alloc(3 * MR_LEN), b.alloc(3 * MR_LEN)
        self.lbuf[:] = GUARD
        self.rbuf[:] = GUARD
        self.lmr = a.reg_mr(self.lbuf[MR_OFF:MR_OFF + MR_LEN], access=laccess, pd=lpd)
        self.rmr = b.reg_mr(self.rbuf[MR_OFF:MR_OFF + MR_LEN], access=raccess, pd=rpd)
        self.sq = SendQueue(self.aqp)
        self.cq = CompletionQueue(self.acq)
        self.rcq = CompletionQueue(self.bcq)

    def l(self, off=0):
        return self.lmr.addr + off

    def r(self, off=0):
        return self.rmr.addr + off

    def guards_intact(self):
        for buf in (self.lbuf, self.rbuf):
            if not ((buf[:MR_OFF] == GUARD).all() and (buf[MR_OFF + MR_LEN:] == GUARD).all()):
                return False
        return True


def _ok(cqes):
    assert all(not c.error for c in cqes), cqes
    return cqes


# --- basics -------------------------------------------------------------------------------------
def test_write_imm_inline_read_nop_move_the_right_bytes(nics):
    p = Pair(*nics)
    src = (np.arange(MR_LEN) * 7 % 256).astype(np.uint8)
    p.lbuf[MR_OFF:MR_OFF + MR_LEN] = src
    p.sq.post_write(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey, 300, signaled=True)
    c = _ok(p.cq.wait(1))[0]
    assert c.opcode == mlx5.CQE_REQ and c.wqe_counter == 0 and c.qpn == p.aqp.qpn
    assert (p.rbuf[MR_OFF:MR_OFF + 300] == src[:300]).all()
    assert p.rbuf[MR_OFF + 300] == GUARD
    # WRITE_WITH_IMM: the responder's CQ gets RESP_WR_IMM with the immediate and byte count
    p.sq.post_write_imm(p.l(8), p.lmr.lkey, p.r(512), p.rmr.rkey, 40, 0x12345678)
    r = _ok(p.rcq.wait(1))[0]
    assert (r.opcode, r.imm, r.byte_cnt, r.qpn) == (mlx5.CQE_RESP_WR_IMM, 0x12345678, 40,
                                                    p.bqp.qpn)
    assert r.imm_raw == int(mlx5.bswap32(0x12345678))   # copied raw from the ctrl segment
    assert (p.rbuf[MR_OFF + 512:MR_OFF + 552] == src[8:48]).all()
    # inline WRITE (spans WQEBBs), inline with imm
    data = bytes(range(200))
    p.sq.post_write_inline(data, p.r(600), p.rmr.rkey)
    p.sq.post_write_inline(b"xyz", p.r(900), p.rmr.rkey, imm=7, signaled=True)
    _ok(p.cq.wait(1))
    assert bytes(p.rbuf[MR_OFF + 600:MR_OFF + 800]) == data
    assert bytes(p.rbuf[MR_OFF + 900:MR_OFF + 903]) == b"xyz"
    assert _ok(p.rcq.wait(1))[0].imm == 7
    # READ back, then NOP
    p.sq.post_read(p.l(0), p.lmr.lkey, p.r(600), p.rmr.rkey, 200)
    p.sq.post_nop(signaled=True)
    c = _ok(p.cq.wait(1))[0]
    assert c.wqe_counter == p.sq.pi - 1
    assert bytes(p.lbuf[MR_OFF:MR_OFF + 200]) == data
    assert p.guards_intact()
    assert p.a.qp_state(p.aqp) == "RTS"


def test_atomics_are_native_endian_by_default_and_return_the_old_value(nics):
    """The default SoftNic(atomic_endianness="host"): FA, FA -1, CS hit and miss on a native word;
    old values native (both modes: tests/test_signal_endian.py)."""
    p = Pair(*nics)
    p.rbuf[MR_OFF:MR_OFF + 8] = np.frombuffer((1000).to_bytes(8, sys.byteorder), np.uint8)
    p.sq.post_atomic_fa(p.l(0), p.lmr.lkey, p.r(0), p.rmr.rkey, 5)
    p.sq.post_atomic_fa(p.l(8), p.lmr.lkey, p.r(0), p.rmr.rkey, (1 << 64) - 1)  # -1
    p.sq.post_atomic_cs(p.l(16), p.lmr.lkey, p.r(0), p.rmr.rkey, 1004, 77)       # hits
    p.sq.post_atomic_cs(p.l(24), p.lmr.lkey, p.r(0), p.rmr.rkey, 1004, 99, signaled=True)  # misses
    c = _ok(p.cq.wait(1))[0]
    assert c.byte_cnt == 8
    olds = [int.from_bytes(bytes(p.lbuf[MR_OFF + 8 * i:MR_OFF + 8 * i + 8]), sys.byteorder)
            for i in range(4)]
    assert olds == [1000, 1005, 1004, 77]
    assert int.from_bytes(bytes(p.rbuf[MR_OFF:MR_OFF + 8]), sys.byteorder) == 77
    assert p.guards_intact()


def test_read_after_write_on_one_qp_sees_the_write_and_fence_orders(nics):
    p = Pair(*nics)
    p.lbuf[MR_OFF:MR_OFF + 64] = 5
    p.sq.post_write(p.l(0), p.lmr.lkey, p.r(0), p.rmr.rkey, 64)
    p.sq.post_read(p.l(128), p.lmr.lkey, p.r(0), p.rmr.rkey, 64)
    # a fenced WRITE after a READ of the same bytes must not overtake it
    p.lbuf[MR_OFF + 256:MR_OFF + 320] = 9
    p.sq.post_write(p.l(256), p.lmr.lkey, p.r(0), p.rmr.rkey, 64, fence=True, signaled=True)
    _ok(p.cq.wait(1))
    assert (p.lbuf[MR_OFF + 128:MR_OFF + 192] == 5).all()
    assert (p.rbuf[MR_OFF:MR_OFF + 64] == 9).all()


def test_scatter_gather_write_with_two_data_segments(nics):
    p = Pair(*nics)
    p.lbuf[MR_OFF:MR_OFF + 16] = 1
    p.lbuf[MR_OFF + 100:MR_OFF + 124] = 2
    w = np.zeros(64, np.uint8)
    mlx5.set_ctrl_seg(w, 0, 0, mlx5.OPCODE_RDMA_WRITE, 0, p.aqp.qpn, mlx5.WQE_CTRL_CQ_UPDATE, 4, 0, 0)
    mlx5.set_raddr_seg(w, 16, p.r(0), p.rmr.rkey)
    mlx5.set_data_seg(w, 32, 16, p.lmr.lkey, p.l(0))
    mlx5.set_data_seg(w, 48, 24, p.lmr.lkey, p.l(100))
    p.sq.post_raw(w)
    assert _ok(p.cq.wait(1))[0].byte_cnt == 40
    assert list(p.rbuf[MR_OFF:MR_OFF + 41]) == [1] * 16 + [2] * 24 + [GUARD]


# --- protection -----------------------------------------------------------------------------------
def _bad_atomic_len(p):
    w = np.zeros(64, np.uint8)
    mlx5.build_atomic(w, 0, p.sq.pi, p.aqp.qpn, mlx5.OPCODE_ATOMIC_FA, 0, p.r(0), p.rmr.rkey,
                      p.l(0), p.lmr.lkey, 1, 0)
    mlx5.set_data_seg(w, 48, 4, p.lmr.lkey, p.l(0))
    p.sq.post_raw(w, signaled=False)


PROT_CASES = {
    # name: (Pair kwargs, post(p), syndrome)
    "bad_lkey": ({}, lambda p: p.sq.post_write(p.l(), p.lmr.lkey ^ 0x5500, p.r(), p.rmr.rkey, 8),
                 mlx5.SYNDROME_LOCAL_PROT_ERR),
    "stale_lkey_variant": ({}, lambda p: p.sq.post_write(p.l(), p.lmr.lkey ^ 1, p.r(), p.rmr.rkey, 8),
                           mlx5.SYNDROME_LOCAL_PROT_ERR),
    "bad_rkey": ({}, lambda p: p.sq.post_write(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey ^ 0x7700, 8),
                 mlx5.SYNDROME_REMOTE_ACCESS_ERR),
    "local_oob": ({}, lambda p: p.sq.post_write(p.l(MR_LEN - 4), p.lmr.lkey, p.r(), p.rmr.rkey, 8),
                  mlx5.SYNDROME_LOCAL_PROT_ERR),
    "local_below": ({}, lambda p: p.sq.post_write(p.l(-1), p.lmr.lkey, p.r(), p.rmr.rkey, 8),
                    mlx5.SYNDROME_LOCAL_PROT_ERR),
    "remote_oob_write": ({}, lambda p: p.sq.post_write(p.l(), p.lmr.lkey, p.r(MR_LEN - 4),
                                                       p.rmr.rkey, 8),
                         mlx5.SYNDROME_REMOTE_ACCESS_ERR),
    "remote_oob_read": ({}, lambda p: p.sq.post_read(p.l(), p.lmr.lkey, p.r(MR_LEN - 4),
                                                     p.rmr.rkey, 8),
                        mlx5.SYNDROME_REMOTE_ACCESS_ERR),
    "read_into_mr_without_local_write": (
        {"laccess": Access.REMOTE_READ},
        lambda p: p.sq.post_read(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey, 8),
        mlx5.SYNDROME_LOCAL_PROT_ERR),
    "atomic_result_without_local_write": (
        {"laccess": Access.REMOTE_READ},
        lambda p: p.sq.post_atomic_fa(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey, 1),
        mlx5.SYNDROME_LOCAL_PROT_ERR),
    "write_without_remote_write": (
        {"raccess": Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC},
        lambda p: p.sq.post_write(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey, 8),
        mlx5.SYNDROME_REMOTE_ACCESS_ERR),
    "read_without_remote_read": (
        {"raccess": Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC},
        lambda p: p.sq.post_read(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey, 8),
        mlx5.SYNDROME_REMOTE_ACCESS_ERR),
    "atomic_without_remote_atomic": (
        {"raccess": Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ},
        lambda p: p.sq.post_atomic_cs(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey, 0, 1),
        mlx5.SYNDROME_REMOTE_ACCESS_ERR),
    "local_mr_in_other_pd": ({"lpd": "new"},
                             lambda p: p.sq.post_write(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey, 8),
                             mlx5.SYNDROME_LOCAL_PROT_ERR),
    "remote_mr_in_other_pd": ({"rpd": "new"},
                              lambda p: p.sq.post_write(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey, 8),
                              mlx5.SYNDROME_REMOTE_ACCESS_ERR),
    "misaligned_atomic": ({}, lambda p: p.sq.post_atomic_fa(p.l(), p.lmr.lkey, p.r(4), p.rmr.rkey, 1),
                          mlx5.SYNDROME_REMOTE_INVAL_REQ_ERR),
    "atomic_length_not_8": ({}, _bad_atomic_len, mlx5.SYNDROME_LOCAL_LENGTH_ERR),
    "inline_over_max_inline": ({"max_inline": 64},
                               lambda p: p.sq.post_write_inline(bytes(100), p.r(), p.rmr.rkey),
                               mlx5.SYNDROME_LOCAL_LENGTH_ERR),
}


@pytest.mark.parametrize("case", sorted(PROT_CASES))
def test_protection_violation_gives_syndrome_flushes_rest_and_touches_nothing(nics, case):
    kwargs, post, synd = PROT_CASES[case]
    a, b = nics
    kwargs = dict(kwargs)
    if kwargs.get("lpd") == "new":
        kwargs["lpd"] = a.alloc_pd()
    if kwargs.get("rpd") == "new":
        kwargs["rpd"] = b.alloc_pd()
    p = Pair(a, b, **kwargs)
    p.lbuf[MR_OFF:MR_OFF + MR_LEN] = 3
    post(p)                                   # unsignalled: the error CQE comes anyway
    p.sq.post_write(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey, 8)
    p.sq.post_nop()
    cqes = p.cq.wait(3)
    assert [c.syndrome for c in cqes] == [synd, mlx5.SYNDROME_WR_FLUSH_ERR,
                                          mlx5.SYNDROME_WR_FLUSH_ERR], cqes
    assert all(c.opcode == mlx5.CQE_REQ_ERR for c in cqes)
    assert [c.wqe_counter for c in cqes] == [0, 1, 2] or cqes[0].wqe_counter == 0
    assert cqes[0].status == mlx5.syndrome_name(synd)
    assert a.qp_state(p.aqp) == "ERR"
    assert p.guards_intact()
    assert (p.rbuf[MR_OFF:MR_OFF + MR_LEN] == GUARD).all()   # nothing landed remotely either
    assert p.rcq.poll() == []


MALFORMED = {
    "ds_zero": (mlx5.OPCODE_NOP, 0),
    "write_ds_too_small": (mlx5.OPCODE_RDMA_WRITE, 2),
    "atomic_ds_wrong": (mlx5.OPCODE_ATOMIC_FA, 3),
    "unknown_opcode": (0x33, 3),
    "send_unsupported": (mlx5.OPCODE_SEND, 3),
    "ds_past_posted": (mlx5.OPCODE_RDMA_WRITE, 40),     # claims 10 WQEBBs, 1 posted
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_wqe_errors_and_engine_keeps_serving_other_qps(nics, case):
    a, b = nics
    opcode, ds = MALFORMED[case]
    p, other = Pair(a, b), Pair(a, b)
    w = np.zeros(64, np.uint8)
    mlx5.set_ctrl_seg(w, 0, 0, opcode, 0, p.aqp.qpn, 0, ds, 0, 0)
    p.sq.post_raw(w, nbb=1, signaled=False)
    c = p.cq.wait(1)[0]
    assert (c.opcode, c.syndrome, c.wqe_counter) == (mlx5.CQE_REQ_ERR,
                                                     mlx5.SYNDROME_LOCAL_QP_OP_ERR, 0)
    assert a.qp_state(p.aqp) == "ERR"
    p.sq.post_nop()
    assert p.cq.wait(1)[0].syndrome == mlx5.SYNDROME_WR_FLUSH_ERR
    other.lbuf[MR_OFF:MR_OFF + 8] = 4
    other.sq.post_write(other.l(), other.lmr.lkey, other.r(), other.rmr.rkey, 8, signaled=True)
    _ok(other.cq.wait(1))
    assert (other.rbuf[MR_OFF:MR_OFF + 8] == 4).all()
    assert p.guards_intact()


@pytest.mark.parametrize("case", ["back", "lap_ahead"])
def test_a_dbr_that_goes_back_or_laps_errors_the_qp_and_runs_nothing(nics, case):
    """The producer index in the DBR is 1 behind the consumer index ("back", the doorbell turn's
    lap bug, qp.cuh "The late leave") or 2 WQEBBs past a full ring ("lap_ahead"): the QP goes to
    ERR with one LOCAL_QP_OP_ERR CQE at the consumer index, no stale WQE of the ring runs again,
    and the other QPs keep being served."""
    a, b = nics
    p, other = Pair(a, b, sq_wqebbs=8), Pair(a, b)
    p.lbuf[MR_OFF:MR_OFF + 8] = 7
    for _ in range(13):                                  # every slot holds a valid old WRITE
        p.sq.post_write(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey, 8, signaled=True)
        _ok(p.cq.wait(1))
    p.rbuf[MR_OFF:MR_OFF + 8] = 0                        # a stale WQE run again would write 7s
    bad = p.sq.pi - 1 if case == "back" else p.sq.pi + 8 + 2
    q = p.aqp
    # the doorbell word of an earlier WQE: a changed word makes the NIC read the DBR
    wq.ring_doorbell(q.sq_addr, p.sq.n, q.dbrec_addr, q.db_addr, bad, p.sq.pi - 2)
    c = p.cq.wait(1)[0]
    assert (c.opcode, c.syndrome, c.wqe_counter) == (mlx5.CQE_REQ_ERR, mlx5.SYNDROME_LOCAL_QP_OP_ERR,
                                                     p.sq.pi & 0xFFFF)
    assert a.qp_state(p.aqp) == "ERR"
    assert not p.rbuf[MR_OFF:MR_OFF + 8].any() and p.guards_intact()
    other.lbuf[MR_OFF:MR_OFF + 8] = 4
    other.sq.post_write(other.l(), other.lmr.lkey, other.r(), other.rmr.rkey, 8, signaled=True)
    _ok(other.cq.wait(1))


# --- rings, counters, CQ modes ----------------------------------------------------------------------
def test_depth_8_ring_wraps_with_inline_wqes_spanning_the_end(nics):
    p = Pair(*nics, sq_wqebbs=8)
    rng = np.random.default_rng(1)
    expect = np.full(MR_LEN, GUARD, np.uint8)
    for i in range(300):
        off = int(rng.integers(0, MR_LEN - 200))
        if i % 3 == 0:
            data = rng.integers(0, 256, int(rng.integers(1, 150)), dtype=np.uint8)
            p.sq.post_write_inline(data, p.r(off), p.rmr.rkey)   # up to 3 WQEBBs, wraps
        else:
            n = int(rng.integers(1, 200))
            data = rng.integers(0, 256, n, dtype=np.uint8)
            p.lbuf[MR_OFF + off:MR_OFF + off + n] = data
            p.sq.post_write(p.l(off), p.lmr.lkey, p.r(off), p.rmr.rkey, n)
            p.sq.quiet()                       # the local source is reused next round
        expect[off:off + len(data)] = data
    p.sq.quiet()
    assert all(not c.error for c in p.cq.poll(10 ** 6))
    assert (p.rbuf[MR_OFF:MR_OFF + MR_LEN] == expect).all()
    assert p.guards_intact()


@njit(cache=True)
def _post_many(sq_addr, n, dbrec, db, qpn, cq_addr, cqe_cnt, cq_dbrec, laddr, lkey, raddr, rkey,
               total, out):
    """Post ``total`` 8-byte WRITEs (WQE i writes slot i % 64 from source slot i % 64) on a ring
    of n, signalling every other WQE; returns (CQEs seen, errors, last wqe_counter)."""
    pi = 0
    done = 0
    cqci = 0
    ncqe = 0
    nerr = 0
    last = -1
    while done < total:
        if pi - done < n - 1 and pi < total:
            s = (pi % 64) * 8
            fm = mlx5.WQE_CTRL_CQ_UPDATE if (pi % 2 == 1 or pi == total - 1) else 0
            wq.post_rdma(sq_addr, n, pi, qpn, mlx5.OPCODE_RDMA_WRITE, fm, raddr + s, rkey,
                         laddr + s, lkey, 8, 0)
            pi += 1
            wq.ring_doorbell(sq_addr, n, dbrec, db, pi, pi - 1)
            continue
        k = wq.poll_cq(cq_addr, cqe_cnt, cq_dbrec, cqci, out, 8)
        for j in range(k):
            c = (np.int64(out[j * 64 + 60]) << 8) | np.int64(out[j * 64 + 61])
            if (out[j * 64 + 63] >> 4) != 0:
                nerr += 1
            last = c
            done = pi - ((pi - 1 - c) & 0xFFFF)
            ncqe += 1
        cqci += k
    return ncqe, nerr, last


def test_16bit_wqe_counter_wraps_past_65536_on_a_small_ring(nics):
    p = Pair(*nics, sq_wqebbs=8, cqe_cnt=16)
    total = 70_000
    p.lbuf[MR_OFF:MR_OFF + 512] = (np.arange(512) % 256).astype(np.uint8)
    out = np.zeros(8 * 64, np.uint8)
    ncqe, nerr, last = _post_many(p.aqp.sq_addr, 8, p.aqp.dbrec_addr, p.aqp.db_addr, p.aqp.qpn,
                                  p.acq.buf_addr, 16, p.acq.dbrec_addr, p.l(), p.lmr.lkey, p.r(),
                                  p.rmr.rkey, total, out)
    assert (ncqe, nerr, last) == (total // 2, 0, (total - 1) & 0xFFFF)
    assert (p.rbuf[MR_OFF:MR_OFF + 512] == p.lbuf[MR_OFF:MR_OFF + 512]).all()
    assert p.a.qp_state(p.aqp) == "RTS"
    assert p.guards_intact()


def test_collapsed_cq_holds_the_latest_completion(nics):
    a, b = nics
    p = Pair(a, b)
    ccq = a.create_cq(collapsed=True)
    assert ccq.cqe_cnt == 1 and ccq.collapsed
    qp = a.create_qp(ccq)
    a.connect(qp, p.bqp.info())
    sq, cq = SendQueue(qp), CompletionQueue(ccq)
    assert cq.poll() == []
    for i in range(40):
        sq.post_write(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey, 8, signaled=True)
    deadline = time.monotonic() + 5
    last = None
    while time.monotonic() < deadline:
        got = cq.poll()
        if got:
            last = got[-1]
            if last.wqe_counter == 39:
                break
        time.sleep(0.001)
    assert last is not None and last.wqe_counter == 39 and not last.error


def test_cq_overrun_errors_the_cq_and_the_qp(nics):
    p = Pair(*nics, cqe_cnt=4)
    for _ in range(6):
        p.sq.post_nop(signaled=True)
    deadline = time.monotonic() + 5
    while p.a.qp_state(p.aqp) != "ERR" and time.monotonic() < deadline:
        time.sleep(0.001)
    assert p.a.qp_state(p.aqp) == "ERR"
    assert p.a.cq_state(p.acq) == "ERR"
    got = p.cq.poll()
    assert [c.wqe_counter for c in got] == [0, 1, 2, 3] and not any(c.error for c in got)
    p.sq.post_nop(signaled=True)           # nothing more is ever written into an errored CQ
    time.sleep(0.05)
    assert p.cq.poll() == []


@pytest.mark.parametrize("side", ["remote", "local"])
def test_an_address_whose_end_wraps_past_2_63_is_refused_not_dereferenced(nics, side):
    """A WRITE whose remote (or local) address is 8 bytes below 2**63 with 16 bytes: address +
    length wraps negative in the NIC's signed 64-bit check, which let it pass and the copy fault
    (SIGSEGV). It completes with the protection error and touches nothing."""
    p = Pair(*nics)
    bad = (1 << 63) - 8
    if side == "remote":
        p.sq.post_write(p.l(), p.lmr.lkey, bad, p.rmr.rkey, 16, signaled=True)
        want = mlx5.SYNDROME_REMOTE_ACCESS_ERR
    else:
        p.sq.post_write(bad, p.lmr.lkey, p.r(), p.rmr.rkey, 16, signaled=True)
        want = mlx5.SYNDROME_LOCAL_PROT_ERR
    c = p.cq.wait(1)[0]
    assert (c.opcode, c.syndrome) == (mlx5.CQE_REQ_ERR, want)
    assert p.guards_intact()


def test_write_imm_whose_bytes_did_not_land_gives_the_responder_no_completion(nics):
    """A WRITE_WITH_IMM from a local region registered as device memory with no copy engine
    attached: the requester completes with the protection error, and the responder gets no
    RESP_WR_IMM (it said byte_cnt 64 for bytes that never came)."""
    a, b = nics
    p = Pair(a, b)
    host = np.full(64, 9, np.uint8)
    dmr = a.reg_mr(host.ctypes.data, 64, device_memory=True)
    p.sq.post_write_imm(host.ctypes.data, dmr.lkey, p.r(), p.rmr.rkey, 64, 0xABCD, signaled=True)
    c = p.cq.wait(1)[0]
    assert c.error and c.syndrome == mlx5.SYNDROME_LOCAL_PROT_ERR, c
    time.sleep(0.05)
    assert p.rcq.poll() == []
    assert (p.rbuf[MR_OFF:MR_OFF + 64] == GUARD).all()
    a.dereg_mr(dmr)


def test_a_responder_whose_cq_overruns_goes_to_error_with_the_overrun_syndrome(nics):
    """WRITE_WITH_IMMs into a responder CQ of 4 entries nobody polls: the responder QP goes to ERR
    and reports the overrun (-1, as for a requester), not 0."""
    p = Pair(*nics, rcqe_cnt=4)
    p.lbuf[MR_OFF:MR_OFF + 8] = 1
    for i in range(6):
        p.sq.post_write_imm(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey, 8, i, signaled=True)
    _ok(p.cq.wait(6))
    assert p.b.qp_state(p.bqp) == "ERR"
    assert p.b.qp_error_syndrome(p.bqp) == -1


def test_dereg_mr_returns_only_once_no_wqe_moves_bytes_of_the_region(nics):
    """A 256 MiB WRITE into a registered region, deregistered as soon as its first bytes land:
    dereg_mr returns only after the copy has ended (as an HCA's deregistration: the caller may
    free the memory then), so nothing of the region changes after it returned; a WRITE after it
    completes with the remote access error."""
    a, b = nics
    acq, bcq = a.create_cq(16), b.create_cq(16)
    aqp, bqp = a.create_qp(acq), b.create_qp(bcq)
    a.connect(aqp, bqp.info())
    b.connect(bqp, aqp.info())
    n = 256 << 20                     # long enough to deregister in the middle of its copy
    src, dst = np.full(n, 7, np.uint8), np.zeros(n, np.uint8)
    lmr, rmr = a.reg_mr(src), b.reg_mr(dst)
    sq, cq = SendQueue(aqp), CompletionQueue(acq)
    sq.post_write(src.ctypes.data, lmr.lkey, dst.ctypes.data, rmr.rkey, n, signaled=True)
    deadline = time.monotonic() + 10
    while dst[0] == 0 and time.monotonic() < deadline:
        pass
    b.dereg_mr(rmr)
    written = int(np.count_nonzero(dst))
    _ok(cq.wait(1))
    assert int(np.count_nonzero(dst)) == written, "bytes landed after dereg_mr returned"
    sq.post_write(src.ctypes.data, lmr.lkey, dst.ctypes.data, rmr.rkey, 8, signaled=True)
    c = cq.wait(1)[0]
    assert (c.opcode, c.syndrome) == (mlx5.CQE_REQ_ERR, mlx5.SYNDROME_REMOTE_ACCESS_ERR)
    a.dereg_mr(lmr)


# --- dead peers -----------------------------------------------------------------------------------
def test_dead_peer_read_times_out_with_retry_exceeded_and_fence_holds():
    with SoftNic(retry_timeout_s=0.3) as a, SoftNic() as b:
        p = Pair(a, b)
        p.lbuf[MR_OFF:MR_OFF + 8] = 1
        b.mark_down()
        t0 = time.monotonic()
        p.sq.post_read(p.l(64), p.lmr.lkey, p.r(), p.rmr.rkey, 8)
        p.sq.post_nop(fence=True, signaled=True)   # must not complete before the READ does
        cqes = p.cq.wait(2, timeout=5)
        dt = time.monotonic() - t0
        assert [c.syndrome for c in cqes] == [mlx5.SYNDROME_TRANSPORT_RETRY_EXC_ERR,
                                              mlx5.SYNDROME_WR_FLUSH_ERR]
        assert 0.25 <= dt < 3.0, dt
        assert (p.lbuf[MR_OFF + 64:MR_OFF + 72] == GUARD).all()


# --- cross-process ----------------------------------------------------------------------------------
def _child(q_out, q_in, profile):
    nic = SoftNic(profile=profile, retry_timeout_s=0.5)
    buf = nic.alloc(4096)
    buf[:] = GUARD
    mr = nic.reg_mr(buf[1024:2048])
    private = np.zeros(64, np.uint8)
    pmr = nic.reg_mr(private)                  # outside the arena: not reachable from elsewhere
    cq = nic.create_cq(64)
    qp = nic.create_qp(cq)
    q_out.put({"qp": qp.info(), "addr": mr.addr, "rkey": mr.rkey, "paddr": pmr.addr,
               "prkey": pmr.rkey, "arena": nic.arena_name})
    nic.connect(qp, q_in.get())
    rcq = CompletionQueue(cq)
    imm = rcq.wait(1, timeout=20)[0]
    q_out.put((bytes(buf[1024:1124]), imm.imm, bool((buf[:1024] == GUARD).all()
                                                    and (buf[2048:] == GUARD).all())))
    q_in.get()                                 # "close" or "hang" (then the parent kills us)
    nic.close()


@pytest.fixture
def child():
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_child, args=(q_out, q_in, "nvidia"), daemon=True)
    proc.start()
    yield proc, q_out, q_in
    if proc.is_alive():
        proc.kill()
    proc.join(10)
    remove_stale_arenas()


def test_cross_process_write_read_atomics_then_killed_peer_gives_retry_exceeded(child):
    proc, q_out, q_in = child
    info = q_out.get(timeout=60)
    with SoftNic(retry_timeout_s=0.5) as a:
        lbuf = a.alloc(4096)
        lmr = a.reg_mr(lbuf)
        cq = a.create_cq(64)
        qp = a.create_qp(cq)
        a.connect(qp, info["qp"])
        q_in.put(qp.info())
        sq, c = SendQueue(qp), CompletionQueue(cq)
        lbuf[:100] = np.arange(100, dtype=np.uint8)
        sq.post_write(lmr.addr, lmr.lkey, info["addr"], info["rkey"], 100)
        sq.post_read(lmr.addr + 200, lmr.lkey, info["addr"], info["rkey"], 100)
        sq.post_atomic_fa(lmr.addr + 400, lmr.lkey, info["addr"] + 512, info["rkey"], 3)
        sq.post_atomic_cs(lmr.addr + 408, lmr.lkey, info["addr"] + 512, info["rkey"],
                          int.from_bytes(bytes([GUARD] * 8), sys.byteorder) + 3, 42)
        sq.post_read(lmr.addr + 416, lmr.lkey, info["addr"] + 512, info["rkey"], 8)
        sq.post_write_imm(lmr.addr, lmr.lkey, info["addr"], info["rkey"], 100, 0xC0FFEE,
                          signaled=True)
        _ok(c.wait(1, timeout=10))
        assert (lbuf[200:300] == lbuf[:100]).all()
        assert bytes(lbuf[400:408]) == bytes([GUARD] * 8)
        assert int.from_bytes(bytes(lbuf[416:424]), sys.byteorder) == 42
        data, imm, guards = q_out.get(timeout=20)
        assert data == bytes(range(100)) and imm == 0xC0FFEE and guards
        # memory outside the peer's arena is private to its process: remote access error
        sq2 = SendQueue(a.create_qp(cq))
        a.connect(sq2.qp, info["qp"])
        sq2.post_write(lmr.addr, lmr.lkey, info["paddr"], info["prkey"], 8)
        assert c.wait(1)[0].syndrome == mlx5.SYNDROME_REMOTE_ACCESS_ERR
        # kill the peer: outstanding work completes with retry exceeded, no hang
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        time.sleep(0.01)                       # its heartbeat goes stale: the pid gets checked
        t0 = time.monotonic()
        sq.post_write(lmr.addr, lmr.lkey, info["addr"], info["rkey"], 8, signaled=True)
        got = c.wait(1, timeout=10)[0]
        assert got.syndrome == mlx5.SYNDROME_TRANSPORT_RETRY_EXC_ERR
        assert time.monotonic() - t0 < 3.0
        remove_stale_arenas()                  # a killed process leaves its arena: swept (by
        assert not os.path.exists("/dev/shm/" + info["arena"])   # us, or any NIC starting)
        name = a.arena_name
    assert not os.path.exists("/dev/shm/" + name)


# --- coherence model --------------------------------------------------------------------------------
def test_c500_device_memory_is_stale_for_the_nic_until_eviction():
    with SoftNic(profile="c500") as a:
        p = Pair(a, a)
        dev = a.alloc(1024)
        dmr = a.reg_mr(dev, kind="device")
        dev[:16] = 7                                      # SM writes: stay in L2
        p.sq.post_read(p.l(0), p.lmr.lkey, dmr.addr, dmr.rkey, 16, signaled=True)
        _ok(p.cq.wait(1))
        assert (p.lbuf[MR_OFF:MR_OFF + 16] == 0).all()   # the NIC read HBM: stale
        a.evict(dmr, 0, 16)
        p.sq.post_read(p.l(0), p.lmr.lkey, dmr.addr, dmr.rkey, 16, signaled=True)
        _ok(p.cq.wait(1))
        assert (p.lbuf[MR_OFF:MR_OFF + 16] == 7).all()
        # NIC writes and atomics land in HBM: invisible to SMs until an eviction
        p.lbuf[MR_OFF:MR_OFF + 8] = 9
        p.sq.post_write(p.l(0), p.lmr.lkey, dmr.addr + 256, dmr.rkey, 8)
        p.sq.post_atomic_fa(p.l(64), p.lmr.lkey, dmr.addr + 512, dmr.rkey, 5, signaled=True)
        _ok(p.cq.wait(1))
        assert (dev[256:264] == 0).all() and (dev[512:520] == 0).all()
        dev[300] = 1                                      # SM-dirty byte in the same line survives
        a.evict(dmr, 256, 300)
        assert (dev[256:264] == 9).all() and dev[300] == 1
        assert int.from_bytes(bytes(dev[512:520]), sys.byteorder) == 5
        a.check()                                         # not strict: nothing raised


def test_c500_strict_mode_reports_the_first_device_access():
    with SoftNic(profile="c500", strict=True) as a:
        p = Pair(a, a)
        fine = a.alloc(256)
        fmr = a.reg_mr(fine, kind="finegrained")
        dev = a.alloc(256)
        dmr = a.reg_mr(dev, kind="device")
        fine[:8] = 3
        p.sq.post_read(p.l(0), p.lmr.lkey, fmr.addr, fmr.rkey, 8, signaled=True)
        _ok(p.cq.wait(1))
        assert (p.lbuf[MR_OFF:MR_OFF + 8] == 3).all()   # finegrained: coherent at once
        a.check()
        p.sq.post_write(p.l(0), p.lmr.lkey, dmr.addr + 8, dmr.rkey, 0, signaled=True)
        _ok(p.cq.wait(1))
        a.check()                                       # 0 bytes: nothing touched, no violation
        p.sq.post_write(p.l(0), p.lmr.lkey, dmr.addr + 8, dmr.rkey, 8, signaled=True)
        _ok(p.cq.wait(1))                               # the access proceeds as modelled
        with pytest.raises(gpunet.CoherenceViolation, match="0x%x" % (dmr.addr + 8)):
            a.check()


def test_nvidia_profile_and_host_kind_are_coherent():
    with SoftNic(profile="nvidia", strict=True) as a:
        p = Pair(a, a)
        dev = a.alloc(256)
        dmr = a.reg_mr(dev, kind="device")
        dev[:8] = 6
        p.sq.post_read(p.l(0), p.lmr.lkey, dmr.addr, dmr.rkey, 8, signaled=True)
        _ok(p.cq.wait(1))
        assert (p.lbuf[MR_OFF:MR_OFF + 8] == 6).all()
        a.check()


# --- lifecycle ------------------------------------------------------------------------------------
def test_close_is_idempotent_unlinks_and_later_use_raises():
    nic = SoftNic()
    path = "/dev/shm/" + nic.arena_name
    assert os.path.exists(path) and nic.arena_name.startswith("gpunet-%d-" % os.getpid())
    nic.close()
    nic.close()
    assert not os.path.exists(path)
    with pytest.raises(gpunet.ClosedError):
        nic.alloc(64)
    with pytest.raises(gpunet.ConfigError):
        SoftNic(profile="amd")
    with SoftNic() as n2:
        cq = n2.create_cq(8)
        with pytest.raises(gpunet.ConfigError):
            n2.create_qp(cq, sq_wqebbs=12)
        with pytest.raises(gpunet.ConfigError):
            n2.create_cq(6)


# --- QP reset after an error ------------------------------------------------------------------------
def test_reset_qp_after_a_protection_error_returns_to_rts_and_works(nics):
    """A write with a bad rkey moves the QP to ERR (and flushes what follows); reset_qp brings it
    back to RTS with the same connection: the send queue restarts at WQE counter 0, the returned
    CQ index is past every CQE of the old life, and a good write then lands and completes OK."""
    a, b = nics
    p = Pair(a, b)
    p.lbuf[MR_OFF:MR_OFF + 64] = 7
    p.sq.post_write(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey ^ 0x100, 8)
    p.sq.post_write(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey, 8, signaled=True)
    cqes = p.cq.wait(2)
    assert [c.syndrome for c in cqes] == [mlx5.SYNDROME_REMOTE_ACCESS_ERR,
                                          mlx5.SYNDROME_WR_FLUSH_ERR]
    assert a.qp_state(p.aqp) == "ERR"
    assert a.qp_error_syndrome(p.aqp) == mlx5.SYNDROME_REMOTE_ACCESS_ERR
    ci = a.reset_qp(p.aqp)
    assert ci == p.cq.ci                          # both CQEs were the old life's, consumed above
    assert a.qp_state(p.aqp) == "RTS" and a.qp_sq_ci(p.aqp) == 0
    assert a.qp_error_syndrome(p.aqp) == 0
    assert (p.rbuf[MR_OFF:MR_OFF + 64] == GUARD).all()       # the flushed write moved nothing
    sq = SendQueue(p.aqp, cq=p.cq)                # a fresh producer: counter 0 again
    sq.post_write(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey, 64, signaled=True)
    c = _ok(p.cq.wait(1))[0]
    assert c.wqe_counter == 0
    assert (p.rbuf[MR_OFF:MR_OFF + 64] == 7).all() and p.guards_intact()
    with pytest.raises(gpunet.ConfigError, match="not RTS or ERR"):
        a.reset_qp(a.create_qp(a.create_cq(64)))      # a QP never connected is INIT


def test_reset_qp_raises_when_the_engine_cannot_drain():
    """On a NIC marked down nothing executes: reset_qp gives up after its timeout with a
    GpunetError instead of discarding rung work silently or waiting for ever."""
    with SoftNic(retry_timeout_s=0.3) as a, SoftNic(retry_timeout_s=0.3) as b:
        p = Pair(a, b)
        a.mark_down()
        p.sq.post_write(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey, 8, signaled=True)
        t0 = time.monotonic()
        with pytest.raises(gpunet.GpunetError, match="did not finish the WQEs rung"):
            a.reset_qp(p.aqp, timeout_s=0.3)
        assert time.monotonic() - t0 < 5


def test_reset_qp_that_failed_after_parking_the_qp_in_reset_can_be_retried(nics, monkeypatch):
    """reset_qp parks the QP in RESET before it waits out the engine's passes; when it gives up
    there (injected: the executor lock never seems free), the QP stays in RESET. A second reset_qp
    is the retry: it used to refuse any state but RTS or ERR, so the QP could never be reset again.
    Now it completes, the QP is RTS at WQE counter 0, and a write lands and completes."""
    a, b = nics
    p = Pair(a, b)
    p.lbuf[MR_OFF:MR_OFF + 64] = 9
    p.sq.post_write(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey ^ 0x100, 8, signaled=True)
    assert [c.syndrome for c in p.cq.wait(1)] == [mlx5.SYNDROME_REMOTE_ACCESS_ERR]
    with monkeypatch.context() as m:
        m.setattr(softnic, "_exec_barrier", lambda base: False)
        with pytest.raises(gpunet.GpunetError, match="executor lock was not released"):
            a.reset_qp(p.aqp, timeout_s=0.3)
    assert a.qp_state(p.aqp) == "RESET"
    ci = a.reset_qp(p.aqp, timeout_s=5.0)
    assert ci == p.cq.ci
    assert a.qp_state(p.aqp) == "RTS" and a.qp_sq_ci(p.aqp) == 0
    assert a.qp_error_syndrome(p.aqp) == 0
    sq = SendQueue(p.aqp, cq=p.cq)                # a fresh producer: counter 0 again
    sq.post_write(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey, 64, signaled=True)
    assert _ok(p.cq.wait(1))[0].wqe_counter == 0
    assert (p.rbuf[MR_OFF:MR_OFF + 64] == 9).all() and p.guards_intact()


class _Injected(Exception):
    """What the trace hook below raises: stands for an asynchronous exception (a KeyboardInterrupt,
    a signal handler's timeout) landing on a bytecode boundary."""


@pytest.mark.parametrize("op", ["reset_qp", "dereg_mr"])
def test_reset_qp_and_dereg_mr_never_hold_the_executor_lock_where_an_exception_can_land(op):
    """reset_qp and dereg_mr take the executor lock (H_EXEC) to wait out every engine pass in
    flight. A sys.settrace hook checks the lock at every Python line and return of softnic.py on
    the calling thread while ``op`` runs (the NIC marked down, so neither its engine thread nor a
    progress hook takes the lock) and raises _Injected at the first one where it is held: an
    exception there would leave it held, and the NIC's executor wedged for good. The invariant: the
    lock is never held where Python code runs, so nothing is injected, ``op`` completes, the lock
    is free, and once up again the NIC executes a write and resets the QP again."""
    with SoftNic(retry_timeout_s=0.3) as a, SoftNic(retry_timeout_s=0.3) as b:
        p = Pair(a, b)
        T = a._arena.T
        a.mark_down()
        checked = []

        def on_event(frame, event, arg):
            if event in ("line", "return"):
                checked.append(event)
                if int(T[softnic.H_EXEC]) != 0:
                    raise _Injected("executor lock held at %s:%d (%s)"
                                    % (frame.f_code.co_name, frame.f_lineno, event))
            return on_event

        def on_call(frame, event, arg):
            return on_event if frame.f_code.co_filename == softnic.__file__ else None

        sys.settrace(on_call)
        try:
            if op == "reset_qp":
                a.reset_qp(p.aqp)
            else:
                a.dereg_mr(a.reg_mr(p.lbuf[:MR_OFF]))
        except _Injected as e:
            injected = str(e)
        else:
            injected = None
        finally:
            sys.settrace(None)
        assert len(checked) > 5, "the trace hook saw no line of %s" % op
        assert int(T[softnic.H_EXEC]) == 0 and injected is None, injected
        T[softnic.H_DOWN] = 0                        # up again (mark_down has no undo)
        p.sq.post_write(p.l(), p.lmr.lkey, p.r(), p.rmr.rkey, 64, signaled=True)
        _ok(p.cq.wait(1, timeout=2.0))
        a.reset_qp(p.aqp, timeout_s=2.0)
        assert a.qp_state(p.aqp) == "RTS"


# --- stale arenas -----------------------------------------------------------------------------------
def _arena_child(q_out):
    nic = SoftNic(name="stale-child")
    q_out.put(nic.arena_name)
    time.sleep(600)                               # killed by the test long before


def _dead_pid():
    import subprocess
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_stale_arena_of_a_killed_process_is_reclaimed_and_live_ones_kept():
    """A live process's arena survives every sweep; once the process is killed (SIGKILL: no
    close, no atexit), the next SoftNic start on the machine removes the arena it left."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_arena_child, args=(q,), daemon=True)
    proc.start()
    try:
        name = q.get(timeout=120)
        path = "/dev/shm/" + name
        remove_stale_arenas()
        assert os.path.exists(path), "the arena of a live process was removed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert not proc.is_alive()
        with SoftNic():                           # a start reclaims it (if no one else did first)
            assert not os.path.exists(path)
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def test_stale_arena_sweep_keeps_locked_and_young_headerless_arenas():
    """The pid is not the only liveness test (another pid namespace may share /dev/shm): an arena
    whose owner holds its lock is kept even when its pid is unknown here; a header-less file (a
    creator before its flock) is kept while young; each goes once its owner is gone / it is old."""
    from gpunet.host.softnic import ARENA_MAGIC, H_MAGIC, _Arena

    pid = _dead_pid()
    locked = "gpunet-%d-locked-%d" % (pid, os.getpid())
    bare = "gpunet-%d-bare-%d" % (pid, os.getpid())
    arena = _Arena(locked, 1 << 16, create=True)
    try:
        arena.T[H_MAGIC] = ARENA_MAGIC
        open("/dev/shm/" + bare, "wb").close()
        remove_stale_arenas()
        assert os.path.exists("/dev/shm/" + locked), "a locked arena was removed"
        assert os.path.exists("/dev/shm/" + bare), "a young header-less arena was removed"
        arena.close()                             # the owner is gone: its lock with it
        remove_stale_arenas()
        assert not os.path.exists("/dev/shm/" + locked)
        remove_stale_arenas(min_age_s=0.0)
        assert not os.path.exists("/dev/shm/" + bare)
    finally:
        arena.close()
        for n in (locked, bare):
            if os.path.exists("/dev/shm/" + n):
                os.unlink("/dev/shm/" + n)
