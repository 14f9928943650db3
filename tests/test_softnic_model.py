"""The soft NIC against its reference model (tests/softnic_reference.py), driven by hypothesis.

Random WQE streams (every opcode the NIC models, sizes 0..64 KiB biased to the small and to exact
boundaries, inline payloads up to the QP's max_inline, signalling and FENCE patterns, rings down
to 8 WQEBBs so they wrap, 16-bit WQE counters that wrap, owner-bit and collapsed CQs, occasional
protection faults, one or two QP pairs at once) are posted with gpunet/host/wq.py's njit post functions
onto one module-wide pair of soft NICs, and the memory and the CQEs they leave must be exactly
those the reference model computes.

Also here: atomics under contention (QPs of one process on one or two NICs, and two processes),
READ-after-WRITE and FENCE on one QP, and the c500 coherence model (stale payload on `device`
memory; `finegrained` / `host` memory right for every eviction schedule; strict mode).

Example counts come from the hypothesis profile (tests/conftest.py: "ci" by default, "deep" for a
soak); ``@settings`` here only scales them down for the slower tests.
"""
import ctypes
import multiprocessing
import random
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from numba import njit

from gpunet import mlx5
from gpunet.errors import CoherenceViolation

import softnic_reference as ref

softnic = pytest.importorskip("gpunet.host.softnic")
wq = pytest.importorskip("gpunet.host.wq")
from gpunet.host.rawmem import load_acquire_u32  # noqa: E402
SoftNic, Access = softnic.SoftNic, softnic.Access


def _examples(fraction):
    """A share of the active profile's max_examples (at least 5)."""
    return max(5, int(settings().max_examples * fraction))


# --- the memory every stream works on ------------------------------------------------------------
GUARD = 4096                 # bytes either side of a region's MR: no MR covers them, never change
REGION = 96 << 10            # an MR's length: a 64 KiB transfer plus room to move it around
BUF = GUARD + REGION + GUARD
ATOMIC_ZONE = 64             # the first 8 words of each remote region start as small big-endian
                             # numbers, so that compare-swaps hit as often as they miss
MAX_MSG = 64 << 10
POLL_TIMEOUT_S = 20.0        # no progress for this long = a hung engine: fail, never hang


@dataclass
class PairMemory:
    """The buffers and MRs of one QP pair: the requester's local buffer, the responder's buffer."""
    req: str                  # node of the requester ("A" or "B")
    resp: str
    local: np.ndarray         # BUF bytes on the requester's NIC
    remote: np.ndarray        # BUF bytes on the responder's NIC
    l_mr: object = None       # Access.ALL over local[GUARD:GUARD+REGION]
    l_nolw: object = None     # no LOCAL_WRITE, over the first quarter of the local region
    r_mr: object = None       # Access.ALL over remote[GUARD:GUARD+REGION]
    r_ro: object = None       # REMOTE_READ only, over the second half of the remote region
    l_pd2: object = None      # the local region again, in another PD (the QP's PD does not match)
    r_pd2: object = None
    stale_lkey: int = 0       # keys of MRs registered and deregistered (a bad key that once was)
    stale_rkey: int = 0

    @property
    def l_base(self):
        return self.l_mr.addr

    @property
    def r_base(self):
        return self.r_mr.addr


class Channel:
    """A connected QP pair reused across examples (until an error moves it to ERR).

    Keeps the producer index, the WQEs not yet known complete and the CQs' consumer state, so a
    stream continues where the previous example left the rings (wrapping them many times).
    """

    def __init__(self, world, pair, depth, max_inline, collapsed):
        self.pair = pair
        req, resp = world.nics[pair.req], world.nics[pair.resp]
        self.req_nic, self.resp_nic = req, resp
        self.depth, self.max_inline, self.collapsed = depth, max_inline, collapsed
        # owner-bit send CQ exactly as deep as the ring: the driver keeps at most `depth` WQEs
        # outstanding, so the NIC may never overrun it (the tightest legal CQ)
        self.scq = req.create_cq(depth, collapsed=collapsed)
        self.rcq = resp.create_cq(RECV_CQ_CNT)
        self.qp = req.create_qp(self.scq, sq_wqebbs=depth, max_inline=max_inline)
        self.rqp = resp.create_qp(self.rcq)
        req.connect(self.qp, self.rqp.info())
        resp.connect(self.rqp, self.qp.info())
        self.pi = 0
        self.done_pi = 0                      # every WQEBB below it has completed
        self.outstanding = []                 # [(pi, nbb)] posted, not known complete
        self.s_ci = 0
        self.r_ci = 0
        self.recv_count = 0
        self.last_collapsed = None            # (op_own, wqe_counter) last seen in the slot
        self.out = np.zeros(64 * mlx5.CQE_SIZE, dtype=np.uint8)
        self.dead = False

    def advance_to(self, target_pi):
        """Post NOPs (half a ring per doorbell, the last one signalled) until pi == target_pi,
        to bring the 16-bit WQE counter's wrap near; a numba loop, ~65k NOPs in a few ms."""
        q, cq = self.qp, self.scq
        ci = _nop_warmup(q.sq_addr, self.depth, q.qpn, q.dbrec_addr, q.db_addr, cq.buf_addr,
                         cq.cqe_cnt, cq.dbrec_addr, self.collapsed, self.pi, target_pi, self.s_ci)
        assert ci >= 0, "NOP warm-up: no CQE (engine stalled?)"
        self.s_ci = ci
        self.pi = self.done_pi = target_pi
        if self.collapsed:                  # the slot now holds the last warm-up NOP's CQE
            op_own = wq.poll_cq_collapsed(cq.buf_addr, self.out)
            self.last_collapsed = (int(op_own), wq.decode_cqe(self.out[:64]).wqe_counter)

    def ring(self, last_wqe_pi):
        wq.ring_doorbell(self.qp.sq_addr, self.depth, self.qp.dbrec_addr, self.qp.db_addr,
                         self.pi, last_wqe_pi)

    def _completed(self, counter):
        for k, (start, nbb) in enumerate(self.outstanding):
            if start & 0xFFFF == counter:
                del self.outstanding[:k + 1]
                self.done_pi = start + nbb
                return
        raise AssertionError("CQE for WQE %d, which is not outstanding (%s)"
                             % (counter, self.outstanding[:8]))

    def poll_send(self):
        """New requester CQEs (decoded); frees the ring space they complete."""
        cq = self.scq
        if self.collapsed:
            op_own = wq.poll_cq_collapsed(cq.buf_addr, self.out)
            if (op_own >> 4) == mlx5.CQE_INVALID:
                return []
            c = wq.decode_cqe(self.out[:64])
            key = (int(op_own), c.wqe_counter)
            if key == self.last_collapsed:
                return []
            self.last_collapsed = key
            got = [c]
        else:
            n = wq.poll_cq(cq.buf_addr, cq.cqe_cnt, cq.dbrec_addr, self.s_ci, self.out, 64)
            self.s_ci += n
            got = [wq.decode_cqe(self.out[i * 64:(i + 1) * 64]) for i in range(n)]
        for c in got:
            self._completed(c.wqe_counter)
        return got

    def poll_recv(self):
        cq = self.rcq
        n = wq.poll_cq(cq.buf_addr, cq.cqe_cnt, cq.dbrec_addr, self.r_ci, self.out, 64)
        self.r_ci += n
        return [wq.decode_cqe(self.out[i * 64:(i + 1) * 64]) for i in range(n)]


