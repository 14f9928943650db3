"""A plain-Python reference model of the soft NIC's RC semantics: the oracle for its tests.

Written from DESIGN.md / FACTS.md / INTERFACES.md, independently of ``gpunet/host/softnic.py`` (it imports
nothing from it, and nothing numba): given the memory of every node, the memory regions registered
on each node, the QPs (connections, CQs, ring depth) and the stream of operations posted on each
QP, it computes what an mlx5 NIC pair must leave behind:

- the final bytes of every buffer;
- the CQEs on every CQ: requester CQEs (opcode, wqe_counter, byte_cnt), error CQEs (syndrome) and
  responder CQEs of RDMA WRITE_WITH_IMM (immediate, byte_cnt).

Semantics modelled (one RC QP, operations executed in posting order, which also satisfies every
FENCE, so a fence changes nothing here):

- RDMA WRITE (data segment or inline), WRITE_WITH_IMM (the responder QP's receive CQ gets a
  RESP_WR_IMM CQE carrying the ctrl segment's imm word and the byte count), RDMA READ, 8-byte
  ATOMIC fetch-add / compare-swap (the remote word is read and written, and the old value lands
  at the local address, in ``atomic_byteorder``), NOP.
- memory protection, per access: the lkey must name an MR of the requester's node in the QP's PD,
  cover [laddr, laddr + n) and, where the NIC writes local memory (READ, atomics), allow
  LOCAL_WRITE: else ``SYNDROME_LOCAL_PROT_ERR``. The rkey must name an MR of the responder's node in
  the responder QP's PD, cover [raddr, raddr + n) and allow REMOTE_WRITE / REMOTE_READ /
  REMOTE_ATOMIC: else ``SYNDROME_REMOTE_ACCESS_ERR``. A misaligned atomic is
  ``SYNDROME_REMOTE_INVAL_REQ_ERR``. A zero-length transfer touches no memory and checks no key
  here; whether it should is left open (the soft NIC checks keys and bounds even then; rdma-core
  leaves zero-length SGEs out of the WQE), so the tests never give one a bad key or address.
- the first violation on a QP: a REQ_ERR CQE with that syndrome (signalled or not), no memory is
  touched, the QP moves to error; every later WQE of that QP completes with a REQ_ERR CQE with
  ``SYNDROME_WR_FLUSH_ERR`` (signalled or not) and does nothing.
- a successful WQE produces a CQE only when it is signalled (CQ_UPDATE).
- ``wqe_counter`` is the WQE's producer index (16 bits); the index advances by the WQE's WQEBBs
  (an inline WRITE of n bytes takes ceil((32 + 4 + n) / 64) WQEBBs, rounded to 16-byte units
  first). Responder CQEs carry a per-QP count of the messages that consumed a receive (16 bits).

Operations of different QPs are executed one QP after another: the model is exact only when the
caller's QPs touch disjoint memory (or only commute, like fetch-adds whose fetched values are not
compared). That is the tests' job to arrange.
"""
from dataclasses import dataclass, field, replace

from gpunet import mlx5

# Access flags, with the ibv_access_flags values (the engine's Access enum is mapped onto these).
LOCAL_WRITE = 1
REMOTE_WRITE = 2
REMOTE_READ = 4
REMOTE_ATOMIC = 8
ACCESS_ALL = LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ | REMOTE_ATOMIC

WRITE_OPCODES = (mlx5.OPCODE_RDMA_WRITE, mlx5.OPCODE_RDMA_WRITE_IMM)
ATOMIC_OPCODES = (mlx5.OPCODE_ATOMIC_FA, mlx5.OPCODE_ATOMIC_CS)
OPCODE_NAMES = {
    mlx5.OPCODE_NOP: "NOP", mlx5.OPCODE_RDMA_WRITE: "WRITE",
    mlx5.OPCODE_RDMA_WRITE_IMM: "WRITE_IMM",
    mlx5.OPCODE_RDMA_READ: "READ", mlx5.OPCODE_ATOMIC_FA: "ATOMIC_FA",
    mlx5.OPCODE_ATOMIC_CS: "ATOMIC_CS",
}
MASK64 = (1 << 64) - 1


