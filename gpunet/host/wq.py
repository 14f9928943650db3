"""Host-side posting and polling on mlx5 rings: NIC-agnostic, over raw addresses.

The numba functions (``post_rdma``, ``post_atomic``, ``post_nop``, ``post_write_inline``,
``post_raw``, ``ring_doorbell``, ``poll_cq``, ``poll_cq_collapsed``; ``rawmem.wire_njit``, so
Python may pass any field its full unsigned range) hold no Python objects: the CPU proxy engine
calls them from its own nopython loop, and they work on any ring laid out as mlx5
expects (the soft NIC's or a real NIC's). WQEs are built with gpunet.mlx5's builders.

The doorbell protocol (docs/INTERFACES.md): WQE stores; release; ``dbrec[1] = htobe32(pi)``;
release; one 64-bit store of the last WQE's first 8 ctrl bytes into the doorbell word.

``SendQueue`` and ``CompletionQueue`` are thin Python wrappers for tests and tools: they track the
producer index and the WQEBBs still owned by the NIC, so a post never overwrites a WQEBB whose WQE
has not completed (signalling a WQE periodically and when the ring gets full, then reclaiming
through completions).
"""
import collections
import time

import numpy as np

from gpunet import mlx5
from gpunet.errors import ConfigError, TimeoutError
from gpunet.host.rawmem import (address_of, load_acquire_u32, store_release_u32, store_release_u64,
                                u8_at, wire_njit)


# --- njit: posting ----------------------------------------------------------------------------
@wire_njit(cache=True, nogil=True, inline="always")
def post_rdma(sq_addr, sq_wqebbs, pi, qpn, opcode, fm_ce_se, raddr, rkey, laddr, lkey, nbytes, imm):
    """RDMA WRITE / WRITE_WITH_IMM / READ (one data segment) at WQE index ``pi``. Returns WQEBBs (1).

    ``imm`` is the ctrl segment's raw imm word (pass ``mlx5.bswap32(v)`` to carry immediate v).
    """
    ring = u8_at(sq_addr, sq_wqebbs * mlx5.WQEBB)
    return mlx5.build_rdma(ring, (pi & (sq_wqebbs - 1)) * mlx5.WQEBB, pi, qpn, opcode, fm_ce_se,
                           raddr, rkey, laddr, lkey, nbytes, imm)


@wire_njit(cache=True, nogil=True, inline="always")
def post_atomic(sq_addr, sq_wqebbs, pi, qpn, opcode, fm_ce_se, raddr, rkey, laddr, lkey,
                swap_add, compare):
    """8-byte ATOMIC_FA / ATOMIC_CS at WQE index ``pi``; the old value lands at laddr big-endian."""
    ring = u8_at(sq_addr, sq_wqebbs * mlx5.WQEBB)
    return mlx5.build_atomic(ring, (pi & (sq_wqebbs - 1)) * mlx5.WQEBB, pi, qpn, opcode, fm_ce_se,
                             raddr, rkey, laddr, lkey, swap_add, compare)


@wire_njit(cache=True, nogil=True)
def post_nop(sq_addr, sq_wqebbs, pi, qpn, fm_ce_se):
    ring = u8_at(sq_addr, sq_wqebbs * mlx5.WQEBB)
    return mlx5.build_nop(ring, (pi & (sq_wqebbs - 1)) * mlx5.WQEBB, pi, qpn, fm_ce_se)


@wire_njit(cache=True, nogil=True)
def post_write_inline(sq_addr, sq_wqebbs, pi, qpn, opcode, fm_ce_se, raddr, rkey, data_addr,
                      nbytes, imm):
    """RDMA WRITE(_IMM) carrying ``nbytes`` from ``data_addr`` inline; wraps at the ring's end.

    Returns the WQEBBs used. The WQE's bytes are contiguous modulo the ring size (mlx5 rings wrap
    per WQEBB), so the payload is written byte by byte modulo the ring; padding is zeroed.
    """
    rbytes = sq_wqebbs * mlx5.WQEBB
    ring = u8_at(sq_addr, rbytes)
    ds = mlx5.inline_ds(nbytes)
    nbb = mlx5.wqebb_count(ds)
    off = (pi & (sq_wqebbs - 1)) * mlx5.WQEBB
    mlx5.set_ctrl_seg(ring, off, pi, opcode, 0, qpn, fm_ce_se, ds, 0, imm)
    mlx5.set_raddr_seg(ring, off + mlx5.CTRL_SEG_SIZE, raddr, rkey)
    mlx5.set_inline_hdr(ring, off + mlx5.CTRL_SEG_SIZE + mlx5.RADDR_SEG_SIZE, nbytes)
    src = u8_at(data_addr, nbytes)
    p = off + mlx5.CTRL_SEG_SIZE + mlx5.RADDR_SEG_SIZE + mlx5.INLINE_HDR_SIZE
    for i in range(nbytes):
        ring[(p + i) % rbytes] = src[i]
    for i in range(nbytes, ds * mlx5.DS_UNIT - 36):
        ring[(p + i) % rbytes] = 0
    return nbb


