"""A two-PE world inside one process on the soft NIC: what the device QP tests and benchmarks run on.

PE 0 (the device code under test) posts on QP ``a``; PE 1 is QP ``b``, its RC peer, on the same
SoftNic or on a second one (``peer_nic``: then ``peer_nic.mark_down()`` is a dead peer). Each PE
has a symmetric heap of ``heap_bytes`` registered with its NIC; :meth:`sym` hands out the same
offset in both, so a symmetric address ``local_base + off`` names ``local[off]`` here and
``remote[off]`` on PE 1. The device descriptors (QpDesc, its slot arrays, DevCtx, PeerDesc[2],
Status) live in plain 64-byte-aligned host memory: the HOST arm's "device memory".
"""
import numpy as np

from gpunet.device import abi
from gpunet.host.rawmem import address_of

PEER = 1                      # the PE device code targets
SCRATCH_SLOTS = 1024          # atomic result slots: one per thread that may call atomic_fetch_add


class Loopback:
    """Args: nic (SoftNic of PE 0); sq_wqebbs (ring depth); collapsed (CQ mode); db_batch;
    timeout_s (device waits); heap_bytes; kind (memory kind of both heaps); peer_nic (default nic);
    max_inline (QP limit); max_wqe_bytes (DevCtx split size, 0 = 1 GiB)."""

    def __init__(self, nic, sq_wqebbs=64, collapsed=False, db_batch=1, timeout_s=5.0,
                 heap_bytes=1 << 20, kind="host", peer_nic=None, max_inline=256, max_wqe_bytes=0):
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

        self.qp = abi.alloc_struct(abi.QpDesc)
        self.slot_db = np.zeros(sq_wqebbs, dtype=np.uint64)
        self.slot_nbb = np.zeros(sq_wqebbs, dtype=np.uint32)
        q = self.qp
        q.sq, q.dbrec, q.db = self.a.sq_addr, self.a.dbrec_addr, self.a.db_addr
        q.slot_db, q.slot_nbb = address_of(self.slot_db), address_of(self.slot_nbb)
        q.sq_wqebbs, q.qpn, q.peer, q.db_batch, q.max_inline = sq_wqebbs, self.a.qpn, PEER, db_batch, max_inline
        q.cq.buf, q.cq.dbrec, q.cq.cqe_cnt = self.cq.buf_addr, self.cq.dbrec_addr, self.cq.cqe_cnt
        q.cq.collapsed = int(collapsed)

        self.status = abi.alloc_struct(abi.Status)
        self.peers = abi.alloc_struct(abi.PeerDesc, 2)
        self.peers[PEER].qp = abi.addr_of(self.qp)
        self.peers[PEER].remote_base = self.remote_base
        self.peers[PEER].rkey = self.remote_mr.rkey
        self._top = 0
        scratch = self.sym(SCRATCH_SLOTS * 8)
        discard = self.sym(64)
        c = self.ctx = abi.alloc_struct(abi.DevCtx)
        c.local_base, c.heap_bytes, c.lkey = self.local_base, heap_bytes, self.local_mr.lkey
        c.npes, c.my_pe, c.scratch_slots = 2, 0, SCRATCH_SLOTS
        c.peers, c.status = abi.addr_of(self.peers), abi.addr_of(self.status)
        c.timeout_ns = int(timeout_s * 1e9)
        c.scratch, c.discard = self.local_base + scratch, self.local_base + discard
        c.max_wqe_bytes = max_wqe_bytes

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
        q = self.qp
        return int(q.resv_head), int(q.ready_head), int(q.db_head), int(q.done_head)

    def clear_status(self):
        ctypes_zero(self.status)


def ctypes_zero(obj):
    import ctypes
    ctypes.memset(ctypes.addressof(obj), 0, ctypes.sizeof(obj))


# --- the kernels of device/kernels/ops.cu -------------------------------------------------------
def load_ops(arch="host", defines=None):
    """Build (cached) and bind device/kernels/ops.cu for ``arch``; checks the struct sizes."""
    import ctypes

    from gpunet.device import loader
    from gpunet.errors import ToolchainError

    lib = loader.build([loader.kernels_dir() / "ops.cu"], arch=arch, defines=defines or {})
    if getattr(lib, "_gpunet_bound", False):
        return lib
    u32, u64, vp = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
    lib.gpunet_ops_abi_size.argtypes, lib.gpunet_ops_abi_size.restype = [u32], u32
    common = [u32, u32, u32, u32, u64, u32, u32, vp]
    lib.gpunet_ops_launch.argtypes = common + [vp, u32]
    lib.gpunet_ops_launch.restype = ctypes.c_int
    lib.gpunet_schedule_launch.argtypes = common + [vp]
    lib.gpunet_schedule_launch.restype = ctypes.c_int
    lib.gpunet_mix64.argtypes, lib.gpunet_mix64.restype = [u64, u64, u64, u64], u64
    lib.gpunet_poll_cq_once.argtypes, lib.gpunet_poll_cq_once.restype = [vp, vp], ctypes.c_int
    for i, name in enumerate(["Status", "CqDesc", "QpDesc", "PeerDesc", "DevCtx", "OpDesc", "SchedParams"]):
        got = lib.gpunet_ops_abi_size(i)
        if got != abi.SIZES[name]:
            raise ToolchainError("ops.cu was built with sizeof(%s) = %d, device/abi.py expects %d"
                                 % (name, got, abi.SIZES[name]))
    lib._gpunet_bound = True
    return lib


class Launch:
    """Launch geometry and the HOST weak-memory choices (ignored on GPUs)."""

    def __init__(self, grid=1, block=1, warp_size=32, weak=False, seed=0, order=0, sleep_ns=0):
        self.grid, self.block, self.warp_size = grid, block, warp_size
        self.weak, self.seed, self.order, self.sleep_ns = weak, seed, order, sleep_ns

    def args(self):
        return (self.grid, self.block, self.warp_size, int(self.weak), self.seed, self.order, self.sleep_ns)


def run_ops(lib, lb, ops, per_thread, launch, check=True):
    """Run ``ops`` (abi.OpDesc array, per_thread per thread) on ``lb``; raise the Status if ``check``."""
    import ctypes

    from gpunet.errors import GpunetError

    rc = lib.gpunet_ops_launch(*launch.args(), ctypes.addressof(lb.ctx), ctypes.addressof(ops), per_thread)
    if rc != 0:
        raise GpunetError("ops kernel launch failed (%d)" % rc)
    if check:
        abi.raise_for_status(lb.status, "ops kernel")


def run_schedule(lib, lb, params, launch, check=True):
    import ctypes

    from gpunet.errors import GpunetError

    rc = lib.gpunet_schedule_launch(*launch.args(), ctypes.addressof(lb.ctx), ctypes.addressof(params))
    if rc != 0:
        raise GpunetError("schedule kernel launch failed (%d)" % rc)
    if check:
        abi.raise_for_status(lb.status, "schedule kernel")