@njit(cache=True, nogil=True)
def _nop_warmup(sq_addr, depth, qpn, dbrec_addr, db_addr, cq_addr, cqe_cnt, cq_dbrec, collapsed,
                pi, target, ci):
    """Post NOPs from ``pi`` to ``target``, half a ring per doorbell, waiting on each batch's
    signalled CQE. Returns the CQ's new consumer index, or -1 if a CQE never came."""
    half = depth // 2
    out = np.zeros(mlx5.CQE_SIZE, dtype=np.uint8)
    while pi < target:
        n = min(half, target - pi)
        for k in range(n):
            fm = mlx5.WQE_CTRL_CQ_UPDATE if k == n - 1 else 0
            wq.post_nop(sq_addr, depth, pi + k, qpn, fm)
        last = pi + n - 1
        pi += n
        wq.ring_doorbell(sq_addr, depth, dbrec_addr, db_addr, pi, last)
        spins = 0
        while True:
            if collapsed:
                w = load_acquire_u32(cq_addr + 60)          # wqe_counter (BE) .. op_own
                counter = ((w & np.uint32(0xFF)) << np.uint32(8)) \
                    | ((w >> np.uint32(8)) & np.uint32(0xFF))
                if (w >> np.uint32(28)) != mlx5.CQE_INVALID and counter == (last & 0xFFFF):
                    break
            elif wq.poll_cq(cq_addr, cqe_cnt, cq_dbrec, ci, out, 1) == 1:
                ci += 1
                break
            spins += 1
            if spins > 2_000_000_000:
                return -1
    return ci


RECV_CQ_CNT = 1024           # responder CQEs (WRITE_WITH_IMM) of one stream stay far below this


