"""Test and benchmark support, not the API: a two-PE world inside one process on the soft NIC,
what the device QP tests and benchmarks run on.

PE 0 (the device code under test) posts on QP ``a``; PE 1 is QP ``b``, its RC peer, on the same
SoftNic or on a second one (``peer_nic``: then ``peer_nic.mark_down()`` is a dead peer). Each PE
has a symmetric heap of ``heap_bytes`` registered with its NIC; :meth:`sym` hands out the same
offset in both, so a symmetric address ``local_base + off`` names ``local[off]`` here and
``remote[off]`` on PE 1. The device descriptors (QpDesc, its slot arrays, DevCtx, PeerDesc[2],
Status) live in plain 64-byte-aligned host memory: the HOST arm's "device memory".
"""
from gpunet._floor import address_of
from gpunet.device.descriptors import DeviceContext, QpDescriptor

PEER = 1                      # the PE device code targets
SCRATCH_SLOTS = 1024          # atomic result slots: one per thread that may call atomic_fetch_add


class Loopback:
    """Args: nic (SoftNic of PE 0); sq_wqebbs (ring depth); collapsed (CQ mode);
    timeout_s (device waits); heap_bytes; kind (memory kind of both heaps); peer_nic (default nic);
    max_inline (QP limit); max_wqe_bytes (DevCtx split size, 0 = 1 GiB); post_mode (QP a's
    posting mode: "batched" or "serial", qp.cuh)."""

    def __init__(self, nic, sq_wqebbs=64, collapsed=False, timeout_s=5.0,
                 heap_bytes=1 << 20, kind="host", peer_nic=None, max_inline=256, max_wqe_bytes=0,
                 post_mode="batched"):
        self.nic = nic
        self.peer_nic = peer_nic or nic
        self.heap_bytes = heap_bytes
        self.local = nic.alloc(heap_bytes, 4096)
        self.remote = self.peer_nic.alloc(heap_bytes, 4096)
        self.local_mr = nic.reg_mr(self.local, kind=kind)
        self.remote_mr = self.peer_nic.reg_mr(self.remote, kind=kind)
        self.local_base = address_of(self.local)
        self.remote_base = address_of(self.remote)
        cqe_cnt = 1 if collapsed else max(sq_wqebbs, 8)
        self.cq = nic.create_cq(cqe_cnt=cqe_cnt, collapsed=collapsed)
        self.a = nic.create_qp(self.cq, sq_wqebbs=sq_wqebbs, max_inline=max_inline)
        self.cq_b = self.peer_nic.create_cq(cqe_cnt=64)
        self.b = self.peer_nic.create_qp(self.cq_b, sq_wqebbs=8, max_inline=max_inline)
        nic.connect(self.a, self.b.info())
        self.peer_nic.connect(self.b, self.a.info())

        self._top = 0
        scratch = self.sym(SCRATCH_SLOTS * 8)
        discard = self.sym(64)
        self.qpd = QpDescriptor(self.a, PEER, post_mode=post_mode)
        self.qp, self.slot_db, self.slot_nbb = self.qpd.desc, self.qpd.slot_db, self.qpd.slot_nbb
        self.dev = DeviceContext(self.local_base, heap_bytes, self.local_mr.lkey, 2, 0,
                                 self.local_base + scratch, SCRATCH_SLOTS, self.local_base + discard,
                                 timeout_s, max_wqe_bytes,
                                 atomic_endianness=nic.atomic_endianness)
        self.dev.set_peer_qp(PEER, self.qpd, self.remote_base, self.remote_mr.rkey)
        self.status, self.peers, self.ctx = self.dev.status, self.dev.peers, self.dev.ctx

    def sym(self, nbytes, align=64):
        """Offset of a fresh symmetric range of ``nbytes`` (same offset in both heaps)."""
        off = (self._top + align - 1) & ~(align - 1)
        if off + nbytes > self.heap_bytes:
            raise MemoryError("loopback heap full: pass a larger heap_bytes")
        self._top = off + nbytes
        return off

    def reset_heap(self, keep=0):
        """Forget allocations above offset ``keep`` (no zeroing)."""
        self._top = keep

    def heads(self):
        """(resv_head, ready_head, db_head, done_head) of PE 0's QP."""
        return self.qpd.heads()

    def clear_status(self):
        self.dev.clear_status()