@dataclass
class Op:
    """One work request as posted: what the WQE says, in the model's terms.

    ``inline`` is the payload bytes for an inline WRITE (then ``laddr``/``lkey`` are unused and
    ``nbytes`` is ``len(inline)``); ``imm`` is the ctrl segment's imm word exactly as stored
    (already big-endian, as rdma-core expects); atomics use ``swap_add`` / ``compare`` and always
    move 8 bytes.
    """
    opcode: int
    nbytes: int = 0
    laddr: int = 0
    lkey: int = 0
    raddr: int = 0
    rkey: int = 0
    inline: bytes = None
    signaled: bool = True
    fence: bool = False
    imm: int = 0
    swap_add: int = 0
    compare: int = 0

    @property
    def length(self):
        """Bytes the operation moves (8 for atomics, 0 for a NOP)."""
        if self.opcode in ATOMIC_OPCODES:
            return 8
        if self.opcode == mlx5.OPCODE_NOP:
            return 0
        if self.inline is not None:
            return len(self.inline)
        return self.nbytes

    def describe(self):
        s = OPCODE_NAMES.get(self.opcode, hex(self.opcode))
        if self.inline is not None:
            s += " inline"
        return "%s n=%d l=%#x/%#x r=%#x/%#x%s%s" % (
            s, self.length, self.laddr, self.lkey, self.raddr, self.rkey,
            " sig" if self.signaled else "", " fence" if self.fence else "")