class World:
    """Two soft NICs and the buffers of two QP pairs: pair 0 from A to B, pair 1 from B to A."""

    # the QP / CQ tables hold 1024 entries; renew the NICs well before a long soak fills them
    MAX_CHANNELS = 300

    def __init__(self):
        self.nics = {}
        self.pairs = []
        self.channels = {}
        self.created = 0
        self._open()

    def _open(self):
        # big-endian atomics here (the reference model runs in that order); the contention tests
        # below and tests/test_signal_endian.py cover the native default
        self.nics = {n: SoftNic(profile="nvidia", arena_bytes=256 << 20, name=None,
                                atomic_endianness="big")
                     for n in ("A", "B")}
        self.pairs = [self._pair("A", "B"), self._pair("B", "A")]
        self.channels = {}
        self.created = 0

    def _pair(self, req, resp):
        a, b = self.nics[req], self.nics[resp]
        p = PairMemory(req, resp, a.alloc(BUF, 4096), b.alloc(BUF, 4096))
        lreg, rreg = p.local[GUARD:GUARD + REGION], p.remote[GUARD:GUARD + REGION]
        p.l_mr = a.reg_mr(lreg, access=Access.ALL)
        p.l_nolw = a.reg_mr(lreg[:REGION // 4],
                            access=Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC)
        p.r_mr = b.reg_mr(rreg, access=Access.ALL)
        p.r_ro = b.reg_mr(rreg[REGION // 2:], access=Access.REMOTE_READ | Access.LOCAL_WRITE)
        p.l_pd2 = a.reg_mr(lreg, access=Access.ALL, pd=a.alloc_pd())
        p.r_pd2 = b.reg_mr(rreg, access=Access.ALL, pd=b.alloc_pd())
        gone = a.reg_mr(lreg, access=Access.ALL)
        p.stale_lkey = gone.lkey
        a.dereg_mr(gone)
        gone = b.reg_mr(rreg, access=Access.ALL)
        p.stale_rkey = gone.rkey
        b.dereg_mr(gone)
        return p

    def channel(self, pair_idx, depth, max_inline, collapsed, near_wrap):
        key = (pair_idx, depth, max_inline, collapsed, near_wrap)
        ch = self.channels.get(key)
        if ch is None or ch.dead:
            ch = Channel(self, self.pairs[pair_idx], depth, max_inline, collapsed)
            self.created += 1
            if near_wrap:
                ch.advance_to(0x10000 - 3 * depth // 2)
            self.channels[key] = ch
        return ch

    def renew_if_full(self, need):
        """Reopen the NICs (new tables) if ``need`` more channels could pass MAX_CHANNELS; only
        between examples, never while a channel of the old NICs is in use."""
        if self.created + need > self.MAX_CHANNELS:
            self.close()
            self._open()

    def model_mrs(self, model, pair):
        """Every MR of the pair's two nodes the keys in a stream may name (pd 0 = the QPs' PD)."""
        for node, mrs in ((pair.req, (pair.l_mr, pair.l_nolw, pair.l_pd2)),
                          (pair.resp, (pair.r_mr, pair.r_ro, pair.r_pd2))):
            for mr in mrs:
                model.add_mr(node, mr.addr, mr.length, mr.lkey, mr.rkey, int(mr.access),
                             pd=0 if mr.pd is self.nics[node].default_pd else mr.pd.pdn)

    def close(self):
        for n in self.nics.values():
            n.close()


@pytest.fixture(scope="module")
def world():
    w = World()
    yield w
    w.close()


# --- what a stream is made of --------------------------------------------------------------------
BOUNDARY_SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 127, 128, 129, 4095, 4096, 4097,
                  65535, MAX_MSG]
# inline payloads that exactly fill / just spill a WQEBB: 32 + 4 + n bytes in 16-byte units
INLINE_BOUNDARIES = [0, 1, 12, 28, 29, 44, 92, 93, 156, 157, 220, 221, 256]

OPCODES = ([mlx5.OPCODE_RDMA_WRITE] * 3 + ["INLINE"] * 2 + [mlx5.OPCODE_RDMA_WRITE_IMM] * 2
           + [mlx5.OPCODE_RDMA_READ] * 2 + [mlx5.OPCODE_ATOMIC_FA, mlx5.OPCODE_ATOMIC_CS,
                                            mlx5.OPCODE_NOP])
# the faults a WQE may carry (None mostly); each applies only to WQEs it can break
FAULTS = ["bad_lkey", "bad_rkey", "pd_lkey", "pd_rkey", "oob_local_end", "oob_local_start",
          "oob_remote_end", "oob_remote_start", "ro_remote", "nolw_local", "misaligned_atomic"]

sizes = st.one_of(st.sampled_from(BOUNDARY_SIZES), st.integers(0, 256), st.integers(0, MAX_MSG))


def offsets(n, limit):
    """A byte offset in [0, limit - n]: the ends of the region or anywhere."""
    hi = limit - n
    return st.one_of(st.just(0), st.just(hi), st.integers(0, hi))


@st.composite
def abstract_ops(draw, max_inline, fault_rate):
    """One operation, with offsets relative to the pair's regions (made concrete per example)."""
    kind = draw(st.sampled_from(OPCODES))
    d = {"kind": kind, "signaled": draw(st.booleans()), "fence": draw(st.integers(0, 4)) == 0,
         "fault": None}
    if kind == "INLINE":
        n = draw(st.one_of(st.sampled_from([x for x in INLINE_BOUNDARIES if x <= max_inline]),
                           st.integers(0, max_inline)))
        d.update(n=n, roff=draw(offsets(n, REGION)), seed=draw(st.integers(0, 2**32 - 1)),
                 imm=draw(st.one_of(st.none(), st.integers(0, 2**32 - 1))))
    elif kind in (mlx5.OPCODE_ATOMIC_FA, mlx5.OPCODE_ATOMIC_CS):
        d.update(n=8, loff=draw(offsets(8, REGION)),
                 roff=draw(st.one_of(st.integers(0, ATOMIC_ZONE // 8 - 1),
                                     st.integers(0, REGION // 8 - 1))) * 8,
                 swap_add=draw(st.one_of(st.integers(0, 3), st.integers(0, 2**64 - 1))),
                 compare=draw(st.one_of(st.integers(0, 3), st.integers(0, 2**64 - 1))))
    elif kind == mlx5.OPCODE_NOP:
        d.update(n=0)
    else:
        n = draw(sizes)
        d.update(n=n, loff=draw(offsets(n, REGION)), roff=draw(offsets(n, REGION)),
                 imm=draw(st.integers(0, 2**32 - 1)))
    if d["n"] > 0 and kind != mlx5.OPCODE_NOP and draw(st.integers(0, 999)) < fault_rate:
        d["fault"] = draw(st.sampled_from(FAULTS))
    return d


def concrete(d, pair):
    """The ref.Op of an abstract op on this pair's memory, with its fault applied (or not)."""
    kind, n, fault = d["kind"], d["n"], d["fault"]
    lkey, rkey = pair.l_mr.lkey, pair.r_mr.rkey
    laddr = pair.l_base + d.get("loff", 0)
    raddr = pair.r_base + d.get("roff", 0)
    inline = None
    has_local = kind not in ("INLINE", mlx5.OPCODE_NOP)
    writes_local = kind in (mlx5.OPCODE_RDMA_READ, mlx5.OPCODE_ATOMIC_FA, mlx5.OPCODE_ATOMIC_CS)
    writes_remote = kind not in (mlx5.OPCODE_RDMA_READ, mlx5.OPCODE_NOP)
    atomic = kind in (mlx5.OPCODE_ATOMIC_FA, mlx5.OPCODE_ATOMIC_CS)
    if fault == "bad_lkey" and has_local:
        lkey = pair.stale_lkey
    elif fault == "pd_lkey" and has_local:
        lkey = pair.l_pd2.lkey
    elif fault == "bad_rkey":
        rkey = pair.stale_rkey
    elif fault == "pd_rkey":
        rkey = pair.r_pd2.rkey
    elif fault == "oob_local_end" and has_local:
        laddr = pair.l_base + REGION - n + 1 + d.get("loff", 0) % max(1, min(n, 64))
    elif fault == "oob_local_start" and has_local:
        laddr = pair.l_base - 1 - d.get("loff", 0) % 64
    elif fault == "oob_remote_end":
        raddr = pair.r_base + REGION - n + 8 * (1 + d.get("roff", 0) % 8) if atomic else \
            pair.r_base + REGION - n + 1 + d.get("roff", 0) % max(1, min(n, 64))
    elif fault == "oob_remote_start":
        raddr = pair.r_base - 8 * (1 + d.get("roff", 0) % 8) if atomic else \
            pair.r_base - 1 - d.get("roff", 0) % 64
    elif fault == "ro_remote" and writes_remote:
        rkey = pair.r_ro.rkey
        raddr = pair.r_ro.addr + (d.get("roff", 0) % max(1, REGION // 2 - n + 1) & ~7)
    elif fault == "nolw_local" and writes_local:
        lkey = pair.l_nolw.lkey
        laddr = pair.l_nolw.addr + d.get("loff", 0) % max(1, REGION // 4 - n + 1)
    elif fault == "misaligned_atomic" and atomic:
        raddr += 1 + d["roff"] % 7
    if kind == "INLINE":
        inline = random.Random(d["seed"]).randbytes(n)
        opcode = mlx5.OPCODE_RDMA_WRITE if d["imm"] is None else mlx5.OPCODE_RDMA_WRITE_IMM
        return ref.Op(opcode, n, raddr=raddr, rkey=rkey, inline=inline, signaled=d["signaled"],
                      fence=d["fence"], imm=0 if d["imm"] is None else _be32(d["imm"]))
    if atomic:
        return ref.Op(kind, 8, laddr, lkey, raddr, rkey, signaled=d["signaled"], fence=d["fence"],
                      swap_add=d["swap_add"], compare=d["compare"])
    if kind == mlx5.OPCODE_NOP:
        return ref.Op(kind, signaled=d["signaled"], fence=d["fence"])
    return ref.Op(kind, n, laddr, lkey, raddr, rkey, signaled=d["signaled"], fence=d["fence"],
                  imm=_be32(d["imm"]) if kind == mlx5.OPCODE_RDMA_WRITE_IMM else 0)


def _be32(v):
    """The ctrl segment's imm word that carries immediate ``v`` (stored big-endian)."""
    return int.from_bytes(int(v).to_bytes(4, "big"), "little")


@st.composite
def pair_plans(draw, pair_idx):
    """One QP pair's part of an example: its ring, CQ mode, doorbell batching and stream."""
    depth = draw(st.sampled_from([8, 8, 16, 32, 64, 256]))
    max_inline = draw(st.sampled_from([64, 256]))
    collapsed = draw(st.booleans())
    near_wrap = draw(st.integers(0, 9)) == 0
    fault_rate = draw(st.sampled_from([0, 0, 15, 60]))       # per mille, per WQE
    n_ops = draw(st.one_of(st.integers(1, 12), st.integers(1, 3 * depth if depth < 64 else 48)))
    ops = draw(st.lists(abstract_ops(max_inline, fault_rate), min_size=n_ops, max_size=n_ops))
    batch = draw(st.sampled_from([1, 2, 3, 7, 1 << 30]))     # WQEs per doorbell (at most)
    return dict(pair=pair_idx, depth=depth, max_inline=max_inline, collapsed=collapsed,
                near_wrap=near_wrap, ops=ops, batch=batch)


# --- running a plan on the NIC -----------------------------------------------------------------
def _post(ch, op, pi):
    """Build ``op`` (a ref.Op) at WQE index ``pi`` of the channel's ring. Returns WQEBBs."""
    q = ch.qp
    fm = (mlx5.WQE_CTRL_CQ_UPDATE if op.signaled else 0) | (mlx5.WQE_CTRL_FENCE if op.fence else 0)
    if op.opcode == mlx5.OPCODE_NOP:
        return wq.post_nop(q.sq_addr, ch.depth, pi, q.qpn, fm)
    if op.opcode in ref.ATOMIC_OPCODES:
        return wq.post_atomic(q.sq_addr, ch.depth, pi, q.qpn, op.opcode, fm, op.raddr, op.rkey,
                              op.laddr, op.lkey, np.uint64(op.swap_add), np.uint64(op.compare))
    if op.inline is not None:
        data = np.frombuffer(op.inline, dtype=np.uint8)
        return wq.post_write_inline(q.sq_addr, ch.depth, pi, q.qpn, op.opcode, fm, op.raddr,
                                    op.rkey, data.ctypes.data if len(data) else 0, len(data),
                                    op.imm)
    return wq.post_rdma(q.sq_addr, ch.depth, pi, q.qpn, op.opcode, fm, op.raddr, op.rkey,
                        op.laddr, op.lkey, op.nbytes, op.imm)


@dataclass
class Run:
    ch: Channel
    ops: list
    batch: int
    next: int = 0
    since_db: int = 0
    last_wqe: int = -1
    end_pi: int = 0
    send: list = field(default_factory=list)
    recv: list = field(default_factory=list)


def drive(runs):
    """Post every run's stream, interleaved, keeping at most ring-depth WQEBBs outstanding per QP;
    ring each doorbell after ``batch`` WQEs or when the ring is full; collect every CQE."""
    for r in runs:
        r.end_pi = r.ch.pi + sum(ref.wqebbs(op) for op in r.ops)
    last_progress = time.monotonic()
    spins = 0
    while True:
        progress = False
        for r in runs:
            ch = r.ch
            while r.next < len(r.ops):
                op = r.ops[r.next]
                nbb = ref.wqebbs(op)
                if ch.pi + nbb - ch.done_pi > ch.depth:
                    break
                used = _post(ch, op, ch.pi)
                assert used == nbb, (used, nbb, op)
                ch.outstanding.append((ch.pi, nbb))
                r.last_wqe = ch.pi
                ch.pi += nbb
                r.next += 1
                r.since_db += 1
                if r.since_db >= r.batch:
                    ch.ring(r.last_wqe)
                    r.since_db = 0
            if r.since_db:
                ch.ring(r.last_wqe)
                r.since_db = 0
            got = ch.poll_send()
            got_r = ch.poll_recv()
            if got or got_r:
                progress = True
                r.send += got
                r.recv += got_r
        if all(r.ch.done_pi >= r.end_pi for r in runs):
            break
        now = time.monotonic()
        if progress:
            last_progress, spins = now, 0
        else:
            spins += 1
            if spins > 100:
                time.sleep(50e-6)
            if now - last_progress > POLL_TIMEOUT_S:
                raise AssertionError("no completion for %.0f s: %s" % (POLL_TIMEOUT_S, [
                    (r.ch.qp.qpn, r.ch.pi, r.ch.done_pi, r.ch.req_nic.qp_sq_ci(r.ch.qp),
                     r.ch.req_nic.qp_state(r.ch.qp), r.ch.req_nic.stats()) for r in runs]))


def _cqe_key(c):
    err = c.opcode in (mlx5.CQE_REQ_ERR, mlx5.CQE_RESP_ERR)
    return (c.opcode, c.qpn, c.wqe_counter, c.syndrome if err else 0,
            0 if err else c.byte_cnt, c.imm_raw if c.opcode == mlx5.CQE_RESP_WR_IMM else 0,
            c.wqe_opcode if err else 0)


def _model_key(c):
    err = c.opcode in (mlx5.CQE_REQ_ERR, mlx5.CQE_RESP_ERR)
    return (c.opcode, c.qpn, c.wqe_counter, c.syndrome, 0 if err else c.byte_cnt,
            c.imm if c.opcode == mlx5.CQE_RESP_WR_IMM else 0, c.wqe_opcode if err else 0)


def _is_subsequence(seen, full):
    it = iter(full)
    return all(any(s == f for f in it) for s in seen)


def _describe(model_result):
    return "\n".join("  %s wqe %5d  %-40s %s" % (q, i, op.describe(), out)
                     for q, i, op, out in model_result.trace)


def run_plans(world, plans, seed):
    """Execute the plans on the NICs and on the model; assert they agree."""
    runs, model = [], ref.ReferenceModel(atomic_byteorder="big")
    rng = np.random.default_rng(seed)
    streams = {}
    used_pairs = set()
    world.renew_if_full(len(plans))
    for plan in plans:
        if plan["pair"] in used_pairs:
            continue
        used_pairs.add(plan["pair"])
        pair = world.pairs[plan["pair"]]
        ch = world.channel(plan["pair"], plan["depth"], plan["max_inline"], plan["collapsed"],
                           plan["near_wrap"])
        # fresh memory: random bytes (a misdirected byte shows), small words in the atomic zone
        pair.local[:] = rng.integers(0, 256, BUF, dtype=np.uint8)
        pair.remote[:] = rng.integers(0, 256, BUF, dtype=np.uint8)
        zone = pair.remote[GUARD:GUARD + ATOMIC_ZONE].view(">u8")
        zone[:] = rng.integers(0, 4, ATOMIC_ZONE // 8)
        model.add_buffer(pair.req, pair.local.ctypes.data, pair.local.tobytes())
        model.add_buffer(pair.resp, pair.remote.ctypes.data, pair.remote.tobytes())
        world.model_mrs(model, pair)
        name = "pair%d" % plan["pair"]
        model.add_qp(name, node=pair.req, qpn=ch.qp.qpn, peer=name + "r", send_cq=name + ".scq",
                     sq_wqebbs=ch.depth, max_inline=ch.max_inline, start_pi=ch.pi)
        model.add_qp(name + "r", node=pair.resp, qpn=ch.rqp.qpn, peer=name,
                     send_cq=name + ".rcq", start_recv_count=ch.recv_count)
        ops = ref.signal_for_progress([concrete(d, pair) for d in plan["ops"]], ch.depth)
        streams[name] = ops
        runs.append(Run(ch, ops, plan["batch"]))
    expect = model.run(streams)
    note("model trace:\n" + _describe(expect))
    drive(runs)
    # the responder CQEs of the last WRITE_WITH_IMMs are written before the requester's CQE
    # (in order, synchronous engine), but give a slow poll a moment anyway
    for r, name in zip(runs, streams):
        want = expect.cqes.get(name + ".rcq", [])
        deadline = time.monotonic() + 2.0
        while len(r.recv) < len(want) and time.monotonic() < deadline:
            r.recv += r.ch.poll_recv()
    for r, name in zip(runs, streams):
        ch, pair = r.ch, r.ch.pair
        got_s = [_cqe_key(c) for c in r.send]
        want_s = [_model_key(c) for c in expect.cqes.get(name + ".scq", [])]
        if ch.collapsed:
            # while CQEs arrive only (opcode, wqe_counter) of the slot is one atomic snapshot;
            # once the QP is quiet the whole slot must be the model's last CQE
            seen = [(k[0], k[2]) for k in got_s]
            assert _is_subsequence(seen, [(k[0], k[2]) for k in want_s]), (got_s, want_s)
            assert _cqe_key(wq.decode_cqe(ch.scq.buf[:64])) == want_s[-1], (got_s, want_s)
        else:
            assert got_s == want_s
        got_r = [_cqe_key(c) for c in r.recv]
        want_r = [_model_key(c) for c in expect.cqes.get(name + ".rcq", [])]
        assert got_r == want_r
        ch.recv_count += len(got_r)
        for buf, node in ((pair.local, pair.req), (pair.remote, pair.resp)):
            want = np.frombuffer(expect.memory[(node, buf.ctypes.data)], dtype=np.uint8)
            bad = np.flatnonzero(buf != want)
            assert bad.size == 0, ("%s buffer of %s differs at %d bytes, first at offset %d "
                                   "(region starts at %d): nic %r model %r" % (
                                       "local" if buf is pair.local else "remote", name, bad.size,
                                       bad[0], GUARD, bytes(buf[bad[0]:bad[0] + 8]),
                                       bytes(want[bad[0]:bad[0] + 8])))
        state = ch.req_nic.qp_state(ch.qp)
        assert state == ("ERR" if expect.qp_error[name] else "RTS"), state
        assert ch.resp_nic.qp_state(ch.rqp) == "RTS"
        if expect.qp_error[name]:
            ch.dead = True


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], deadline=None,
          max_examples=_examples(2.0))
@given(plans=st.lists(st.one_of(pair_plans(0), pair_plans(1)), min_size=1, max_size=2),
       seed=st.integers(0, 2**32 - 1))
def test_random_streams_match_reference_model(world, plans, seed):
    """Random WQE streams on one or two QP pairs leave exactly the model's memory and CQEs.

    Generates, per QP pair (A->B and B->A on one NIC pair): ring depth 8..256 (streams up to three
    rings long, posted in chunks that only reuse WQEBBs whose completion a CQE reported, a
    doorbell every 1, 2, 3, 7 WQEs or per chunk), max_inline 64 or 256, an owner-bit or a
    collapsed CQ, sometimes a producer index just below the 16-bit wrap, and WQEs of every
    opcode (WRITE, inline WRITE, WRITE_WITH_IMM, READ, ATOMIC_FA, ATOMIC_CS, NOP) with sizes
    0..64 KiB, random signalling and FENCE, and now and then a protection fault (stale or
    foreign-PD key, out of bounds at either end, read-only remote, no LOCAL_WRITE, misaligned
    atomic).

    Invariant: every byte of both buffers (guards outside the MRs included) equals the model's;
    an owner-bit CQ holds exactly the model's CQEs in order (a successful WQE has a CQE iff it is
    signalled; the first fault gives its syndrome, every later WQE a 0x05 flush, signalled or
    not); a collapsed CQ shows a subsequence of them ending with the model's last; the responder's
    CQ holds the WRITE_WITH_IMM CQEs (imm, byte count, counter); the requester QP is in ERR iff
    the model faulted, and the responder QP stays RTS.
    """
    run_plans(world, plans, seed)


# --- atomics under contention --------------------------------------------------------------------
N_FA = 1500                  # fetch-adds per QP (unsignalled; the SendQueue signals as it must)
N_CAS = 60                   # successful CAS-increments per QP (each a round trip, with retries)


def _hammer(sq, cq, mr, laddr_base, raddr, rkey, n_fa, n_cas):
    """On one QP: ``n_fa`` fetch-add(+1) whose old values land at laddr_base + 8*i, then a
    CAS-increment loop until ``n_cas`` CASes succeeded. Returns the old values of every operation
    that incremented the word (fetch-adds and successful CASes)."""
    for i in range(n_fa):
        sq.post_atomic_fa(laddr_base + 8 * i, mr.lkey, raddr, rkey, 1, doorbell=(i % 16 == 15))
    sq.quiet(timeout=60)
    cq.poll(1 << 20)                                        # drop the forced CQEs
    olds = list(_native_words(laddr_base, n_fa))
    guess, ok = 0, 0
    slot = laddr_base + 8 * n_fa
    while ok < n_cas:
        sq.post_atomic_cs(slot, mr.lkey, raddr, rkey, guess, guess + 1, signaled=True)
        sq.quiet(timeout=60)
        cq.poll(1 << 20)
        old = next(_native_words(slot, 1))
        if old == guess:
            olds.append(old)
            ok += 1
            guess += 1
        else:
            guess = old
    return olds


def _native_words(addr, n):
    """The soft NIC's default atomic order: native (SoftNic(atomic_endianness="host"))."""
    raw = bytes((ctypes.c_uint8 * (8 * n)).from_address(addr))
    return (int.from_bytes(raw[8 * i:8 * i + 8], sys.byteorder) for i in range(n))


def _initiator_qps(nic, target, k, depth=64):
    """``k`` QPs of ``nic`` connected to responder QPs of ``target``; a result buffer each."""
    out = []
    for _ in range(k):
        cq = nic.create_cq(depth)
        qp = nic.create_qp(cq, sq_wqebbs=depth)
        tcq = target.create_cq(64)
        tqp = target.create_qp(tcq)
        nic.connect(qp, tqp.info())
        target.connect(tqp, qp.info())
        buf = nic.alloc(8 * (N_FA + 1))
        mr = nic.reg_mr(buf)
        out.append((wq.SendQueue(qp), wq.CompletionQueue(cq), mr))
    return out


def test_atomics_exact_under_contention_in_one_process():
    """Eight QPs on two NICs (four each, so two engine threads race) hammer one remote word with
    fetch-add(+1) and CAS-increment loops at the same time.

    Invariant: the word ends at exactly (fetch-adds + successful CASes), and the old values of all
    the operations that incremented it are exactly 0 .. total-1, each once (no lost or doubled
    update, no torn read)."""
    with SoftNic() as target, SoftNic() as a, SoftNic() as b:
        word = target.alloc(64)
        wmr = target.reg_mr(word)
        qps = _initiator_qps(a, target, 4) + _initiator_qps(b, target, 4)
        results = [None] * len(qps)
        errors = []

        def worker(i):
            sq, cq, mr = qps[i]
            try:
                results[i] = _hammer(sq, cq, mr, mr.addr, wmr.addr, wmr.rkey, N_FA, N_CAS)
            except BaseException as e:           # noqa: BLE001 - reported below
                errors.append(e)

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(len(qps))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not errors, errors
        total = len(qps) * (N_FA + N_CAS)
        assert int(word[:8].view("=u8")[0]) == total
        olds = sorted(x for r in results for x in r)
        assert olds == list(range(total))


def _atomic_child(target_infos, raddr, rkey, n_fa, n_cas, conn):
    """Child process: its own NIC, one QP per target responder QP, the same hammer loops."""
    with SoftNic() as nic:
        qps = []
        for info in target_infos:
            cq = nic.create_cq(64)
            qp = nic.create_qp(cq, sq_wqebbs=64)
            nic.connect(qp, info)
            buf = nic.alloc(8 * (n_fa + 1))
            qps.append((wq.SendQueue(qp), wq.CompletionQueue(cq), nic.reg_mr(buf), qp))
        conn.send([q[3].info() for q in qps])
        assert conn.recv() == "go"
        olds = []
        for sq, cq, mr, _ in qps:        # one after another: the parent's QPs race with them
            olds += _hammer(sq, cq, mr, mr.addr, raddr, rkey, n_fa, n_cas)
        conn.send(olds)
        conn.recv()                      # keep the NIC (and its arena) until the parent is done


def test_atomics_exact_across_two_processes():
    """A spawned process (its own NIC, two QPs) and this process (another NIC, two QPs) hammer
    one word in a third NIC's arena with fetch-adds and CAS-increments; the target's arena is
    named through ``qp.info()``.

    Invariant: the final value is exact and the incrementing operations' old values are
    0 .. total-1, each once: the NICs' atomics are atomic across processes."""
    ctx = multiprocessing.get_context("spawn")
    with SoftNic() as target, SoftNic() as a:
        word = target.alloc(64)
        wmr = target.reg_mr(word)
        tqps = []
        for _ in range(2):
            tcq = target.create_cq(64)
            tqps.append(target.create_qp(tcq))
        parent_conn, child_conn = ctx.Pipe()
        n_fa, n_cas = N_FA, N_CAS // 2
        p = ctx.Process(target=_atomic_child,
                        args=([q.info() for q in tqps], wmr.addr, wmr.rkey, n_fa, n_cas,
                              child_conn))
        p.start()
        try:
            assert parent_conn.poll(120), "child did not start"
            child_infos = parent_conn.recv()
            for tqp, info in zip(tqps, child_infos):
                target.connect(tqp, info)
            mine = _initiator_qps(a, target, 2)
            parent_conn.send("go")
            olds = []
            for sq, cq, mr in mine:
                olds += _hammer(sq, cq, mr, mr.addr, wmr.addr, wmr.rkey, n_fa, n_cas)
            assert parent_conn.poll(120), "child did not finish"
            olds += parent_conn.recv()
            parent_conn.send("done")
        finally:
            p.join(30)
            if p.is_alive():
                p.kill()
        assert p.exitcode == 0
        total = 4 * (n_fa + n_cas)
        assert int(word[:8].view("=u8")[0]) == total
        assert sorted(olds) == list(range(total))


def test_read_after_write_and_fence_on_one_qp(world):
    """On one QP: a READ posted right after a WRITE to the same remote bytes returns the written
    bytes; a FENCEd WRITE whose source is the local buffer a READ (or an atomic) just filled
    sends what the READ brought back. Repeated with fresh data, unsignalled except the last.

    Invariant: in-order execution per QP, and FENCE: nothing reads local memory that an earlier
    READ / atomic of the same QP has not finished writing."""
    a, b = world.nics["A"], world.nics["B"]
    cq = a.create_cq(256)
    qp = a.create_qp(cq, sq_wqebbs=256)
    rcq = b.create_cq(64)
    rqp = b.create_qp(rcq)
    a.connect(qp, rqp.info())
    b.connect(rqp, qp.info())
    sq, cqp = wq.SendQueue(qp), wq.CompletionQueue(cq)
    loc, rem = a.alloc(1 << 16), b.alloc(1 << 16)
    lmr, rmr = a.reg_mr(loc), b.reg_mr(rem)
    rng = np.random.default_rng(1)
    for it in range(20):
        n = int(rng.integers(1, 4096))
        loc[:] = rng.integers(0, 256, loc.size, dtype=np.uint8)
        rem[:] = rng.integers(0, 256, rem.size, dtype=np.uint8)
        src, back, relay = 0, 8192, 16384              # local offsets
        x, y = 0, 32768                                # remote offsets
        want = loc[src:src + n].copy()
        sq.post_write(lmr.addr + src, lmr.lkey, rmr.addr + x, rmr.rkey, n, doorbell=False)
        sq.post_read(lmr.addr + back, lmr.lkey, rmr.addr + x, rmr.rkey, n, doorbell=False)
        sq.post_write(lmr.addr + back, lmr.lkey, rmr.addr + y, rmr.rkey, n, fence=True,
                      doorbell=False)
        # an atomic's result relayed by a fenced WRITE
        old = int(rem[40000:40008].view(">u8")[0])
        sq.post_atomic_fa(lmr.addr + relay, lmr.lkey, rmr.addr + 40000, rmr.rkey, 7,
                          doorbell=False)
        sq.post_write(lmr.addr + relay, lmr.lkey, rmr.addr + 48000, rmr.rkey, 8, fence=True,
                      signaled=True)
        sq.quiet()
        got = cqp.poll(1 << 20)
        assert all(not c.error for c in got), got
        assert np.array_equal(loc[back:back + n], want)
        assert np.array_equal(rem[y:y + n], want)
        assert int(rem[48000:48008].view(">u8")[0]) == old
        assert int(rem[40000:40008].view(">u8")[0]) == (old + 7) & ref.MASK64


# --- the c500 coherence model ---------------------------------------------------------------
LINE = softnic.LINE_BYTES
COH_BUF = 16 << 10


class CoherencePair:
    """Two c500-profile NICs; on each, one MR of every kind over its own buffer (reused)."""

    def __init__(self, strict=False):
        self.s = SoftNic(profile="c500", strict=strict)
        self.r = SoftNic(profile="c500", strict=strict)
        cq_s, cq_r = self.s.create_cq(64), self.r.create_cq(64)
        self.qp = self.s.create_qp(cq_s, sq_wqebbs=64)
        self.rqp = self.r.create_qp(cq_r)
        self.s.connect(self.qp, self.rqp.info())
        self.r.connect(self.rqp, self.qp.info())
        self.sq, self.cq = wq.SendQueue(self.qp), wq.CompletionQueue(cq_s)
        self.mrs = {}
        for nic in (self.s, self.r):
            for kind in ("device", "finegrained", "host"):
                buf = nic.alloc(COH_BUF, 4096)
                self.mrs[nic, kind] = (buf, nic.reg_mr(buf, kind=kind))

    def settle(self, nic, kind, data):
        """Make ``data`` what both the SMs and the NIC see (SM stores, then evict every line)."""
        buf, mr = self.mrs[nic, kind]
        # evict first: a NIC write still hidden from the SMs would otherwise win over an SM
        # store of the very byte value the L2 line was filled with (the model tracks SM-dirty
        # bytes by comparing with what the line held when filled)
        nic.evict(mr)
        buf[:] = data
        nic.evict(mr)
        assert np.array_equal(buf, data)

    def write(self, src_kind, dst_kind, off, n, roff):
        """Post one signalled RDMA WRITE and wait for its CQE; returns the CQE."""
        _, smr = self.mrs[self.s, src_kind]
        _, rmr = self.mrs[self.r, dst_kind]
        self.sq.post_write(smr.addr + off, smr.lkey, rmr.addr + roff, rmr.rkey, n, signaled=True)
        (c,) = self.cq.wait(1)
        return c

    def close(self):
        self.s.close()
        self.r.close()


@pytest.fixture(scope="module")
def c500():
    p = CoherencePair()
    yield p
    p.close()


def _lines_of(off, n):
    return range(off // LINE, (off + n - 1) // LINE + 1)


@st.composite
def eviction_schedules(draw, nlines):
    """When the L2 lines of the payload are evicted: never, all before the NIC reads, all only
    after the CQE, or a random subset before."""
    kind = draw(st.sampled_from(["never", "before_post", "after_completion", "random_lines"]))
    lines = set()
    if kind == "random_lines":
        lines = set(draw(st.lists(st.integers(0, nlines - 1), unique=True, max_size=nlines)))
    return kind, lines


@st.composite
def payloads(draw):
    n = draw(st.one_of(st.integers(1, 3 * LINE), st.integers(1, COH_BUF // 2)))
    off = draw(st.integers(0, COH_BUF - n))
    roff = draw(st.integers(0, COH_BUF - n))
    return off, n, roff, draw(st.integers(0, 2**32 - 1))


def _old_and_new(seed):
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, COH_BUF, dtype=np.uint8)
    new = old ^ rng.integers(1, 256, COH_BUF, dtype=np.uint8)     # differs in every byte
    return old, new


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None,
          max_examples=_examples(0.6))
@given(src_kind=st.sampled_from(["device", "finegrained", "host"]), payload=payloads(),
       data=st.data())
def test_c500_send_side_stale_payload_unless_evicted(c500, src_kind, payload, data):
    """SM code writes a payload into a send buffer, then a WRITE carries it to the peer; hypothesis
    picks when the payload's L2 lines are evicted (never / before the post / after the CQE /
    random lines before the post).

    Invariant: the CQE is always a success. From `finegrained` or `host` memory the receiver gets
    the new payload whatever the schedule. From `device` memory a byte arrives new exactly when
    its line was evicted between the SM store and the NIC's read, old otherwise: with no eviction
    the receiver sees only old bytes behind a successful CQE (the seed's C500 report)."""
    off, n, roff, seed = payload
    old, new = _old_and_new(seed)
    lines = list(_lines_of(off, n))
    sched, chosen = data.draw(eviction_schedules(len(lines)), label="eviction")
    c500.settle(c500.s, src_kind, old)
    c500.settle(c500.r, "host", np.zeros(COH_BUF, np.uint8))
    sbuf, smr = c500.mrs[c500.s, src_kind]
    sbuf[off:off + n] = new[off:off + n]                                 # the SM's stores
    fresh = np.zeros(COH_BUF, bool)
    evicted = set(range(len(lines))) if sched == "before_post" else chosen
    for i in sorted(evicted):
        line = lines[i]
        c500.s.evict(smr, line * LINE, min(LINE, COH_BUF - line * LINE))
        fresh[line * LINE:(line + 1) * LINE] = True
    c = c500.write(src_kind, "host", off, n, roff)
    if sched == "after_completion":
        c500.s.evict(smr)                                               # too late for this WRITE
    assert not c.error and c.byte_cnt == n, c
    got = c500.mrs[c500.r, "host"][0][roff:roff + n]
    if src_kind != "device":
        assert np.array_equal(got, new[off:off + n])
        return
    want = np.where(fresh[off:off + n], new[off:off + n], old[off:off + n])
    assert np.array_equal(got, want)
    if sched in ("never", "after_completion"):
        assert np.array_equal(got, old[off:off + n])                    # the seed's bug


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None,
          max_examples=_examples(0.6))
@given(dst_kind=st.sampled_from(["device", "finegrained", "host"]), payload=payloads(),
       data=st.data())
def test_c500_receive_side_invisible_until_evicted(c500, dst_kind, payload, data):
    """The NIC WRITEs a payload into the receiver's buffer; the receiver's SM code reads it after
    the CQE; hypothesis picks which of the buffer's lines are evicted after the CQE (none, all,
    random lines).

    Invariant: into `finegrained` or `host` memory the reader sees the payload right after the
    CQE. Into `device` memory a byte is new exactly when its line was evicted after the NIC's
    write, old (what the L2 still holds) otherwise."""
    roff, n, off, seed = payload
    old, new = _old_and_new(seed)
    lines = list(_lines_of(roff, n))
    sched = data.draw(st.sampled_from(["never", "all", "random_lines"]), label="eviction")
    chosen = set(range(len(lines))) if sched == "all" else set()
    if sched == "random_lines":
        chosen = set(data.draw(st.lists(st.integers(0, len(lines) - 1), unique=True),
                               label="lines"))
    c500.settle(c500.s, "host", new)
    c500.settle(c500.r, dst_kind, old)
    c = c500.write("host", dst_kind, off, n, roff)
    assert not c.error, c
    rbuf, rmr = c500.mrs[c500.r, dst_kind]
    fresh = np.zeros(COH_BUF, bool)
    for i in sorted(chosen):
        line = lines[i]
        c500.r.evict(rmr, line * LINE, min(LINE, COH_BUF - line * LINE))
        fresh[line * LINE:(line + 1) * LINE] = True
    got = rbuf[roff:roff + n]
    if dst_kind != "device":
        assert np.array_equal(got, new[off:off + n])
        return
    want = np.where(fresh[roff:roff + n], new[off:off + n], old[roff:roff + n])
    assert np.array_equal(got, want)


@pytest.mark.parametrize("side", ["send", "receive"])
def test_c500_strict_mode_raises_coherence_violation(side):
    """Strict mode: a NIC read of `device` payload (send side) or a NIC write into `device`
    memory (receive side) on c500 is recorded, and the owning NIC's check() raises
    CoherenceViolation; the same traffic on `finegrained` / `host` memory raises nothing."""
    p = CoherencePair(strict=True)
    try:
        p.write("finegrained", "host", 0, 256, 0)
        p.write("host", "finegrained", 0, 256, 0)
        p.s.check()
        p.r.check()
        if side == "send":
            p.write("device", "host", 0, 256, 0)
            owner = p.s
        else:
            p.write("host", "device", 0, 256, 0)
            owner = p.r
        with pytest.raises(CoherenceViolation, match="device"):
            owner.check()
    finally:
        p.close()


def test_c500_never_evicting_reproduces_the_seed_bug(c500):
    """The seed's C500 report, deterministically: SM stores into `device` memory, a WRITE of it
    completes successfully, and the receiver holds the old bytes (the NIC read HBM, the stores sat
    in L2). Receive side: after a successful WRITE into `device` memory the SMs still read the old
    bytes; one eviction of the lines makes the payload visible. `finegrained` does neither."""
    old, new = _old_and_new(7)
    n = 1000
    for kind, stale in (("device", True), ("finegrained", False)):
        c500.settle(c500.s, kind, old)
        c500.settle(c500.r, "host", np.zeros(COH_BUF, np.uint8))
        c500.mrs[c500.s, kind][0][:n] = new[:n]
        c = c500.write(kind, "host", 0, n, 0)
        assert not c.error
        got = c500.mrs[c500.r, "host"][0][:n]
        assert np.array_equal(got, old[:n] if stale else new[:n]), kind
        # receive side
        c500.settle(c500.s, "host", new)
        c500.settle(c500.r, kind, old)
        assert not c500.write("host", kind, 0, n, 0).error
        rbuf, rmr = c500.mrs[c500.r, kind]
        assert np.array_equal(rbuf[:n], old[:n] if stale else new[:n]), kind
        c500.r.evict(rmr, 0, n)
        assert np.array_equal(rbuf[:n], new[:n]), kind
