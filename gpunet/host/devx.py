"""The real mlx5 NIC behind gpunet/host/nic.py's Nic: DevX queues on rings gpunet allocates.

**Nothing in this file has run on a NIC.** No machine here has an RDMA device. It is written from
the PRM layouts (gpunet/host/prm.py, checked against the kernel's mlx5_ifc.h), rdma-core 44's pyverbs API
and its DevX tests (tests/mlx5_base.py: Mlx5DevxRcResources) and the facts in FACTS.md. What has
run: tests/test_devx.py drives :class:`DevxNic` through tests/fake_devx.py, a recording stand-in
for the layer below, and decodes every PRM command DevxNic sends with gpunet/host/prm.py; the
:class:`PyverbsDevx` layer itself has run only as far as importing the pyverbs names it calls
(tests/test_devx.py::test_the_pyverbs_layer_names_exist_in_the_installed_pyverbs).

Two layers:

- :class:`PyverbsDevx` : one method per call into rdma-core: pyverbs (Debian's python3-pyverbs,
  host/verbs.import_pyverbs) for the DevX context, PD (+ its pdn through mlx5dv_init_obj), UAR,
  UMEM, DevX objects and general commands, EQN, ``ibv_reg_mr``; ctypes for
  ``ibv_reg_dmabuf_mr`` (pyverbs' DmaBufMR registers at iova = the dma-buf offset, and gpunet's
  WQEs carry the GPU virtual address as the iova). Bytes in, bytes out; every object it returns
  has ``close()``. A failure raises :class:`DevxCallError` (the call, errno, message).
- :class:`DevxNic` : the Nic: builds PRM commands with gpunet/host/prm.py and sends them through the
  layer above; owns the memory its rings live in.

What DevxNic does, in order (``__init__``): open the device with the DevX flag; QUERY_HCA_CAP
(general and atomic, current values: queue size limits, ``log_max_msg``, outstanding RDMA reads /
atomics, the 8-byte atomic endianness mode -> ``atomic_endianness``); query the port (link layer,
LID, active MTU; on Ethernet a RoCE v2 GID and the interface MAC); a PD and its pdn; a UAR
(non-cached first, BlueFlame on refusal or when asked); the completion EQN. Then per object:

- ``create_cq``: a CQE ring and a doorbell record, each registered as UMEM (one UMEM each, as
  rdma-core's DevX tests do), every ``op_own`` set to 0xF0 first; CREATE_CQ with ``cc`` and
  ``oi`` for a collapsed CQ (one slot, overrun ignored, as NVSHMEM's IBGDA polls it).
- ``create_qp``: an RC QP whose send queue is our ring (UMEM) and which has no receive queue
  (``rq_type`` zero-length; so RDMA WRITE with immediate, which needs a receive WQE at the
  responder, is not available on this NIC; gpunet's device code never posts it).
- ``connect``: RST2INIT (port, remote read / write / atomic enable, the atomic mode the caps
  allow), INIT2RTR (MTU = the smaller of both ports', the peer's QPN and PSN, the path: IB LID, or
  RoCE v2 GID + MAC + our GID index with GRH), RTR2RTS (our PSN, retry counts, ACK timeout from
  ``retry_timeout_s``). ``qp_state`` is QUERY_QP's ``qpc.state``; ``reset_qp`` is 2ERR (flush),
  a bounded wait for the flush CQEs, 2RST and the three moves again.
- Close, in rdma-core's DevX test order (Mlx5DevxRcResources.devx_objs): QPs, CQs, UARs, UMEMs;
  then the MRs, the PD, the device context.

Memory: rings, doorbell records and everything ``alloc`` returns live in one anonymous host
mapping per NIC (the "arena", ``mapped_ranges()``), the kind gpunet/host/platform.py's coherence policy
names for ``sq`` / ``cq`` / ``dbrec`` on both profiles. Should the policy (or ``ring_kind``) name
a GPU kind on CUDA, the ring is allocated there and registered as UMEM, and where the driver
refuses, the ring moves to host memory and the log says why (Mooncake saw DevX refuse GPU-address
queue memory on the C500, so the c500 profile never tries). A ring accepted in GPU memory has no
host view (``sq`` / ``buf`` None): the CPU proxy cannot post on it.

The same WQE bytes as the soft NIC's go into these rings (gpunet/mlx5.py, device/mlx5.cuh): the
doorbell protocol is mlx5's own (docs/INTERFACES.md), and ``qp.db_addr`` is the UAR's doorbell
register (``reg_addr``, UAR page + 0x800). With a BlueFlame UAR gpunet still writes only the 8-byte
doorbell at ``reg_addr`` (no alternating BlueFlame buffer, no WQE copy).
"""
import ctypes
import ctypes.util
import logging
import math
import mmap
import os
import threading
import time

import numpy as np

from gpunet import mlx5
from gpunet.errors import ClosedError, CloseError, ConfigError, GpunetError
from gpunet.host import prm
from gpunet.host.nic import Access, Nic, mr_region
from gpunet.host.verbs import NoRdmaDeviceError

log = logging.getLogger("gpunet.devx")

PAGE = 4096                      # UMEM and ring alignment: log_page_size 0 means 4 KiB pages
DBREC_SLOT = 64                  # one doorbell record per 64 bytes (a cache line of its own)
MIN_SQ_WQEBBS = 8
MAX_INLINE_LIMIT = mlx5.MAX_DS * mlx5.DS_UNIT - 32 - mlx5.INLINE_HDR_SIZE   # as the soft NIC's
# Retry counts of RTR2RTS: 7 is the largest the 3-bit fields hold. rnr_retry 7 means "retry
# forever" in IB; with no receive queue in use there is no RNR NAK to retry.
RETRY_COUNT = 7
RNR_RETRY = 7
MIN_RNR_NAK = 12                 # 0.64 ms (IB encoding), rdma-core's tests' MIN_RNR_TIMER
HOP_LIMIT = 64                   # RoCE v2 GRH hop limit
FLUSH_QUIET_S = 0.005            # reset_qp: the send CQ must stay unchanged this long after 2ERR

_QP_STATES = {prm.MLX5_QPC_STATE_RST: "RESET", prm.MLX5_QPC_STATE_INIT: "INIT",
              prm.MLX5_QPC_STATE_RTR: "RTR", prm.MLX5_QPC_STATE_RTS: "RTS",
              prm.MLX5_QPC_STATE_SQER: "SQER", prm.MLX5_QPC_STATE_ERR: "ERR",
              prm.MLX5_QPC_STATE_SQD: "SQD"}
_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}   # ibv_mtu == qpc.mtu encoding


class DevxCallError(GpunetError):
    """A call into rdma-core failed (raised by the layer below DevxNic): ``call``, ``errno``."""

    def __init__(self, call, errno=None, message=""):
        super().__init__("%s failed%s%s" % (call, " (errno %d: %s)" % (errno, os.strerror(errno))
                                            if errno else "", ": %s" % message if message else ""))
        self.call, self.errno = call, errno


class NoDevxError(ConfigError):
    """The RDMA device cannot be opened with mlx5 DevX (not an mlx5 device, a kernel or firmware
    without DevX, or no permission)."""


class DevxCommandError(GpunetError):
    """A PRM command failed: ``opcode``, ``status`` and ``syndrome`` (the firmware's), or the
    call's ``errno`` when the kernel refused it before the firmware answered."""

    def __init__(self, message, opcode=None, status=None, syndrome=None, errno=None):
        super().__init__(message)
        self.opcode, self.status, self.syndrome, self.errno = opcode, status, syndrome, errno