@wire_njit(cache=True, nogil=True)
def post_raw(sq_addr, sq_wqebbs, pi, wqe_addr, nbytes):
    """Copy ``nbytes`` of a prebuilt WQE into the ring at WQE index ``pi`` (wrapping)."""
    rbytes = sq_wqebbs * mlx5.WQEBB
    ring = u8_at(sq_addr, rbytes)
    src = u8_at(wqe_addr, nbytes)
    off = (pi & (sq_wqebbs - 1)) * mlx5.WQEBB
    for i in range(nbytes):
        ring[(off + i) % rbytes] = src[i]
    return (nbytes + mlx5.WQEBB - 1) // mlx5.WQEBB


@wire_njit(cache=True, nogil=True)
def ring_doorbell(sq_addr, sq_wqebbs, dbrec_addr, db_addr, new_pi, last_wqe_pi):
    """Publish WQEs up to ``new_pi``: DBR (release), then the 64-bit doorbell word (release)."""
    ring = u8_at(sq_addr, sq_wqebbs * mlx5.WQEBB)
    store_release_u32(dbrec_addr + 4 * mlx5.DBREC_SND, mlx5.bswap32(new_pi & 0xFFFF))
    word = mlx5.doorbell_word(ring, (last_wqe_pi & (sq_wqebbs - 1)) * mlx5.WQEBB)
    store_release_u64(db_addr, word)


# --- njit: polling ----------------------------------------------------------------------------
@wire_njit(cache=True, nogil=True)
def poll_cq(cq_addr, cqe_cnt, dbrec_addr, ci, out, max_n):
    """Owner-bit CQ: copy up to ``max_n`` new CQEs from consumer index ``ci`` into ``out``.

    ``out`` is a uint8 array of at least max_n * 64 bytes. Returns how many were consumed (the new
    ci is ci + n); the CQ DBR is updated to the new ci when n > 0.
    """
    n = 0
    while n < max_n:
        off = (ci & (cqe_cnt - 1)) * mlx5.CQE_SIZE
        op_own = load_acquire_u32(cq_addr + off + 60) >> np.uint32(24)
        owner = 1 if (ci & cqe_cnt) != 0 else 0
        if (op_own >> 4) == mlx5.CQE_INVALID or (op_own & 1) != owner:
            break
        cqe = u8_at(cq_addr + off, mlx5.CQE_SIZE)
        for i in range(mlx5.CQE_SIZE):
            out[n * mlx5.CQE_SIZE + i] = cqe[i]
        ci += 1
        n += 1
    if n > 0:
        store_release_u32(dbrec_addr, mlx5.bswap32(ci & 0xFFFFFF))
    return n


@wire_njit(cache=True, nogil=True)
def poll_cq_collapsed(cq_addr, out):
    """Collapsed CQ: copy the single slot into ``out`` (64 bytes); returns its op_own byte.

    The slot is valid once its opcode is not INVALID (0xF); compare ``wqe_counter`` (16-bit wrap)
    with what you wait for.
    """
    w = load_acquire_u32(cq_addr + 60)
    cqe = u8_at(cq_addr, mlx5.CQE_SIZE)
    for i in range(mlx5.CQE_SIZE - 4):
        out[i] = cqe[i]
    # wqe_counter and op_own come from the one 32-bit acquire load above, never from a second read
    # of the slot: the NIC may overwrite the slot between two reads, and a counter newer than its
    # op_own reports one CQE twice (tests/test_softnic_model.py's collapsed-CQ streams fail on a
    # CQE for a WQE no longer outstanding). Bytes 0..59 may be torn (the slot is rewritten in
    # place, as on a real NIC): trust only counter and opcode while CQEs arrive.
    for i in range(4):
        out[60 + i] = (w >> np.uint32(8 * i)) & np.uint32(0xFF)
    return w >> np.uint32(24)


# --- Python wrappers ----------------------------------------------------------------------------
Cqe = collections.namedtuple(
    "Cqe", "opcode qpn wqe_counter byte_cnt imm imm_raw syndrome vendor_syndrome wqe_opcode "
           "error status")
