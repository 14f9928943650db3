"""Device descriptors for NIC resources: the QpDesc / PeerDesc / DevCtx / Status the kernels read.

The layouts are device/abi.py's (mirrored from qp.cuh and gpunet.cuh). This module fills them
from soft-NIC (or, later, verbs) QPs and CQs, so that every user of device code — the Python API's
Context, the tests' Loopback, the benchmarks — builds them the same way.

On the HOST arm "device memory" is ordinary 64-byte-aligned host memory (abi.alloc_struct).
"""
import numpy as np

from gpunet.device import abi
from gpunet.host.rawmem import address_of


class QpDescriptor:
    """A QpDesc (plus its per-slot arrays) for one NIC QP whose send CQ the device polls.

    ``qp``: a soft-NIC QP; ``peer``: the PE it reaches; ``db_batch``: ring the doorbell every
    that many WQEBBs at most (1 = every post). The CQ must hold at least ``qp.sq_wqebbs`` CQEs in
    owner-bit mode (every device WQE is signalled), or be collapsed.
    """

    def __init__(self, qp, peer, db_batch=1):
        cq = qp.send_cq
        if not cq.collapsed and cq.cqe_cnt < qp.sq_wqebbs:
            raise ValueError("device QPs signal every WQE: the CQ needs >= %d CQEs (has %d)"
                             % (qp.sq_wqebbs, cq.cqe_cnt))
        self.qp = qp
        self.desc = abi.alloc_struct(abi.QpDesc)
        self.slot_db = np.zeros(qp.sq_wqebbs, dtype=np.uint64)
        self.slot_nbb = np.zeros(qp.sq_wqebbs, dtype=np.uint32)
        d = self.desc
        d.sq, d.dbrec, d.db = qp.sq_addr, qp.dbrec_addr, qp.db_addr
        d.slot_db, d.slot_nbb = address_of(self.slot_db), address_of(self.slot_nbb)
        d.sq_wqebbs, d.qpn, d.peer, d.db_batch = qp.sq_wqebbs, qp.qpn, peer, db_batch
        d.max_inline = qp.max_inline
        d.cq.buf, d.cq.dbrec, d.cq.cqe_cnt = cq.buf_addr, cq.dbrec_addr, cq.cqe_cnt
        d.cq.collapsed = int(cq.collapsed)

    @property
    def addr(self):
        return abi.addr_of(self.desc)

    def heads(self):
        """(resv_head, ready_head, db_head, done_head): the device's posting counters."""
        d = self.desc
        return int(d.resv_head), int(d.ready_head), int(d.db_head), int(d.done_head)


class DeviceContext:
    """A DevCtx with its PeerDesc array and Status block.

    ``local_base``/``heap_bytes``/``lkey``: this PE's registered symmetric heap; ``npes``/``my_pe``;
    ``scratch``/``discard``: addresses inside the heap for atomic results and NIC-written scratch;
    ``timeout_s``: the bound of every device wait.
    """

    def __init__(self, local_base, heap_bytes, lkey, npes, my_pe, scratch, scratch_slots, discard,
                 timeout_s, max_wqe_bytes=0):
        self.status = abi.alloc_struct(abi.Status)
        self.peers = abi.alloc_struct(abi.PeerDesc, npes)
        c = self.ctx = abi.alloc_struct(abi.DevCtx)
        c.local_base, c.heap_bytes, c.lkey = local_base, heap_bytes, lkey
        c.npes, c.my_pe, c.scratch_slots = npes, my_pe, scratch_slots
        c.peers, c.status = abi.addr_of(self.peers), abi.addr_of(self.status)
        c.timeout_ns = int(timeout_s * 1e9)
        c.scratch, c.discard = scratch, discard
        c.max_wqe_bytes = max_wqe_bytes
        self._keep = []

    def set_peer_qp(self, pe, qpd, remote_base, rkey):
        """PE ``pe`` is reached by GPU-initiated posting on ``qpd`` (a QpDescriptor)."""
        p = self.peers[pe]
        p.qp, p.remote_base, p.rkey = qpd.addr, remote_base, rkey
        self._keep.append(qpd)

    def set_peer_proxy(self, pe, channel_desc_addr, remote_base, rkey, keep=None):
        """PE ``pe`` is reached through a CPU-proxy channel (its device descriptor address)."""
        p = self.peers[pe]
        p.qp, p.proxy, p.remote_base, p.rkey = 0, channel_desc_addr, remote_base, rkey
        if keep is not None:
            self._keep.append(keep)

    @property
    def addr(self):
        return abi.addr_of(self.ctx)

    def clear_status(self):
        import ctypes
        ctypes.memset(abi.addr_of(self.status), 0, ctypes.sizeof(self.status))

    def raise_for_status(self, what="device kernel"):
        abi.raise_for_status(self.status, what)