def wqebbs(op):
    """WQEBBs the WQE of ``op`` occupies in the send queue (the producer-index advance)."""
    if op.opcode == mlx5.OPCODE_NOP:
        ds = 1
    elif op.opcode in ATOMIC_OPCODES:
        ds = 4                                  # ctrl + raddr + atomic + data
    elif op.inline is not None:
        ds = 2 + -(-(4 + len(op.inline)) // 16)  # ctrl + raddr + inline header and data
    else:
        ds = 3                                  # ctrl + raddr + data
    return -(-ds * 16 // 64)


@dataclass
class Buffer:
    """Memory of one node at virtual address ``addr`` (the bytes are the model's copy)."""
    node: str
    addr: int
    data: bytearray


@dataclass
class MR:
    node: str
    addr: int
    length: int
    lkey: int
    rkey: int
    access: int = ACCESS_ALL
    pd: int = 0

    def covers(self, addr, n):
        return self.addr <= addr and addr + n <= self.addr + self.length


@dataclass
class QP:
    name: str
    node: str
    qpn: int
    peer: str                 # name of the connected QP
    send_cq: str
    recv_cq: str = None       # defaults to send_cq
    sq_wqebbs: int = 256
    max_inline: int = 256
    pd: int = 0
    start_pi: int = 0         # producer index of the first WQE in this stream (QPs are reused)
    start_recv_count: int = 0  # responder messages this QP had received before the stream


@dataclass(frozen=True)
class CQE:
    """A CQE as the model predicts it. ``wqe_opcode`` is the failed WQE's opcode (error CQEs)."""
    opcode: int
    qpn: int
    wqe_counter: int
    syndrome: int = 0
    byte_cnt: int = 0
    imm: int = 0
    wqe_opcode: int = 0

    def describe(self):
        if self.opcode in (mlx5.CQE_REQ_ERR, mlx5.CQE_RESP_ERR):
            return "ERR(op=%d qpn=%d wqe=%d synd=%#x)" % (self.opcode, self.qpn, self.wqe_counter,
                                                          self.syndrome)
        return "CQE(op=%d qpn=%d wqe=%d bytes=%d imm=%#x)" % (
            self.opcode, self.qpn, self.wqe_counter, self.byte_cnt, self.imm)


@dataclass
class Result:
    memory: dict              # (node, addr) -> bytes, one entry per Buffer
    cqes: dict                # cq name -> [CQE] in the order the NIC must write them per QP
    qp_error: dict            # qp name -> True if the QP ended in error
    trace: list = field(default_factory=list)   # (qp, wqe index, op, outcome) for messages


class ReferenceModel:
    """Build with buffers, MRs and QPs, then ``run({qp_name: [Op, ...]})``.

    ``atomic_byteorder``: how the NIC reads and writes the remote 8-byte word and writes the old
    value back ("little": the host's native order, the soft NIC's default; "big": network order,
    SoftNic(atomic_endianness="big")).
    """

    def __init__(self, atomic_byteorder="little"):
        self.atomic_byteorder = atomic_byteorder
        self.buffers = []
        self.mrs = []
        self.qps = {}

    # --- configuration ------------------------------------------------------------------------
    def add_buffer(self, node, addr, data):
        self.buffers.append(Buffer(node, int(addr), bytearray(data)))

    def add_mr(self, node, addr, length, lkey, rkey, access=ACCESS_ALL, pd=0):
        self.mrs.append(MR(node, int(addr), int(length), int(lkey), int(rkey), int(access), pd))

    def add_qp(self, name, **kw):
        self.qps[name] = QP(name=name, **kw)

    # --- memory ---------------------------------------------------------------------------------
    def _buffer(self, node, addr, n):
        for b in self.buffers:
            if b.node == node and b.addr <= addr and addr + n <= b.addr + len(b.data):
                return b
        raise AssertionError("model: no buffer of node %s holds [%#x, +%d): an MR covers memory "
                             "the test did not give the model" % (node, addr, n))

    def _read(self, node, addr, n):
        b = self._buffer(node, addr, n)
        o = addr - b.addr
        return bytes(b.data[o:o + n])

    def _write(self, node, addr, payload):
        b = self._buffer(node, addr, len(payload))
        o = addr - b.addr
        b.data[o:o + len(payload)] = payload

    def _local_ok(self, qp, key, addr, n, need):
        for mr in self.mrs:
            if mr.node == qp.node and mr.lkey == key and mr.pd == qp.pd:
                return mr.covers(addr, n) and (mr.access & need) == need
        return False

    def _remote_ok(self, peer, key, addr, n, need):
        for mr in self.mrs:
            if mr.node == peer.node and mr.rkey == key and mr.pd == peer.pd:
                return mr.covers(addr, n) and (mr.access & need) == need
        return False

    # --- one WQE ----------------------------------------------------------------------------------
    def _check(self, qp, peer, op):
        """The syndrome this WQE fails with, or 0."""
        n = op.length
        if op.opcode == mlx5.OPCODE_NOP or n == 0:
            return 0
        if op.opcode in WRITE_OPCODES:
            if op.inline is None and not self._local_ok(qp, op.lkey, op.laddr, n, 0):
                return mlx5.SYNDROME_LOCAL_PROT_ERR
            if not self._remote_ok(peer, op.rkey, op.raddr, n, REMOTE_WRITE):
                return mlx5.SYNDROME_REMOTE_ACCESS_ERR
            return 0
        if op.opcode == mlx5.OPCODE_RDMA_READ:
            if not self._local_ok(qp, op.lkey, op.laddr, n, LOCAL_WRITE):
                return mlx5.SYNDROME_LOCAL_PROT_ERR
            if not self._remote_ok(peer, op.rkey, op.raddr, n, REMOTE_READ):
                return mlx5.SYNDROME_REMOTE_ACCESS_ERR
            return 0
        if op.opcode in ATOMIC_OPCODES:
            if not self._local_ok(qp, op.lkey, op.laddr, 8, LOCAL_WRITE):
                return mlx5.SYNDROME_LOCAL_PROT_ERR
            if op.raddr % 8:
                return mlx5.SYNDROME_REMOTE_INVAL_REQ_ERR
            if not self._remote_ok(peer, op.rkey, op.raddr, 8, REMOTE_ATOMIC):
                return mlx5.SYNDROME_REMOTE_ACCESS_ERR
            return 0
        raise AssertionError("model: opcode %#x is not modelled" % op.opcode)

    def _execute(self, qp, peer, op):
        n = op.length
        if op.opcode in WRITE_OPCODES:
            payload = op.inline if op.inline is not None else self._read(qp.node, op.laddr, n)
            if n:
                self._write(peer.node, op.raddr, payload)
        elif op.opcode == mlx5.OPCODE_RDMA_READ:
            if n:
                self._write(qp.node, op.laddr, self._read(peer.node, op.raddr, n))
        elif op.opcode in ATOMIC_OPCODES:
            old = int.from_bytes(self._read(peer.node, op.raddr, 8), self.atomic_byteorder)
            if op.opcode == mlx5.OPCODE_ATOMIC_FA:
                new = (old + op.swap_add) & MASK64
            else:
                new = (op.swap_add & MASK64) if old == (op.compare & MASK64) else old
            self._write(peer.node, op.raddr, new.to_bytes(8, self.atomic_byteorder))
            self._write(qp.node, op.laddr, old.to_bytes(8, self.atomic_byteorder))

    # --- the run ----------------------------------------------------------------------------------
    def run(self, streams):
        """Execute ``streams`` ({qp name: [Op]}); the model's state (memory) is updated in place."""
        cqes = {}
        qp_error = {}
        trace = []
        recv_count = {name: qp.start_recv_count for name, qp in self.qps.items()}
        for name, ops in streams.items():
            qp = self.qps[name]
            peer = self.qps[qp.peer]
            send_cq = cqes.setdefault(qp.send_cq, [])
            recv_cq = cqes.setdefault(peer.recv_cq or peer.send_cq, [])
            pi = qp.start_pi
            err = False
            for op in ops:
                nbb = wqebbs(op)
                if nbb > qp.sq_wqebbs:
                    raise AssertionError("model: a WQE of %d WQEBBs cannot fit a ring of %d"
                                         % (nbb, qp.sq_wqebbs))
                if op.inline is not None and len(op.inline) > qp.max_inline:
                    raise AssertionError("model: inline of %d bytes exceeds max_inline %d"
                                         % (len(op.inline), qp.max_inline))
                idx = pi & 0xFFFF
                if err:
                    send_cq.append(CQE(mlx5.CQE_REQ_ERR, qp.qpn, idx,
                                       syndrome=mlx5.SYNDROME_WR_FLUSH_ERR, wqe_opcode=op.opcode))
                    trace.append((name, idx, op, "flushed"))
                else:
                    synd = self._check(qp, peer, op)
                    if synd:
                        err = True
                        send_cq.append(CQE(mlx5.CQE_REQ_ERR, qp.qpn, idx, syndrome=synd,
                                           wqe_opcode=op.opcode))
                        trace.append((name, idx, op, "error %#x" % synd))
                    else:
                        self._execute(qp, peer, op)
                        trace.append((name, idx, op, "ok"))
                        if op.opcode == mlx5.OPCODE_RDMA_WRITE_IMM:
                            recv_cq.append(CQE(mlx5.CQE_RESP_WR_IMM, peer.qpn,
                                               recv_count[peer.name] & 0xFFFF,
                                               byte_cnt=op.length, imm=op.imm & 0xFFFFFFFF))
                            recv_count[peer.name] += 1
                        if op.signaled:
                            send_cq.append(CQE(mlx5.CQE_REQ, qp.qpn, idx, byte_cnt=op.length))
                pi += nbb
            qp_error[name] = err
        memory = {(b.node, b.addr): bytes(b.data) for b in self.buffers}
        return Result(memory, cqes, qp_error, trace)


def signal_for_progress(ops, sq_wqebbs):
    """Force CQ_UPDATE where a producer that frees ring space only on CQEs would otherwise stall.

    A producer learns that WQEBBs are free only from a CQE. Returns a copy of ``ops`` in which no
    run of unsignalled WQEs spans more than half the ring and the last WQE is signalled, so a
    producer that keeps at most ``sq_wqebbs`` WQEBBs outstanding always has a CQE to wait for.
    """
    out = []
    run = 0
    half = max(1, sq_wqebbs // 2)
    for i, op in enumerate(ops):
        nbb = wqebbs(op)
        sig = op.signaled or run + nbb >= half or i == len(ops) - 1
        out.append(replace(op, signaled=sig))
        run = 0 if sig else run + nbb
    return out