Cqe.__doc__ = """A decoded CQE. ``imm`` is the immediate as a number (big-endian on the wire);
``error`` is True for REQ_ERR / RESP_ERR; ``status`` is "ok" or the syndrome's name."""


def decode_cqe(b):
    """Decode 64 CQE bytes (np.uint8) into a Cqe."""
    b = bytes(b)
    op = b[63] >> 4
    word = int.from_bytes(b[56:60], "big")
    err = op in (mlx5.CQE_REQ_ERR, mlx5.CQE_RESP_ERR)
    synd = b[55] if err else 0
    return Cqe(opcode=op, qpn=word & 0xFFFFFF, wqe_counter=int.from_bytes(b[60:62], "big"),
               byte_cnt=int.from_bytes(b[44:48], "big"), imm=int.from_bytes(b[36:40], "big"),
               imm_raw=int.from_bytes(b[36:40], "little"), syndrome=synd,
               vendor_syndrome=b[54] if err else 0, wqe_opcode=(word >> 24) if err else None,
               error=err, status=mlx5.syndrome_name(synd) if err else "ok")


class CompletionQueue:
    """Polls one CQ (owner-bit or collapsed). One instance per CQ: constructing again returns it.

    poll() -> list of Cqe; wait(n, timeout) -> list of n Cqe or gpunet.TimeoutError.
    Send queues posting to this CQ register themselves and reclaim ring space from its CQEs.
    """

    def __new__(cls, cq):
        inst = getattr(cq, "_gpunet_poller", None)
        if inst is None:
            inst = super().__new__(cls)
            inst._init(cq)
            cq._gpunet_poller = inst
        return inst

    def _init(self, cq):
        self.cq = cq
        self.ci = 0
        self._out = np.zeros(64 * mlx5.CQE_SIZE, dtype=np.uint8)
        self._backlog = collections.deque()
        self._sqs = {}
        self._last = None          # collapsed: (op_own, wqe_counter) last reported

    def _poll_hw(self, max_n=64):
        cq = self.cq
        if cq.collapsed:
            op_own = poll_cq_collapsed(cq.buf_addr, self._out)
            if (op_own >> 4) == mlx5.CQE_INVALID:
                return []
            c = decode_cqe(self._out[:64])
            key = (int(op_own), c.wqe_counter, c.qpn)
            if key == self._last:
                return []
            self._last = key
            got = [c]
        else:
            n = poll_cq(cq.buf_addr, cq.cqe_cnt, cq.dbrec_addr, self.ci, self._out,
                        min(max_n, 64))
            self.ci += n
            got = [decode_cqe(self._out[i * 64:(i + 1) * 64]) for i in range(n)]
        for c in got:
            sq = self._sqs.get(c.qpn)
            if sq is not None and c.opcode in (mlx5.CQE_REQ, mlx5.CQE_REQ_ERR):
                sq._completed(c.wqe_counter)
        return got

    def poll(self, max_n=64):
        """New CQEs (at most max_n), oldest first."""
        res = []
        while self._backlog and len(res) < max_n:
            res.append(self._backlog.popleft())
        if len(res) < max_n:
            res.extend(self._poll_hw(max_n - len(res)))
        return res

    def wait(self, n=1, timeout=5.0):
        """Block until ``n`` CQEs arrived; returns them. Raises gpunet.TimeoutError."""
        res = []
        deadline = time.monotonic() + timeout
        sleep = 0.0
        while len(res) < n:
            got = self.poll(n - len(res))
            if got:
                res.extend(got)
                sleep = 0.0
                continue
            if time.monotonic() > deadline:
                raise TimeoutError("CQ %d: %d of %d completions after %.2f s; got %r. Is the NIC "
                                   "running and the QP connected?" % (self.cq.cqn, len(res), n,
                                                                     timeout, res))
            time.sleep(sleep)
            sleep = min(sleep * 2 + 20e-6, 1e-3)
        return res

    def _stash(self, timeout):
        """Poll for the send queues' sake, keeping the CQEs for the user's next poll()."""
        got = self._poll_hw()
        self._backlog.extend(got)
        return bool(got)