class UmemError(ConfigError):
    """DevX refused to register memory as UMEM for a ring or doorbell record."""


class UarError(ConfigError):
    """No UAR (doorbell page) could be allocated with DevX."""


class RegistrationError(ConfigError):
    """Memory could not be registered with the NIC by any of the ways tried (each is named)."""


# --------------------------------------------------------------------------------------------
# The layer below: rdma-core through pyverbs (and ctypes for ibv_reg_dmabuf_mr).
# NOT RUN ON A NIC: each method is one documented pyverbs call, written from rdma-core 44's API.
# --------------------------------------------------------------------------------------------

class _IbvMr(ctypes.Structure):
    """struct ibv_mr (infiniband/verbs.h): what ibv_reg_dmabuf_mr returns."""
    _fields_ = [("context", ctypes.c_void_p), ("pd", ctypes.c_void_p), ("addr", ctypes.c_void_p),
                ("length", ctypes.c_size_t), ("handle", ctypes.c_uint32),
                ("lkey", ctypes.c_uint32), ("rkey", ctypes.c_uint32)]


class _DmabufMr:
    """An MR from ibv_reg_dmabuf_mr: ``lkey``, ``rkey``; ``close()`` is ibv_dereg_mr (once)."""

    def __init__(self, lib, ptr):
        self._lib, self._ptr = lib, ptr
        mr = ctypes.cast(ptr, ctypes.POINTER(_IbvMr)).contents
        self.lkey, self.rkey = int(mr.lkey), int(mr.rkey)

    def close(self):
        if self._ptr:
            rc = self._lib.ibv_dereg_mr(self._ptr)
            self._ptr = None
            if rc:
                raise DevxCallError("ibv_dereg_mr", rc)


class PyverbsDevx:
    """rdma-core for one device, through pyverbs: the calls DevxNic makes, one method each.

    Not run on a NIC (none here). Every method raises DevxCallError on failure; objects it returns
    have ``close()``. tests/fake_devx.py implements the same methods for the tests.
    """

    def __init__(self):
        from gpunet.host import verbs
        verbs.import_pyverbs()           # ToolchainError naming python3-pyverbs when missing
        self.ctx = self.name = None
        self._ibv = None

    @staticmethod
    def _call(what, fn, *args, **kw):
        from pyverbs.pyverbs_error import PyverbsError
        try:
            return fn(*args, **kw)
        except PyverbsError as e:
            raise DevxCallError(what, getattr(e, "error_code", None) or None, str(e)) from e

    def devices(self):
        from gpunet.host import verbs
        return verbs.available_devices()

    def open(self, name):
        """mlx5dv_open_device(MLX5DV_CONTEXT_FLAGS_DEVX)."""
        from pyverbs.providers.mlx5 import mlx5_enums as dve
        from pyverbs.providers.mlx5.mlx5dv import Mlx5Context, Mlx5DVContextAttr
        self.ctx = self._call("mlx5dv_open_device(%s, DEVX)" % name, Mlx5Context,
                              Mlx5DVContextAttr(flags=dve.MLX5DV_CONTEXT_FLAGS_DEVX), name=name)
        self.name = name
        return self.ctx

    def query_port(self, port):
        """ibv_query_port: {"state", "lid", "link_layer" ("IB" | "Ethernet"), "active_mtu"
        (ibv_mtu: 1..5), "gid_tbl_len"}."""
        import pyverbs.enums as e
        a = self._call("ibv_query_port(%d)" % port, self.ctx.query_port, port)
        return {"state": int(a.state), "lid": int(a.lid), "active_mtu": int(a.active_mtu),
                "link_layer": "Ethernet" if a.link_layer == e.IBV_LINK_LAYER_ETHERNET else "IB",
                "gid_tbl_len": int(a.gid_tbl_len)}

    def gid(self, port, index):
        """ibv_query_gid: the 16 GID bytes in wire order (pyverbs prints them as 8 hex groups)."""
        g = self._call("ibv_query_gid(%d, %d)" % (port, index), self.ctx.query_gid, port, index)
        return bytes.fromhex(str(g.gid).replace(":", ""))

    def gid_type(self, port, index):
        """"RoCE v2" | "IB/RoCE v1" (ibv_query_gid_type)."""
        import pyverbs.enums as e
        t = self._call("ibv_query_gid_type(%d, %d)" % (port, index), self.ctx.query_gid_type,
                       port, index)
        return "RoCE v2" if t == e.IBV_GID_TYPE_SYSFS_ROCE_V2 else "IB/RoCE v1"

    def port_mac(self, port, gid_index):
        """The MAC of the network interface behind GID ``gid_index`` (sysfs gid_attrs/ndevs), as
        6 bytes, or None. DevX QPs on RoCE take the peer's MAC in their path (no kernel
        resolves it)."""
        base = "/sys/class/infiniband/%s/ports/%d/gid_attrs/ndevs/%d" % (self.name, port, gid_index)
        try:
            with open(base) as f:
                ndev = f.read().strip()
            with open("/sys/class/net/%s/address" % ndev) as f:
                return bytes.fromhex(f.read().strip().replace(":", ""))
        except (OSError, ValueError):
            return None

    def alloc_pd(self):
        """ibv_alloc_pd, and its PD number (mlx5dv_init_obj(MLX5DV_OBJ_PD)): (pd, pdn)."""
        from pyverbs.pd import PD
        from pyverbs.providers.mlx5 import mlx5_enums as dve
        from pyverbs.providers.mlx5.mlx5dv_objects import Mlx5DvObj
        pd = self._call("ibv_alloc_pd", PD, self.ctx)
        try:
            pdn = self._call("mlx5dv_init_obj(PD)", Mlx5DvObj, dve.MLX5DV_OBJ_PD, pd=pd).dvpd.pdn
        except BaseException:
            pd.close()
            raise
        return pd, int(pdn)

    def alloc_uar(self, nc):
        """mlx5dv_devx_alloc_uar(NC | BF): ``page_id``, ``reg_addr``, ``base_addr``."""
        from pyverbs.providers.mlx5 import mlx5_enums as dve
        from pyverbs.providers.mlx5.mlx5dv import Mlx5UAR
        flags = dve._MLX5DV_UAR_ALLOC_TYPE_NC if nc else dve._MLX5DV_UAR_ALLOC_TYPE_BF
        return self._call("mlx5dv_devx_alloc_uar(%s)" % ("NC" if nc else "BF"), Mlx5UAR,
                          self.ctx, flags)

    def umem_reg(self, addr, size, access):
        """mlx5dv_devx_umem_reg(addr, size, access): ``umem_id``."""
        from pyverbs.providers.mlx5.mlx5dv import Mlx5UMEM
        return self._call("mlx5dv_devx_umem_reg(0x%x, %d)" % (addr, size), Mlx5UMEM, self.ctx,
                          size=size, addr=addr, access=access)

    def query_eqn(self, vector):
        """mlx5dv_devx_query_eqn(vector)."""
        return int(self._call("mlx5dv_devx_query_eqn(%d)" % vector, self.ctx.devx_query_eqn,
                              vector))

    def general_cmd(self, inbuf, outlen):
        """mlx5dv_devx_general_cmd: the output bytes."""
        return self._call("mlx5dv_devx_general_cmd", self.ctx.devx_general_cmd, bytes(inbuf),
                          outlen)

    def obj_create(self, inbuf, outlen):
        """mlx5dv_devx_obj_create: (object, output bytes); ``object.close()`` destroys it."""
        from pyverbs.providers.mlx5.mlx5dv import Mlx5DevxObj
        obj = self._call("mlx5dv_devx_obj_create", Mlx5DevxObj, self.ctx, bytes(inbuf), outlen)
        return obj, bytes(obj.out_view)

    def obj_modify(self, obj, inbuf, outlen):
        return self._call("mlx5dv_devx_obj_modify", obj.modify, bytes(inbuf), outlen)

    def obj_query(self, obj, inbuf, outlen):
        return self._call("mlx5dv_devx_obj_query", obj.query, bytes(inbuf), outlen)

    def reg_mr(self, pd, addr, length, access):
        """ibv_reg_mr(pd, addr, length, access): ``lkey``, ``rkey``."""
        from pyverbs.mr import MR
        return self._call("ibv_reg_mr(0x%x, %d)" % (addr, length), MR, pd, length, access,
                          address=addr)

    def reg_dmabuf_mr(self, pd, offset, length, iova, fd, access):
        """ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access) through ctypes."""
        if self._ibv is None:
            lib = ctypes.CDLL(ctypes.util.find_library("ibverbs") or "libibverbs.so.1",
                              use_errno=True)
            lib.ibv_reg_dmabuf_mr.restype = ctypes.c_void_p
            lib.ibv_reg_dmabuf_mr.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t,
                                              ctypes.c_uint64, ctypes.c_int, ctypes.c_int]
            lib.ibv_dereg_mr.argtypes = [ctypes.c_void_p]
            self._ibv = lib
        ptr = self._ibv.ibv_reg_dmabuf_mr(ctypes.c_void_p(pd.pd), offset, length, iova, fd, access)
        if not ptr:
            raise DevxCallError("ibv_reg_dmabuf_mr(fd %d, iova 0x%x, %d)" % (fd, iova, length),
                                ctypes.get_errno())
        return _DmabufMr(self._ibv, ptr)


