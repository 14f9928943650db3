"""The NIC interface: what gpunet needs from a NIC, and ``open_nic``, the one place that names an
implementation.

Code above this module (gpunet/context.py, gpunet/transports.py, the proxy engine, the device
descriptors) works with any :class:`Nic`; only :func:`open_nic` knows the soft NIC
(gpunet/host/softnic.py) and the DevX mlx5 NIC (gpunet/host/devx.py, with detection in gpunet/host/verbs.py).
tests/test_layers.py checks that no module of gpunet/ above host/ imports an implementation.

Objects a Nic hands out (the attributes device descriptors and the proxy read; mlx5 PRM names):

- ``alloc(nbytes, align)`` -> a zeroed ``np.uint8`` array in memory the NIC can reach, inside
  ``mapped_ranges()`` (heaps, op lists, landing slots).
- MR (``reg_mr``): ``addr``, ``length``, ``lkey``, ``rkey``.
- CQ (``create_cq``): ``cqn``, ``buf`` (uint8[cqe_cnt * 64]), ``buf_addr``, ``cqe_cnt``, ``dbrec``
  (uint8[8]), ``dbrec_addr``, ``collapsed``.
- QP (``create_qp``): ``qpn``, ``sq`` (uint8[sq_wqebbs * 64]), ``sq_addr``, ``sq_wqebbs``,
  ``dbrec`` / ``dbrec_addr``, ``db_addr`` (the doorbell word: UAR + 0x800 on mlx5, inside
  ``mapped_ranges()`` or, for an MMIO register, ``io_ranges()``),
  ``send_cq``, ``max_inline``, and ``info()``: a picklable dict a peer passes to ``connect``.
"""
import abc
import enum
import logging

from gpunet.errors import ConfigError
from gpunet.resource import Resource

KINDS = ("auto", "soft", "verbs")


class Access(enum.IntFlag):
    """MR access flags (``reg_mr(access=)``; ibv_access_flags values)."""
    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    REMOTE_ATOMIC = 8
    ALL = 15


class Nic(Resource, abc.ABC):
    """A NIC gpunet drives: memory, registration, CQs, RC QPs, and what the GPU must map.

    A Resource: ``close()`` releases every object the NIC made, idempotently.

    ``atomic_endianness``: "host" | "big", the byte order in which the NIC's 8-byte atomics read
    and write the target word and write the old value back (the mlx5 HCA cap
    atomic_req_8B_endianness_mode: 1 = host). Signal words are in that order; device code learns
    it from DevCtx's DEVCTX_SIGNAL_BE (gpunet/device/descriptors.py DeviceContext). "big", the IB wire
    order, unless an implementation knows better (SoftNic: "host" by default; a DevX NIC: its
    HCA query).
    """

    atomic_endianness = "big"

    @abc.abstractmethod
    def alloc(self, nbytes, align=64):
        """A zeroed np.uint8 array of ``nbytes`` (``align``-aligned) the NIC and the GPU can reach."""

    @abc.abstractmethod
    def reg_mr(self, buf_or_addr, length=None, access=Access.ALL, kind="host", pd=None,
               device_memory=False):
        """Register memory (an array, or an address + ``length``) with ``access`` (Access
        flags); ``kind``: "device" | "finegrained" | "host" (gpunet/host/platform.py's memory kinds);
        ``device_memory=True``: the range is GPU memory the CPU cannot touch (a CUDA heap), which
        the NIC must reach as GPU memory or refuse with ConfigError. Returns an MR."""

    @abc.abstractmethod
    def dereg_mr(self, mr):
        """Undo ``reg_mr``."""

    @abc.abstractmethod
    def create_cq(self, cqe_cnt=256, collapsed=False):
        """A CQ of ``cqe_cnt`` 64-byte CQEs (owner-bit mode), or one collapsed slot."""

    @abc.abstractmethod
    def create_qp(self, send_cq, recv_cq=None, sq_wqebbs=256, max_inline=256, pd=None):
        """An RC QP whose send completions go to ``send_cq``; ``qp.info()`` names it to a peer."""

    @abc.abstractmethod
    def connect(self, qp, remote_qp_info):
        """Connect ``qp`` to the peer QP ``remote_qp_info`` describes (INIT -> RTR -> RTS)."""

    @abc.abstractmethod
    def qp_state(self, qp):
        """"RESET" | "INIT" | "RTR" | "RTS" | "ERR" (as the NIC sees it now)."""

    @abc.abstractmethod
    def qp_error_syndrome(self, qp):
        """The mlx5 syndrome that moved ``qp`` to ERR (0 when it is not in error)."""

    @abc.abstractmethod
    def reset_qp(self, qp, timeout_s=5.0):
        """ERR -> RESET -> RTS on the same connection, after the NIC drained what was rung;
        returns the send CQ's consumer index from which CQEs belong to the QP's new life."""

    @abc.abstractmethod
    def map_doorbell(self, platform):
        """Make this NIC's doorbell reachable by device code on ``platform`` (gpunet/host/platform.py)
        and say how (a description for logs), or raise host.platform.VendorRuntimeError when the
        driver refuses (a real mlx5 UAR: cudaHostRegister(Mapped | IoMemory), error 800 where
        GPU-initiated doorbells are not permitted); transports.choose_transport then falls back
        to the proxy."""

    def io_ranges(self):
        """[(host address, nbytes, device pointer)]: the MMIO pages ``map_doorbell`` registered
        with the GPU (a real mlx5 NIC's UAR page: DevxNic), which device code stores its doorbell
        to; gpunet/device/descriptors.py NicMapping translates ``db_addr`` through them. Optional: the
        default [] is right for a NIC whose doorbell word is ordinary memory inside
        ``mapped_ranges()`` (the soft NIC) and before ``map_doorbell`` mapped anything."""
        return []

    def timeout_hint(self):
        """What this NIC saw that may explain a timed-out wait of the kernels using it, as a
        sentence to append to the timeout's message, or "" (the default: nothing)."""
        return ""

    # --- peer heaps (the p2p transport, gpunet/transports.py) ----------------------------------
    # Optional: a NIC that cannot share memory with a peer process keeps these defaults, and
    # transport="p2p" then raises ConfigError naming the NIC.
    def export_heap(self, addr, nbytes):
        """A picklable description of ``[addr, addr + nbytes)`` (memory from ``alloc``) that a
        process on the same machine passes to ``map_peer_heap`` to store into it directly."""
        raise ConfigError("%s cannot export memory to peer processes, so no peer can reach it "
                          "by p2p; use transport='ibgda' or 'proxy'" % type(self).__name__)

    def map_peer_heap(self, exported):
        """Map a peer's ``export_heap`` description into this process: a Resource with ``base``
        (the first byte's address here) and ``nbytes``; ``close()`` unmaps it. ConfigError when
        the peer's memory cannot be reached from here (another machine, a closed peer)."""
        raise ConfigError("%s cannot map a peer's memory; use transport='ibgda' or 'proxy'"
                          % type(self).__name__)

    @abc.abstractmethod
    def mapped_ranges(self):
        """[(address, nbytes)]: the host memory the GPU must map for GPU-initiated posting (rings,
        CQs, doorbell records and words, and everything ``alloc`` returns)."""