class SendQueue:
    """Posts WQEs into a QP's send queue and rings its doorbell (thin wrapper for tests/tools).

    Every ``post_*`` returns the WQE's index (its 16-bit value is the CQE's ``wqe_counter``).
    ``signaled=True`` asks for a CQE; the queue also forces one every ``signal_every`` WQEBBs and
    when the ring is three quarters full, and reclaims space only through completions, so it never
    overwrites a WQEBB the NIC may still read. ``doorbell=False`` batches: call ``ring()`` later.
    """

    def __init__(self, qp, cq=None, signal_every=None):
        self.qp = qp
        self.cq = cq if cq is not None else CompletionQueue(qp.send_cq)
        self.cq._sqs[qp.qpn] = self
        self.n = qp.sq_wqebbs
        self.signal_every = signal_every or max(1, self.n // 4)
        self.pi = 0                   # producer index (unbounded; the ring uses its low bits)
        self.ci = 0                   # first WQEBB not known to be completed
        self._rung = 0
        self._last_wqe = None
        self._last_signal = 0
        self._outstanding = collections.deque()   # (start_pi, nbb)
        self._tmp = np.zeros(mlx5.MAX_DS * mlx5.DS_UNIT + 64, dtype=np.uint8)

    # --- bookkeeping ---
    @property
    def outstanding(self):
        """WQEBBs posted and not yet known to be complete."""
        return self.pi - self.ci

    def _completed(self, wqe_counter):
        for k, (start, nbb) in enumerate(self._outstanding):
            if start & 0xFFFF == wqe_counter:
                for _ in range(k + 1):
                    s, b = self._outstanding.popleft()
                self.ci = s + b
                return

    def _reserve(self, nbb, timeout=5.0):
        if nbb > self.n:
            raise ConfigError("a WQE of %d WQEBBs does not fit a ring of %d" % (nbb, self.n))
        deadline = time.monotonic() + timeout
        while self.n - (self.pi - self.ci) < nbb:
            if self._last_signal < self.pi and self.n - (self.pi - self.ci) >= 1:
                self._post(post_nop, (self.qp.qpn, None), 1, True, False, True)
                continue
            if self._rung != self.pi:
                self.ring()
            if not self.cq._stash(0):
                if time.monotonic() > deadline:
                    raise TimeoutError("QP %d: send queue full (%d WQEBBs outstanding) for %.1f s; "
                                       "are completions arriving?" % (self.qp.qpn,
                                                                      self.outstanding, timeout))
                time.sleep(20e-6)

    def _flags(self, nbb, signaled, fence):
        pi_after = self.pi + nbb
        free_after = self.n - (pi_after - self.ci)
        if pi_after - self._last_signal >= self.signal_every or free_after <= self.n // 4:
            signaled = True
        fm = (mlx5.WQE_CTRL_CQ_UPDATE if signaled else 0) | (mlx5.WQE_CTRL_FENCE if fence else 0)
        return fm, signaled

    def _post(self, fn, args, nbb, signaled, fence, doorbell):
        """fn(sq_addr, sq_wqebbs, pi, *args); the ``None`` in args is replaced by fm_ce_se."""
        self._reserve(nbb)
        fm, signaled = self._flags(nbb, signaled, fence)
        args = tuple(fm if a is None else a for a in args)
        pi = self.pi
        used = fn(self.qp.sq_addr, self.n, pi, *args)
        assert used == nbb, (used, nbb)
        return self._advance(nbb, signaled, doorbell)

    def _advance(self, nbb, signaled, doorbell):
        """Account for the WQE just written at ``self.pi`` (``nbb`` WQEBBs); returns its index."""
        pi = self.pi
        self._outstanding.append((pi, nbb))
        self.pi += nbb
        if signaled:
            self._last_signal = self.pi
        self._last_wqe = pi
        if doorbell:
            self.ring()
        return pi

    def ring(self):
        """Ring the doorbell for everything posted so far."""
        if self._last_wqe is None or self._rung == self.pi:
            return
        q = self.qp
        ring_doorbell(q.sq_addr, self.n, q.dbrec_addr, q.db_addr, self.pi, self._last_wqe)
        self._rung = self.pi

    # --- posts (addresses are virtual addresses; keys are lkey / rkey) ---
    def _rdma(self, opcode, laddr, lkey, raddr, rkey, nbytes, imm, signaled, fence, doorbell):
        return self._post(post_rdma, (self.qp.qpn, opcode, None, int(raddr), int(rkey), int(laddr),
                                      int(lkey), int(nbytes), imm), 1, signaled, fence, doorbell)

    def post_write(self, laddr, lkey, raddr, rkey, nbytes, signaled=False, fence=False,
                   doorbell=True):
        """RDMA WRITE of nbytes from local laddr (lkey) to remote raddr (rkey)."""
        return self._rdma(mlx5.OPCODE_RDMA_WRITE, laddr, lkey, raddr, rkey, nbytes, 0,
                          signaled, fence, doorbell)

    def post_write_imm(self, laddr, lkey, raddr, rkey, nbytes, imm, signaled=False, fence=False,
                       doorbell=True):
        """RDMA WRITE_WITH_IMM: the responder's recv CQ gets a CQE carrying ``imm`` (32-bit)."""
        return self._rdma(mlx5.OPCODE_RDMA_WRITE_IMM, laddr, lkey, raddr, rkey, nbytes,
                          int(mlx5.bswap32(imm & 0xFFFFFFFF)), signaled, fence, doorbell)

    def post_read(self, laddr, lkey, raddr, rkey, nbytes, signaled=False, fence=False,
                  doorbell=True):
        """RDMA READ of nbytes from remote raddr (rkey) into local laddr (lkey, LOCAL_WRITE)."""
        return self._rdma(mlx5.OPCODE_RDMA_READ, laddr, lkey, raddr, rkey, nbytes, 0,
                          signaled, fence, doorbell)

    def post_atomic_fa(self, laddr, lkey, raddr, rkey, add, signaled=False, fence=False,
                       doorbell=True):
        """8-byte fetch-add on the big-endian word at raddr; the old value (8 B, BE) to laddr."""
        return self._post(post_atomic, (self.qp.qpn, mlx5.OPCODE_ATOMIC_FA, None, int(raddr),
                                        int(rkey), int(laddr), int(lkey),
                                        int(add) & 0xFFFFFFFFFFFFFFFF, 0),
                          1, signaled, fence, doorbell)

    def post_atomic_cs(self, laddr, lkey, raddr, rkey, compare, swap, signaled=False, fence=False,
                       doorbell=True):
        """8-byte compare-and-swap on the big-endian word at raddr; the old value to laddr."""
        return self._post(post_atomic, (self.qp.qpn, mlx5.OPCODE_ATOMIC_CS, None, int(raddr),
                                        int(rkey), int(laddr), int(lkey),
                                        int(swap) & 0xFFFFFFFFFFFFFFFF,
                                        int(compare) & 0xFFFFFFFFFFFFFFFF),
                          1, signaled, fence, doorbell)

    def post_nop(self, signaled=False, fence=False, doorbell=True):
        return self._post(post_nop, (self.qp.qpn, None), 1, signaled, fence, doorbell)

    def post_write_inline(self, data, raddr, rkey, imm=None, signaled=False, fence=False,
                          doorbell=True):
        """RDMA WRITE (WRITE_WITH_IMM if imm is given) carrying ``data`` inside the WQE."""
        data = np.ascontiguousarray(np.frombuffer(bytes(data), dtype=np.uint8)) \
            if not isinstance(data, np.ndarray) else np.ascontiguousarray(data).view(np.uint8)
        n = data.nbytes
        nbb = int(mlx5.wqebb_count(mlx5.inline_ds(n)))
        opcode = mlx5.OPCODE_RDMA_WRITE if imm is None else mlx5.OPCODE_RDMA_WRITE_IMM
        immw = 0 if imm is None else int(mlx5.bswap32(imm & 0xFFFFFFFF))
        self._keep = data
        return self._post(post_write_inline, (self.qp.qpn, opcode, None, int(raddr), int(rkey),
                                              address_of(data) if n else 0, n, immw),
                          nbb, signaled, fence, doorbell)

    def post_raw(self, wqe_bytes, nbb=None, doorbell=True, signaled=True):
        """Post prebuilt WQE bytes as is (for malformed-WQE tests). ``nbb``: WQEBBs to advance."""
        w = np.frombuffer(bytes(wqe_bytes), dtype=np.uint8).copy()
        nb = (w.nbytes + 63) // 64 if nbb is None else int(nbb)
        self._reserve(nb)
        post_raw(self.qp.sq_addr, self.n, self.pi, address_of(w), w.nbytes)
        return self._advance(nb, signaled, doorbell)

    def quiet(self, timeout=5.0):
        """Wait until every posted WQE completed (posts a signalled NOP if the tail is unsignalled).

        Completions polled meanwhile stay queued for the CompletionQueue's next poll().
        """
        if self._last_signal < self.pi:
            self.post_nop(signaled=True)
        self.ring()
        deadline = time.monotonic() + timeout
        while self.ci < self.pi:
            if not self.cq._stash(0):
                if time.monotonic() > deadline:
                    raise TimeoutError("QP %d: %d WQEBBs still outstanding after %.1f s"
                                       % (self.qp.qpn, self.outstanding, timeout))
                time.sleep(20e-6)