def _pyverbs_backend():
    return PyverbsDevx()


# The layer open_nic gives DevxNic: a callable returning a fresh one (tests/test_devx.py swaps in
# tests/fake_devx.FakeDevx here to drive open_nic without a NIC).
BACKEND = _pyverbs_backend


# --------------------------------------------------------------------------------------------
# The NIC's objects (gpunet/host/nic.py names the attributes device descriptors and the proxy read).
# --------------------------------------------------------------------------------------------

class DevxPD:
    """A protection domain: ``pdn`` (the number PRM commands carry)."""

    def __init__(self, nic, handle, pdn):
        self.nic, self.handle, self.pdn = nic, handle, pdn

    def __repr__(self):
        return "DevxPD(%d)" % self.pdn


class DevxMR:
    """A registered region: ``addr``, ``length``, ``lkey``, ``rkey``, ``access``, ``kind``, ``how``
    ("ibv_reg_mr" | "dma-buf" | "peer memory")."""

    def __init__(self, nic, handle, addr, length, access, kind, pd, how, keepalive):
        self.nic, self.handle, self.addr, self.length = nic, handle, addr, length
        self.lkey, self.rkey = int(handle.lkey), int(handle.rkey)
        self.access, self.kind, self.pd, self.how = access, kind, pd, how
        self._keepalive = keepalive

    def __repr__(self):
        return "DevxMR(lkey=0x%x, addr=0x%x, length=%d, %s)" % (self.lkey, self.addr,
                                                               self.length, self.how)


class _Region:
    """Memory one ring or doorbell record lives in: ``addr`` (what the NIC and the GPU use),
    ``view`` (np.uint8 host view, or None for GPU memory), ``umem``, ``kind``, ``alloc`` (the
    platform Allocation of a GPU ring, else None)."""

    def __init__(self, addr, view, umem, kind, alloc=None):
        self.addr, self.view, self.umem, self.kind, self.alloc = addr, view, umem, kind, alloc


class DevxCQ:
    """A CQ: ``cqn``, ``buf`` (uint8[cqe_cnt * 64], None in GPU memory), ``buf_addr``,
    ``cqe_cnt``, ``dbrec`` (uint8[8]), ``dbrec_addr``, ``collapsed``."""

    def __init__(self, nic, cqn, obj, ring, dbr, cqe_cnt, collapsed):
        self.nic, self.cqn, self.obj, self.ring, self.dbr = nic, cqn, obj, ring, dbr
        self.buf = None if ring.view is None else ring.view[:cqe_cnt * mlx5.CQE_SIZE]
        self.buf_addr, self.cqe_cnt, self.collapsed = ring.addr, cqe_cnt, collapsed
        self.dbrec = None if dbr.view is None else dbr.view[:mlx5.DBREC_SIZE]
        self.dbrec_addr = dbr.addr

    def __repr__(self):
        return "DevxCQ(cqn=%d, cqe_cnt=%d%s)" % (self.cqn, self.cqe_cnt,
                                                 ", collapsed" if self.collapsed else "")


class DevxQP:
    """An RC QP: ``qpn``, ``sq`` (uint8[sq_wqebbs * 64], None in GPU memory), ``sq_addr``,
    ``sq_wqebbs``, ``dbrec`` / ``dbrec_addr``, ``db_addr`` (the UAR doorbell register),
    ``send_cq``, ``recv_cq``, ``max_inline``, ``pd``, ``psn`` (our first PSN); ``info()``."""

    def __init__(self, nic, qpn, obj, ring, dbr, sq_wqebbs, send_cq, recv_cq, max_inline, pd, psn):
        self.nic, self.qpn, self.obj, self.ring, self.dbr = nic, qpn, obj, ring, dbr
        self.sq = None if ring.view is None else ring.view[:sq_wqebbs * mlx5.WQEBB]
        self.sq_addr, self.sq_wqebbs = ring.addr, sq_wqebbs
        self.dbrec = None if dbr.view is None else dbr.view[:mlx5.DBREC_SIZE]
        self.dbrec_addr, self.db_addr = dbr.addr, nic.uar.reg_addr
        self.send_cq, self.recv_cq, self.max_inline, self.pd, self.psn = (send_cq, recv_cq,
                                                                          max_inline, pd, psn)
        self.remote = None               # the peer's info() once connected

    def info(self):
        """What a peer's ``connect`` needs (picklable): the QPN and first PSN, the port's LID,
        GID, GID index, MAC, MTU and link layer."""
        n = self.nic
        return {"nic": "devx", "device": n.device, "port": n.port, "qpn": self.qpn,
                "psn": self.psn, "lid": n.lid, "gid": n.gid.hex(), "gid_index": n.gid_index,
                "mac": None if n.mac is None else n.mac.hex(), "mtu": n.active_mtu,
                "link_layer": n.link_layer}

    def __repr__(self):
        return "DevxQP(qpn=%d, sq_wqebbs=%d)" % (self.qpn, self.sq_wqebbs)


class _Arena:
    """One anonymous host mapping: rings, doorbell records and ``alloc`` buffers (bump allocated,
    never freed, zeroed by the kernel). Its pages are what the GPU maps (``mapped_ranges``)."""

    def __init__(self, nbytes):
        self.size = (int(nbytes) + PAGE - 1) & ~(PAGE - 1)
        self._mm = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.u8 = np.frombuffer(self._mm, dtype=np.uint8)
        self.base = int(self.u8.ctypes.data)
        self._top = 0
        self._lock = threading.Lock()

    def take(self, nbytes, align):
        if nbytes < 0 or align <= 0 or align & (align - 1):
            raise ConfigError("alloc: nbytes must be >= 0 and align a power of two")
        with self._lock:
            off = (self._top + align - 1) & ~(align - 1)
            if off + nbytes > self.size:
                raise ConfigError("the DevX NIC's host arena is full (%d bytes): open it with a "
                                  "larger arena_bytes" % self.size)
            self._top = off + nbytes
        return self.u8[off:off + nbytes]

    def holds(self, addr, nbytes):
        return self.base <= addr and addr + nbytes <= self.base + self.size

    def close(self):
        self.u8 = None
        try:
            self._mm.close()
        except BufferError:
            pass                         # a view handed out is still alive: unmapped with it