def mr_region(buf_or_addr, length=None):
    """``reg_mr``'s region: ``(addr, length, keep)`` from an address + ``length`` or from an array /
    tensor (``length`` defaults to its size; ``keep`` is the object the MR must keep alive, None
    for a bare address). ConfigError for a missing length, non-contiguous memory, a length past
    the buffer or one <= 0. Every Nic's ``reg_mr`` parses its arguments here."""
    import numpy as np

    if isinstance(buf_or_addr, (int, np.integer)):
        if length is None:
            raise ConfigError("reg_mr(address) needs a length")
        addr, keep = int(buf_or_addr), None
    else:
        keep = buf_or_addr
        if hasattr(buf_or_addr, "data_ptr") and hasattr(buf_or_addr, "numel"):   # torch tensor
            addr = int(buf_or_addr.data_ptr())
            n = buf_or_addr.numel() * buf_or_addr.element_size()
        else:
            arr = np.asarray(buf_or_addr)
            if not arr.flags.c_contiguous:
                raise ConfigError("reg_mr needs contiguous memory")
            addr, n = int(arr.ctypes.data), arr.nbytes
        length = n if length is None else int(length)
        if length > n:
            raise ConfigError("reg_mr length %d exceeds the buffer's %d bytes" % (length, n))
    length = int(length)
    if length <= 0:
        raise ConfigError("reg_mr length must be > 0")
    return addr, length, keep


def open_nic(kind="auto", *, profile="nvidia", arena_bytes=64 << 20, retry_timeout_s=1.0,
             name=None):
    """Open a NIC of ``kind``: "soft" (gpunet/host/softnic.py: the software mlx5 NIC, shared-memory arena
    of ``arena_bytes``, coherence ``profile``, peers dead after ``retry_timeout_s``), "verbs" (a
    real mlx5 NIC through DevX, gpunet/host/devx.py's DevxNic; never run on a NIC: NoRdmaDeviceError,
    ToolchainError or NoDevxError say why it cannot open) or "auto" (DevxNic where pyverbs sees
    an RDMA device DevX can open, else soft, logged). ``name`` tags the soft NIC's arena file.
    The soft NIC's ``atomic_endianness`` is ``GPUNET_SOFTNIC_ATOMIC_ENDIANNESS`` ("host" unless
    set). Returns a Nic.
    """
    from gpunet.host import verbs

    if not isinstance(kind, str) or kind not in KINDS:
        raise ConfigError("nic must be one of %s, not %r" % (KINDS, kind))
    if kind in ("verbs", "auto"):
        from gpunet.errors import ToolchainError
        from gpunet.host import devx
        try:
            return devx.DevxNic(profile=profile, retry_timeout_s=retry_timeout_s,
                                arena_bytes=arena_bytes, name=name, backend=devx.BACKEND())
        except (verbs.NoRdmaDeviceError, ToolchainError, devx.NoDevxError) as e:
            if kind == "verbs":
                raise
            # auto: no pyverbs or no device is the common case (quiet); a device DevX cannot
            # open (not mlx5, no permission) is worth a warning. tests/test_devx.py
            say = logging.getLogger("gpunet").warning if isinstance(e, devx.NoDevxError) else \
                logging.getLogger("gpunet").debug
            say("nic='auto': using the soft NIC (%s)", e)
    from gpunet.host.softnic import SoftNic

    from gpunet import config

    try:
        endian = config.get("GPUNET_SOFTNIC_ATOMIC_ENDIANNESS")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        return SoftNic(profile=profile, retry_timeout_s=retry_timeout_s, arena_bytes=arena_bytes,
                       name=name, atomic_endianness=endian)
    except OSError as e:
        raise ConfigError("cannot create the soft NIC's %d-byte shared-memory arena in /dev/shm "
                          "(%s); ask for less memory (gpunet.init's heap_bytes) or free /dev/shm"
                          % (arena_bytes, e)) from e