def _log2_exact(n, what):
    if n < 1 or n & (n - 1):
        raise ConfigError("%s must be a power of two, not %r" % (what, n))
    return n.bit_length() - 1


def ack_timeout_for(retry_timeout_s, retry_count=RETRY_COUNT):
    """The qpc ACK timeout exponent t (the NIC waits 4.096 us * 2**t per try) such that the
    ``retry_count + 1`` tries of a lost packet take at most ``retry_timeout_s`` (at least 1 us *
    2**8, so a busy fabric is not taken for a dead peer), capped at 31."""
    per_try = float(retry_timeout_s) / ((retry_count + 1) * 4.096e-6)
    t = int(math.floor(math.log2(per_try))) if per_try >= 1 else 0
    return max(8, min(31, t))


class DevxNic(Nic):
    """A real mlx5 NIC driven through DevX (module docstring: what it does; never run on a NIC).

    Args:
        device: the RDMA device (e.g. "mlx5_0"), or None for the first one.
        port: the port (1-based).
        gid_index: RoCE only: the GID to use (default: the first RoCE v2 GID, IPv4-mapped first).
        uar: "auto" (non-cached, BlueFlame where NC is refused), "nc" or "bf".
        ring_kind: the memory kind of the rings and doorbell records; None: gpunet/host/platform.py's
            policy for "sq" / "cq" / "dbrec" (host memory on both profiles today).
        profile: the coherence profile ("nvidia" | "c500"; default: the platform's).
        arena_bytes: the host mapping for rings and ``alloc`` (sparse: pages are touched on use).
        retry_timeout_s: how long a peer may stay silent before the QP fails with "transport retry
            counter exceeded" (sets the ACK timeout).
        platform: gpunet/host/platform.py's Platform (default: get_platform()).
        backend: the layer below (default: PyverbsDevx(); tests pass tests/fake_devx.FakeDevx).

    Raises NoRdmaDeviceError (no device), ToolchainError (no pyverbs), NoDevxError (the device
    cannot be opened with DevX), UarError, DevxCommandError (a capability query failed).
    """

    def __init__(self, device=None, port=1, *, gid_index=None, uar="auto", ring_kind=None,
                 profile=None, arena_bytes=64 << 20, retry_timeout_s=1.0, name=None,
                 platform=None, backend=None):
        if uar not in ("auto", "nc", "bf"):
            raise ConfigError("uar must be 'auto', 'nc' or 'bf', not %r" % (uar,))
        if not retry_timeout_s > 0:
            raise ConfigError("retry_timeout_s must be > 0")
        self._lists = {k: [] for k in ("qp", "cq", "uar", "umem", "mr", "pd", "ctx")}
        self._arena = self._gpu_allocs = self._uar_mapping = None
        self._lock = threading.Lock()
        self.name = name
        self._gid_index_asked, self._uar_asked = gid_index, uar
        self._ring_kind_asked, self._arena_bytes = ring_kind, int(arena_bytes)
        self.ring_placement = {}         # role -> (kind, why): where rings and records live
        if platform is None:
            from gpunet.host.platform import get_platform
            platform = get_platform()
        self.platform = platform
        self.profile = profile or platform.profile
        self.retry_timeout_s = float(retry_timeout_s)
        self._b = backend if backend is not None else BACKEND()
        devices = self._b.devices()
        if not devices:
            raise NoRdmaDeviceError("no RDMA device found; use nic='soft'")
        if device is None:
            device = devices[0]
        elif device not in devices:
            raise NoRdmaDeviceError("RDMA device %r not found (this host has %s); pick one of "
                                    "those or use nic='soft'" % (device, ", ".join(devices)))
        self.device, self.port = device, int(port)
        try:
            ctx = self._b.open(device)
        except DevxCallError as e:
            raise NoDevxError("opening %s with mlx5 DevX failed (%s). gpunet drives the NIC with "
                              "DevX: it needs an mlx5 device (ConnectX-4 or later), a kernel and "
                              "firmware with DevX, and permission to use it; use nic='soft' "
                              "otherwise." % (device, e)) from e
        self._lists["ctx"].append(ctx)
        try:
            self._open()
        except BaseException:
            try:
                self.close()
            except CloseError as ce:
                log.warning("DevX NIC %s: cleaning up after a failed open: %s", device, ce)
            raise

    # --- opening ---------------------------------------------------------------------------
    def _open(self):
        self.caps = self._query_caps()
        e = self.caps["atomic_req_8B_endianness_mode"]
        self.atomic_endianness = "host" if e == prm.ATOMIC_REQ_8B_ENDIANNESS_HOST else "big"
        if self.atomic_endianness == "big":
            log.warning("DevX NIC %s: 8-byte atomics are big-endian (atomic_req_8B_endianness_mode"
                        "=%d%s): signal words are big-endian on this NIC", self.device, e,
                        "; host endianness is supported but not enabled by the driver"
                        if self.caps["supported_atomic_req_8B_endianness_mode_1"] else
                        "; the NIC offers no host-endian mode")
        self.atomic_mode = self._atomic_mode()
        self._open_port()
        pd, pdn = self._b.alloc_pd()
        self._lists["pd"].append(pd)
        self.default_pd = DevxPD(self, pd, pdn)
        self.uar, self.uar_type = self._alloc_uar()
        self.eqn = self._b.query_eqn(0)
        self._arena = _Arena(self._arena_bytes)

    def _query_caps(self):
        """QUERY_HCA_CAP, current values: general device and atomic caps (and RoCE caps where the
        device has RoCE: the QP timestamp format)."""
        out = {}
        for cap, struct, fields in (
                (prm.MLX5_SET_HCA_CAP_OP_MOD_GENERAL_DEVICE, "cmd_hca_cap",
                 ("log_max_qp_sz", "log_max_cq_sz", "log_max_msg", "log_max_ra_req_qp",
                  "log_max_ra_res_qp", "atomic", "roce", "port_type", "umem_uid_0", "uar_4k",
                  "log_bf_reg_size", "cq_oi")),
                (prm.MLX5_SET_HCA_CAP_OP_MOD_ATOMIC, "atomic_caps",
                 ("atomic_req_8B_endianness_mode", "supported_atomic_req_8B_endianness_mode_1",
                  "atomic_operations", "atomic_size_qp"))):
            cmd = prm.cmd_query_hca_cap(prm.hca_cap_op_mod(cap, current=True))
            res = self._general(cmd, prm.MLX5_CMD_OP_QUERY_HCA_CAP, "QUERY_HCA_CAP(%s)" % struct)
            for f in fields:
                out[f] = prm.get(res, "query_hca_cap_out", "capability.%s.%s" % (struct, f))
        out["qp_ts_format"] = 0
        if out["roce"]:                  # the kernel reads RoCE caps only where roce is set
            cmd = prm.cmd_query_hca_cap(prm.hca_cap_op_mod(prm.MLX5_SET_HCA_CAP_OP_MOD_ROCE))
            res = self._general(cmd, prm.MLX5_CMD_OP_QUERY_HCA_CAP, "QUERY_HCA_CAP(roce_cap)")
            out["qp_ts_format"] = prm.get(res, "query_hca_cap_out",
                                          "capability.roce_cap.qp_ts_format")
        return out

    def _atomic_mode(self):
        """qpc.atomic_mode as the kernel chooses it (mlx5_ib get_atomic_mode): 8B with extended
        atomics and 8-byte QP atomics, IB-compatible with plain compare-swap + fetch-add, else
        none (remote atomics then fail; logged)."""
        c = self.caps
        ops = c["atomic_operations"]
        if not c["atomic"]:
            log.warning("DevX NIC %s reports no atomics (cmd_hca_cap.atomic=0): atomic_add and "
                        "ADD signals over this NIC will fail", self.device)
            return 0
        # extended (masked) compare-swap or fetch-add with 8-byte QP atomics: the kernel picks 8B
        if ops & (prm.MLX5_ATOMIC_OPS_EXTENDED_CMP_SWAP | prm.MLX5_ATOMIC_OPS_EXTENDED_FETCH_ADD) \
                and c["atomic_size_qp"] & prm.MLX5_ATOMIC_CAPS_ATOMIC_SIZE_QP_8_BYTES:
            return prm.MLX5_ATOMIC_MODE_8B
        if ops & prm.MLX5_ATOMIC_OPS_CMP_SWAP and ops & prm.MLX5_ATOMIC_OPS_FETCH_ADD:
            return prm.MLX5_ATOMIC_MODE_IB_COMP
        log.warning("DevX NIC %s: atomic_operations=0x%x lacks compare-swap / fetch-add: remote "
                    "atomics will fail", self.device, ops)
        return 0

    def _open_port(self):
        p = self._b.query_port(self.port)
        self.link_layer, self.lid, self.active_mtu = p["link_layer"], p["lid"], p["active_mtu"]
        self.gid, self.gid_index, self.mac = bytes(16), 0, None
        if self.link_layer != "Ethernet":
            return
        n = p["gid_tbl_len"]
        if self._gid_index_asked is not None:
            cands = [self._gid_index_asked]
        else:
            cands = [i for i in range(n) if self._b.gid_type(self.port, i) == "RoCE v2"
                     and any(self._b.gid(self.port, i))]
            v4 = [i for i in cands if self._b.gid(self.port, i)[:12] == bytes(10) + b"\xff\xff"]
            cands = v4 + [i for i in cands if i not in v4]
        if not cands:
            raise ConfigError("DevX NIC %s port %d (RoCE): no RoCE v2 GID is configured (give the "
                              "interface an IP address), or pass gid_index" % (self.device,
                                                                              self.port))
        self.gid_index = cands[0]
        self.gid = bytes(self._b.gid(self.port, self.gid_index))
        self.mac = self._b.port_mac(self.port, self.gid_index)
        if self.mac is None:
            raise ConfigError("DevX NIC %s port %d GID %d: the interface's MAC address cannot be "
                              "read from sysfs; a DevX QP on RoCE needs it in its path"
                              % (self.device, self.port, self.gid_index))

    def _alloc_uar(self):
        """Non-cached first (a doorbell is one 8-byte store; no write-combining buffer to flush),
        BlueFlame where NC is refused (older kernels) or asked for."""
        tried = []
        for nc in {"auto": (True, False), "nc": (True,), "bf": (False,)}[self._uar_asked]:
            try:
                u = self._b.alloc_uar(nc)
            except DevxCallError as e:
                tried.append(str(e))
                if nc and self._uar_asked == "auto":
                    log.info("DevX NIC %s: a non-cached UAR was refused (%s); trying BlueFlame",
                             self.device, e)
                continue
            self._lists["uar"].append(u)
            if not u.page_id:
                tried.append("UAR page id 0")
                continue
            return u, "nc" if nc else "bf"
        raise UarError("DevX NIC %s: no UAR could be allocated (%s); the NIC's doorbell page is "
                       "needed for every queue; use nic='soft'" % (self.device, "; ".join(tried)))

    # --- commands ----------------------------------------------------------------------------
    @staticmethod
    def _check_out(out, opcode, what):
        status, syndrome = prm.cmd_status(out)
        if status != prm.MLX5_CMD_STAT_OK:
            raise DevxCommandError("%s failed: status 0x%x, syndrome 0x%x" % (what, status,
                                                                              syndrome),
                                   opcode, status, syndrome)
        return out

    def _general(self, cmd, opcode, what):
        try:
            out = self._b.general_cmd(cmd, prm.out_size(opcode))
        except DevxCallError as e:
            raise DevxCommandError("%s failed: %s" % (what, e), opcode, errno=e.errno) from e
        return self._check_out(out, opcode, what)

    def _create(self, cmd, opcode, what):
        try:
            obj, out = self._b.obj_create(cmd, prm.out_size(opcode))
        except DevxCallError as e:
            raise DevxCommandError("%s failed: %s" % (what, e), opcode, errno=e.errno) from e
        try:
            self._check_out(out, opcode, what)
        except DevxCommandError:
            obj.close()
            raise
        return obj, out

    def _modify(self, obj, cmd, opcode, what):
        try:
            out = self._b.obj_modify(obj, cmd, prm.out_size(opcode))
        except DevxCallError as e:
            raise DevxCommandError("%s failed: %s" % (what, e), opcode, errno=e.errno) from e
        return self._check_out(out, opcode, what)

    def _check_open(self):
        if self.closed:
            raise ClosedError("DevX NIC %s is closed; open a new one" % self.device)

    # --- memory --------------------------------------------------------------------------------
    def alloc(self, nbytes, align=64):
        """A zeroed np.uint8 view of ``nbytes`` in the NIC's host arena (never freed)."""
        self._check_open()
        return self._arena.take(int(nbytes), int(align))

    def mapped_ranges(self):
        """The host arena: every host ring, CQ, doorbell record and ``alloc`` buffer is in it.
        The UAR page is not (MMIO: ``map_doorbell`` maps it with IoMemory)."""
        self._check_open()
        return [(self._arena.base, self._arena.size)]

    def _umem(self, addr, nbytes):
        u = self._b.umem_reg(addr, nbytes, int(Access.LOCAL_WRITE))
        self._lists["umem"].append(u)
        return u

    def _ring_kind(self, role):
        if self._ring_kind_asked is not None:
            kind = self._ring_kind_asked
        else:
            kind = self.platform.policy(role).kind if self.platform.name != "cpu" else "host"
        if kind not in ("host", "device", "finegrained"):
            raise ConfigError("ring_kind must be 'host', 'device' or 'finegrained', not %r" % kind)
        if kind != "host" and self.profile == "c500":
            raise ConfigError("ring_kind=%r on the c500 profile: Mooncake saw DevX CREATE_QP "
                              "refuse queue memory at a GPU address on the C500, so rings stay "
                              "in host memory there" % kind)
        if kind != "host" and self.platform.name == "cpu":
            kind = "host"                # the CPU platform's every kind is host memory
        return kind

    def _region(self, role, nbytes, align):
        """Memory for a ring / doorbell record of ``role`` ("sq" | "cq" | "dbrec"), registered as
        UMEM: GPU memory where the kind says so and the driver accepts it, else the host arena."""
        kind = self._ring_kind(role)
        if kind != "host":
            a = self.platform.alloc(kind, max(nbytes, PAGE))
            try:
                u = self._b.umem_reg(a.ptr, max(nbytes, PAGE), int(Access.LOCAL_WRITE))
            except DevxCallError as e:
                a.close()
                why = ("DevX refused UMEM in %s memory for the %s (%s); it lives in host memory "
                       "instead" % (kind, role, e))
                log.warning("DevX NIC %s: %s", self.device, why)
                self.ring_placement[role] = ("host", why)
            else:
                self._lists["umem"].append(u)
                self._gpu_allocs = (self._gpu_allocs or []) + [a]
                self.ring_placement[role] = (kind, "accepted by DevX")
                return _Region(a.ptr, None, u, kind, a)
        else:
            self.ring_placement.setdefault(role, ("host", "the coherence policy's kind"))
        view = self._arena.take(nbytes, align)
        return _Region(int(view.ctypes.data), view, self._umem(int(view.ctypes.data), nbytes),
                       "host")

    def reg_mr(self, buf_or_addr, length=None, access=Access.ALL, kind="host", pd=None,
               device_memory=False):
        """Register memory (an array / tensor, or an address + ``length``).

        Host memory (``kind`` "host", anything in the arena, every kind on the CPU platform):
        ibv_reg_mr. GPU memory ("device" / "finegrained" outside the arena on a GPU, or any
        range passed with ``device_memory=True``: the Context's CUDA heap): a dma-buf export by
        the platform (cuMemGetHandleForAddressRange; the MACA one unverified) and
        ibv_reg_dmabuf_mr at iova = the GPU address; where either refuses, plain ibv_reg_mr (a
        peer-memory driver such as nvidia-peermem accepts GPU addresses); RegistrationError (a
        ConfigError) naming both failures otherwise. ``device_memory=True`` for a range that
        cannot be GPU memory (the CPU platform, or inside this NIC's host arena) is a
        ConfigError: registering it as host memory would give the NIC the wrong memory.
        """
        self._check_open()
        if kind not in ("host", "device", "finegrained"):
            raise ConfigError("kind must be 'device', 'finegrained' or 'host', not %r" % (kind,))
        pd = self.default_pd if pd is None else pd
        if not isinstance(pd, DevxPD) or pd.nic is not self:
            raise ConfigError("pd must be a PD of this NIC")
        addr, length, keep = mr_region(buf_or_addr, length)
        acc = int(Access(int(access) & 15))
        host = self.platform.name == "cpu" or self._arena.holds(addr, length)
        if device_memory and host:
            where = ("on the CPU platform" if self.platform.name == "cpu"
                     else "inside the NIC's host arena")
            raise ConfigError("DevX NIC %s: reg_mr(device_memory=True) of [0x%x, +%d), which is "
                              "%s, not GPU memory" % (self.device, addr, length, where))
        gpu = device_memory or (kind != "host" and not host)
        tried = []
        if gpu:
            from gpunet.host.platform import VendorRuntimeError
            try:
                dbuf = self.platform.dmabuf_fd(addr, length)
            except (VendorRuntimeError, ConfigError) as e:
                tried.append("dma-buf export: %s" % e)
            else:
                try:
                    h = self._b.reg_dmabuf_mr(pd.handle, dbuf.offset, length, addr, dbuf.fd, acc)
                except DevxCallError as e:
                    tried.append("ibv_reg_dmabuf_mr: %s" % e)
                else:
                    return self._add_mr(h, addr, length, acc, kind, pd, "dma-buf", keep)
                finally:
                    os.close(dbuf.fd)
            log.info("DevX NIC %s: %s; trying plain ibv_reg_mr (a peer-memory driver)",
                     self.device, tried[-1])
        try:
            h = self._b.reg_mr(pd.handle, addr, length, acc)
        except DevxCallError as e:
            tried.append("ibv_reg_mr: %s" % e)
            raise RegistrationError("DevX NIC %s cannot register [0x%x, +%d) (%s memory): %s"
                                    % (self.device, addr, length, kind, "; ".join(tried))) from e
        return self._add_mr(h, addr, length, acc, kind, pd, "peer memory" if gpu else "ibv_reg_mr",
                            keep)

    def _add_mr(self, h, addr, length, access, kind, pd, how, keep):
        self._lists["mr"].append(h)
        return DevxMR(self, h, addr, length, Access(access), kind, pd, how, keep)

    def dereg_mr(self, mr):
        self._check_open()
        if not isinstance(mr, DevxMR) or mr.nic is not self:
            raise ConfigError("dereg_mr needs an MR of this NIC")
        with self._lock:
            if mr.handle not in self._lists["mr"]:
                return
            self._lists["mr"].remove(mr.handle)
        mr.handle.close()

    # --- queues -------------------------------------------------------------------------------
    def create_cq(self, cqe_cnt=256, collapsed=False):
        """CREATE_CQ on our ring: ``cqe_cnt`` 64-byte CQEs (owner-bit mode), or one collapsed slot
        (``cc``: every CQE lands in entry 0; ``oi``: overrun is not an error)."""
        self._check_open()
        n = 1 if collapsed else int(cqe_cnt)
        log_n = _log2_exact(n, "cqe_cnt")
        if log_n > self.caps["log_max_cq_sz"]:
            raise ConfigError("cqe_cnt %d exceeds this NIC's 2**%d"
                              % (n, self.caps["log_max_cq_sz"]))
        if collapsed and not self.caps["cq_oi"]:
            raise ConfigError("a collapsed CQ needs overrun-ignore (cmd_hca_cap.cq_oi), which NIC "
                              "%s lacks; use an owner-bit CQ" % self.device)
        ring = self._region("cq", n * mlx5.CQE_SIZE, PAGE)
        dbr = self._region("dbrec", DBREC_SLOT, DBREC_SLOT)
        init = np.zeros(n * mlx5.CQE_SIZE, np.uint8)
        mlx5.init_cq(init, n)                # op_own 0xF0: invalid, owner 0 (rdma-core's rule)
        self._write(ring, init)
        cmd = prm.cmd_create_cq(log_cq_size=log_n, uar_page=self.uar.page_id, c_eqn=self.eqn,
                                cq_umem_id=ring.umem.umem_id, dbr_umem_id=dbr.umem.umem_id,
                                collapsed=collapsed, oi=collapsed)
        obj, out = self._create(cmd, prm.MLX5_CMD_OP_CREATE_CQ, "CREATE_CQ")
        self._lists["cq"].append(obj)
        return DevxCQ(self, prm.get(out, "create_cq_out", "cqn"), obj, ring, dbr, n,
                      bool(collapsed))

    def _write(self, region, data):
        if region.view is not None:
            region.view[:len(data)] = data
        else:
            self.platform.memcpy(region.addr, int(data.ctypes.data), len(data))

    def create_qp(self, send_cq, recv_cq=None, sq_wqebbs=256, max_inline=256, pd=None):
        """CREATE_QP: RC, send queue = our ring of ``sq_wqebbs`` WQEBBs, no receive queue; state
        RESET until ``connect``."""
        self._check_open()
        recv_cq = send_cq if recv_cq is None else recv_cq
        for c in (send_cq, recv_cq):
            if not isinstance(c, DevxCQ) or c.nic is not self:
                raise ConfigError("create_qp needs CQs of this NIC")
        sq_wqebbs = int(sq_wqebbs)
        log_sq = _log2_exact(sq_wqebbs, "sq_wqebbs")
        if sq_wqebbs < MIN_SQ_WQEBBS or log_sq > self.caps["log_max_qp_sz"]:
            raise ConfigError("sq_wqebbs must be a power of two in [%d, 2**%d] on NIC %s, not %d"
                              % (MIN_SQ_WQEBBS, self.caps["log_max_qp_sz"], self.device,
                                 sq_wqebbs))
        max_inline = int(max_inline)
        if not 0 <= max_inline <= MAX_INLINE_LIMIT:
            raise ConfigError("max_inline must be in [0, %d]" % MAX_INLINE_LIMIT)
        pd = self.default_pd if pd is None else pd
        if not isinstance(pd, DevxPD) or pd.nic is not self:
            raise ConfigError("pd must be a PD of this NIC")
        ring = self._region("sq", max(sq_wqebbs * mlx5.WQEBB, PAGE), PAGE)
        dbr = self._region("dbrec", DBREC_SLOT, DBREC_SLOT)
        # The kernel's rule (mlx5_get_qp_default_ts): DEFAULT where the RoCE caps name a QP
        # timestamp format, else FREE_RUNNING (0, the field's zero value).
        extra = {}
        if self.caps["qp_ts_format"]:
            extra["ts_format"] = prm.MLX5_TIMESTAMP_FORMAT_DEFAULT
        cmd = prm.cmd_create_qp(pd=pd.pdn, uar_page=self.uar.page_id, cqn_snd=send_cq.cqn,
                                cqn_rcv=recv_cq.cqn, log_sq_size=log_sq,
                                wq_umem_id=ring.umem.umem_id, dbr_umem_id=dbr.umem.umem_id,
                                log_msg_max=self.caps["log_max_msg"], **extra)
        obj, out = self._create(cmd, prm.MLX5_CMD_OP_CREATE_QP, "CREATE_QP")
        self._lists["qp"].append(obj)
        psn = int.from_bytes(os.urandom(3), "little")
        return DevxQP(self, prm.get(out, "create_qp_out", "qpn"), obj, ring, dbr, sq_wqebbs,
                      send_cq, recv_cq, max_inline, pd, psn)

    # --- connection ---------------------------------------------------------------------------
    _INFO_KEYS = ("qpn", "psn", "lid", "gid", "mtu", "link_layer")

    def connect(self, qp, remote_qp_info):
        """RST2INIT -> INIT2RTR -> RTR2RTS towards the QP ``remote_qp_info`` (its ``info()``)."""
        self._check_open()
        if not isinstance(qp, DevxQP) or qp.nic is not self:
            raise ConfigError("connect needs a QP of this NIC")
        r = remote_qp_info
        if not isinstance(r, dict) or any(k not in r for k in self._INFO_KEYS):
            raise ConfigError("remote_qp_info must be a DevX QP's info() dict (with %s), not %r"
                              % (", ".join(self._INFO_KEYS), r))
        if r["link_layer"] != self.link_layer:
            raise ConfigError("QP %d: the peer's port is %s, ours %s: an RC connection needs the "
                              "same link layer" % (qp.qpn, r["link_layer"], self.link_layer))
        if self.link_layer == "Ethernet" and not r.get("mac"):
            raise ConfigError("QP %d: the peer's info() has no MAC; RoCE needs it" % qp.qpn)
        self._to_rts(qp, r)
        qp.remote = dict(r)

    def _path(self, r, qp):
        """qpc.primary_address_path towards peer ``r``: IB by LID, RoCE v2 by GID + MAC with GRH
        and a UDP source port taken from both QPNs (entropy for ECMP, in 0xC000-0xFFFF)."""
        path = {"vhca_port_num": self.port}
        if self.link_layer == "Ethernet":
            mac = int(r["mac"], 16)
            path.update(grh=1, rgid_rip=bytes.fromhex(r["gid"]), src_addr_index=self.gid_index,
                        hop_limit=HOP_LIMIT, rmac_47_32=mac >> 32, rmac_31_0=mac & 0xffffffff,
                        udp_sport=0xC000 | ((qp.qpn ^ int(r["qpn"])) & 0x3FFF))
        else:
            path["rlid"] = int(r["lid"])
        return path

    def _to_rts(self, qp, r):
        c = self.caps
        self._modify(qp.obj, prm.cmd_modify_qp(
            "RST2INIT", qp.qpn, rre=1, rwe=1, rae=int(self.atomic_mode != 0),
            atomic_mode=self.atomic_mode, primary_address_path={"vhca_port_num": self.port}),
            prm.MLX5_CMD_OP_RST2INIT_QP, "RST2INIT_QP(%d)" % qp.qpn)
        self._modify(qp.obj, prm.cmd_modify_qp(
            "INIT2RTR", qp.qpn, mtu=min(int(r["mtu"]), self.active_mtu),
            log_msg_max=c["log_max_msg"], remote_qpn=int(r["qpn"]),
            next_rcv_psn=int(r["psn"]) & 0xFFFFFF, min_rnr_nak=MIN_RNR_NAK,
            log_rra_max=min(c["log_max_ra_res_qp"], 7), primary_address_path=self._path(r, qp)),
            prm.MLX5_CMD_OP_INIT2RTR_QP, "INIT2RTR_QP(%d)" % qp.qpn)
        self._modify(qp.obj, prm.cmd_modify_qp(
            "RTR2RTS", qp.qpn, next_send_psn=qp.psn, retry_count=RETRY_COUNT, rnr_retry=RNR_RETRY,
            log_sra_max=min(c["log_max_ra_req_qp"], 7),
            primary_address_path={"vhca_port_num": self.port,
                                  "ack_timeout": ack_timeout_for(self.retry_timeout_s)}),
            prm.MLX5_CMD_OP_RTR2RTS_QP, "RTR2RTS_QP(%d)" % qp.qpn)

    def qp_state(self, qp):
        """QUERY_QP's ``qpc.state``: "RESET" | "INIT" | "RTR" | "RTS" | "SQER" | "SQD" | "ERR"."""
        self._check_open()
        try:
            out = self._b.obj_query(qp.obj, prm.cmd_query_qp(qp.qpn),
                                    prm.out_size(prm.MLX5_CMD_OP_QUERY_QP))
        except DevxCallError as e:
            raise DevxCommandError("QUERY_QP(%d) failed: %s" % (qp.qpn, e),
                                   prm.MLX5_CMD_OP_QUERY_QP, errno=e.errno) from e
        self._check_out(out, prm.MLX5_CMD_OP_QUERY_QP, "QUERY_QP(%d)" % qp.qpn)
        s = prm.get(out, "query_qp_out", "qpc.state")
        return _QP_STATES.get(s, "?%d" % s)

    def _cq_bytes(self, cq):
        if cq.buf is not None:
            return cq.buf, cq.dbrec
        buf = np.zeros(cq.cqe_cnt * mlx5.CQE_SIZE, np.uint8)
        dbrec = np.zeros(mlx5.DBREC_SIZE, np.uint8)
        self.platform.memcpy(int(buf.ctypes.data), cq.buf_addr, buf.nbytes)
        self.platform.memcpy(int(dbrec.ctypes.data), cq.dbrec_addr, dbrec.nbytes)
        return buf, dbrec

    def _cq_pi(self, cq):
        """The CQ's producer index as the ring shows it: from the consumer index in its doorbell
        record, every CQE the NIC has written since (owner-bit rule). A collapsed CQ: 0."""
        if cq.collapsed:
            return 0
        buf, dbrec = self._cq_bytes(cq)
        n = cq.cqe_cnt
        ci = mlx5.get_be32(dbrec, 4 * mlx5.DBREC_RCV) & 0xFFFFFF
        i = ci
        while i - ci < n and mlx5.cqe_is_valid(buf, (i & (n - 1)) * mlx5.CQE_SIZE, i, n):
            i += 1
        return i

    def qp_error_syndrome(self, qp):
        """0 unless the QP is in ERR; then the syndrome of its first non-flush error CQE in the send
        CQ's ring (mlx5 SYNDROME_*), SYNDROME_WR_FLUSH_ERR when only flushes are there, or -1
        when the ring holds no error CQE of this QP (the consumer has moved past it)."""
        if self.qp_state(qp) != "ERR":
            return 0
        buf, _ = self._cq_bytes(qp.send_cq)
        found = -1
        for k in range(qp.send_cq.cqe_cnt):
            off = k * mlx5.CQE_SIZE
            if mlx5.cqe_opcode(buf, off) != mlx5.CQE_REQ_ERR or mlx5.cqe_qpn(buf, off) != qp.qpn:
                continue
            s = mlx5.cqe_syndrome(buf, off)
            if s != mlx5.SYNDROME_WR_FLUSH_ERR:
                return s
            found = s
        return found

    def reset_qp(self, qp, timeout_s=5.0):
        """ERR (or RTS) -> RESET -> RTS on the same connection: 2ERR flushes what was rung; once
        the send CQ has stayed unchanged for FLUSH_QUIET_S (bounded by ``timeout_s``), 2RST, the
        doorbell record cleared (the send queue restarts at WQE counter 0, as after CREATE_QP),
        then the three moves again. Returns the send CQ's producer index (gpunet/device/descriptors.py
        QpDescriptor.reset skips to it).

        A reset that failed part-way (a move refused, the flush timed out) leaves the QP in RESET,
        INIT or RTR: calling it again retries from there (nothing executes from the send queue
        in those states: no flush to wait for)."""
        self._check_open()
        if not isinstance(qp, DevxQP) or qp.nic is not self:
            raise ConfigError("reset_qp needs a QP of this NIC")
        st = self.qp_state(qp)
        if st not in ("RTS", "ERR", "RESET", "INIT", "RTR"):
            raise ConfigError("reset_qp: QP %d is %s, not RTS or ERR (nor part-way through a "
                              "reset)" % (qp.qpn, st))
        if st == "RTS":
            self._modify(qp.obj, prm.cmd_modify_qp("2ERR", qp.qpn), prm.MLX5_CMD_OP_2ERR_QP,
                         "2ERR_QP(%d)" % qp.qpn)
        deadline = time.monotonic() + float(timeout_s)
        pi, since = self._cq_pi(qp.send_cq), time.monotonic()
        while st in ("RTS", "ERR") and time.monotonic() - since < FLUSH_QUIET_S:
            if time.monotonic() > deadline:
                raise GpunetError("reset_qp: QP %d of %s: the send CQ kept changing for %.1f s "
                                  "after the QP went to error" % (qp.qpn, self.device, timeout_s))
            time.sleep(FLUSH_QUIET_S / 5)
            now = self._cq_pi(qp.send_cq)
            if now != pi:
                pi, since = now, time.monotonic()
        self._modify(qp.obj, prm.cmd_modify_qp("2RST", qp.qpn), prm.MLX5_CMD_OP_2RST_QP,
                     "2RST_QP(%d)" % qp.qpn)
        self._write(qp.dbr, np.zeros(mlx5.DBREC_SIZE, np.uint8))
        if qp.remote is not None:
            self._to_rts(qp, qp.remote)
        return pi

    # --- the doorbell in the GPU's reach --------------------------------------------------------
    def map_doorbell(self, platform):
        """Map the UAR page into the device. CPU platform: the page is already mapped into this
        process by rdma-core, where the HOST arm's device threads store. GPU: host_register(page,
        io_memory=True) (cudaHostRegister Mapped | IoMemory; MACA mcHostRegister, unverified); the
        driver's refusal raises VendorRuntimeError, and transports.choose_transport then picks
        the proxy for transport="auto". Never run against a real UAR."""
        self._check_open()
        page = self.uar.base_addr & ~(PAGE - 1)
        if platform.name == "cpu":
            return ("the UAR page 0x%x of %s is mapped into this process; the HOST arm's device "
                    "threads store to its doorbell register" % (page, self.device))
        if self._uar_mapping is None:
            dptr = platform.host_register(page, PAGE, io_memory=True)
            self._uar_mapping = (platform, page, dptr)
        _, _, dptr = self._uar_mapping
        return ("the UAR page of %s is registered with the GPU (IoMemory): doorbell register at "
                "device address 0x%x" % (self.device, dptr + self.uar.reg_addr - page))

    def io_ranges(self):
        """[(host address, nbytes, device pointer)] of MMIO pages mapped by ``map_doorbell`` (the
        UAR page, which holds ``db_addr``; gpunet/host/nic.py Nic.io_ranges); [] before it."""
        if self._uar_mapping is None:
            return []
        _, page, dptr = self._uar_mapping
        return [(page, PAGE, dptr)]

    devx = True                          # what gpunet doctor reports as "DevX available"

    @property
    def umem_in_gpu_memory(self):
        """Whether DevX accepts UMEM in GPU ``device`` memory here (probed once, on first read:
        ``probe_gpu_umem``); None on the CPU platform (no GPU memory to ask about)."""
        if self.platform.name == "cpu":
            return None
        if getattr(self, "_umem_gpu", None) is None:
            ok, detail = self.probe_gpu_umem("device")
            log.info("DevX NIC %s: UMEM in GPU memory %s", self.device, detail)
            self._umem_gpu = ok
        return self._umem_gpu

    def probe_gpu_umem(self, kind="device"):
        """Does DevX accept UMEM in GPU memory of ``kind`` here? (bool, detail); frees what it
        made. For the doctor; never run on a NIC."""
        self._check_open()
        if self.platform.name == "cpu":
            return False, "the CPU platform has no GPU memory"
        a = self.platform.alloc(kind, PAGE)
        try:
            u = self._b.umem_reg(a.ptr, PAGE, int(Access.LOCAL_WRITE))
            u.close()
        except DevxCallError as e:
            return False, "refused: %s" % e
        finally:
            a.close()
        return True, "accepted (mlx5dv_devx_umem_reg at a %s-memory address)" % kind

    # --- close ---------------------------------------------------------------------------------
    def _release(self):
        """rdma-core's DevX order: QPs, CQs, UARs, UMEMs; then MRs, the PD, the device context;
        then the memory the rings lived in. Every failure is collected (one CloseError)."""
        errors = []

        def run(what, fn):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - release the rest, then report everything
                errors.append((what, e))

        if self._uar_mapping is not None:
            plat, page, _ = self._uar_mapping
            run("GPU registration of the UAR page", lambda: plat.host_unregister(page))
            self._uar_mapping = None
        for kind in ("qp", "cq", "uar", "umem", "mr", "pd", "ctx"):
            objs = self._lists.get(kind, [])
            while objs:
                o = objs.pop()
                run("%s %r" % (kind, o), o.close)
        for a in self._gpu_allocs or []:
            run("GPU ring memory", a.close)
        self._gpu_allocs = None
        if self._arena is not None:
            run("host arena", self._arena.close)
        if errors:
            raise CloseError("closing DevX NIC %s" % getattr(self, "device", "?"), errors)

    def __repr__(self):
        return "DevxNic(%s port %s%s)" % (getattr(self, "device", "?"), getattr(self, "port", "?"),
                                          ", closed" if self.closed else "")
