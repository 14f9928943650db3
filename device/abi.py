"""The device-visible descriptors, mirrored from C++ byte for byte (ctypes Structures).

The C++ definitions are the source of truth: ``device/include/gpunet/qp.cuh`` (Status, CqDesc,
QpDesc), ``gpunet.cuh`` (PeerDesc, DevCtx), ``proxy.cuh`` (ProxyChannel) and
``device/kernels/ops.cu`` (OpDesc, SchedParams). Every device-ABI mirror lives here; the code that
fills them from NIC and proxy objects is device/descriptors.py.
``tests/test_device_qp.py::test_abi_layout_matches_cpp`` compiles a program that prints every
``offsetof`` / ``sizeof`` and compares it with :func:`layout`.

Also here: the constants those headers define (status codes, wait sites, comparisons, op kinds),
the decoding of a Status block into a :class:`gpunet.errors.GpunetError`, and :func:`alloc_struct`
for descriptors in 64-byte-aligned memory that stays alive with the returned object.
"""
import ctypes

from gpunet import errors, mlx5
from gpunet._floor import aligned_zeros

u32, u64, i32 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int32

# --- qp.cuh -----------------------------------------------------------------------------------
STATUS_OK = 0
STATUS_TIMEOUT = 1
STATUS_COMPLETION_ERROR = 2
STATUS_BAD_ARGUMENT = 3
STATUS_QP_ERROR = 4
STATUS_NAMES = {STATUS_OK: "ok", STATUS_TIMEOUT: "timeout", STATUS_COMPLETION_ERROR: "completion error",
                STATUS_BAD_ARGUMENT: "bad argument", STATUS_QP_ERROR: "QP in error"}

SITE_NONE = 0
SITE_SQ_SPACE = 1
SITE_READY = 2
SITE_DOORBELL = 3
SITE_QUIET = 4
SITE_CQE = 5
SITE_WAIT_UNTIL = 6
SITE_ATOMIC = 7
SITE_POST_ARG = 8
SITE_PROXY_FIFO = 16        # proxy.cuh: the proxy transport's wait sites
SITE_PROXY_QUIET = 17
SITE_PROXY_ARG = 18
SITE_PROXY_CMD = 19
SITE_NAMES = {
    SITE_NONE: "nothing",
    SITE_SQ_SPACE: "a post waiting for send-queue space (completions)",
    SITE_READY: "a post waiting for earlier posts to publish (ready_head)",
    SITE_DOORBELL: "a doorbell flush",
    SITE_QUIET: "quiet waiting for completions",
    SITE_CQE: "the CQ poller (error CQE)",
    SITE_WAIT_UNTIL: "wait_until on a signal word",
    SITE_ATOMIC: "atomic_fetch_add waiting for its result",
    SITE_POST_ARG: "the argument checks of a post",
    SITE_PROXY_FIFO: "a proxy push waiting for FIFO space (is the proxy thread running?)",
    SITE_PROXY_QUIET: "quiet waiting for the proxy's completed counter",
    SITE_PROXY_ARG: "the argument checks of a proxy command",
    SITE_PROXY_CMD: "a command the proxy rejected",
}

# --- gpunet.cuh ---------------------------------------------------------------------------------
CMP_EQ, CMP_NE, CMP_GE, CMP_GT, CMP_LE, CMP_LT = range(6)
MAX_INLINE = 4 * mlx5.WQEBB - 32 - 4        # gpunet::kMaxInline (qp.cuh: kMaxWqeBBs = 4)

# --- ops.cu ------------------------------------------------------------------------------------
OP_NOP, OP_PUT, OP_PUT_INLINE, OP_GET, OP_PUT_SIGNAL, OP_ATOMIC_ADD, OP_QUIET, OP_FENCE, \
    OP_WAIT_UNTIL, OP_PUT_WARP = range(10)
# schedule kinds (SchedParams.mix bits)
K_PUT, K_INLINE, K_GET, K_SIGNAL, K_ATOMIC, K_QUIET, K_FENCE, K_WARP = range(8)
MIX_ALL = 0xFF


class Status(ctypes.Structure):
    _fields_ = [("code", u64), ("valid", u64), ("site", u32), ("qpn", u32), ("peer", u32),
                ("syndrome", u32), ("vendor_syndrome", u32), ("wqe_counter", u32), ("block", u32),
                ("thread", u32), ("wqe_index", u64), ("expected", u64), ("observed", u64),
                ("waited_ns", u64), ("reserved", u64 * 6)]


class CqDesc(ctypes.Structure):
    _fields_ = [("buf", u64), ("dbrec", u64), ("cqe_cnt", u32), ("collapsed", u32), ("ci", u64)]


class QpDesc(ctypes.Structure):
    _fields_ = [("sq", u64), ("dbrec", u64), ("db", u64), ("slot_db", u64), ("slot_nbb", u64),
                ("sq_wqebbs", u32), ("qpn", u32), ("peer", u32), ("db_batch", u32),
                ("max_inline", u32), ("pad0", u32), ("cq", CqDesc), ("pad1", u64 * 4),
                ("resv_head", u64), ("ready_head", u64), ("db_head", u64), ("done_head", u64),
                ("db_lock", u64), ("poll_lock", u64), ("errored", u64), ("pad2", u64)]


class PeerDesc(ctypes.Structure):
    _fields_ = [("qp", u64), ("remote_base", u64), ("rkey", u32), ("pad0", u32), ("proxy", u64)]


class DevCtx(ctypes.Structure):
    _fields_ = [("local_base", u64), ("heap_bytes", u64), ("lkey", u32), ("npes", u32),
                ("my_pe", u32), ("scratch_slots", u32), ("peers", u64), ("status", u64),
                ("timeout_ns", u64), ("scratch", u64), ("discard", u64), ("max_wqe_bytes", u64),
                ("reserved", u64 * 6)]


class ProxyChannelDesc(ctypes.Structure):
    """proxy.cuh's ``gpunet::proxy::ProxyChannel``: the device's handle of one proxy channel (GPU
    addresses of its FIFO, HostCtrl and DevCtrl; ``id``: the channel's index in its engine).
    Filled by device/descriptors.py:proxy_channel_desc from a host/proxy.py ProxyChannel."""
    _fields_ = [("fifo", u64), ("host", u64), ("dev", u64), ("depth", u32), ("id", u32)]


class OpDesc(ctypes.Structure):
    _fields_ = [("kind", u32), ("pe", i32), ("dst", u64), ("src", u64), ("nbytes", u64),
                ("sig", u64), ("value", u64), ("cmp", u32), ("ok", u32), ("result", u64)]


class SchedParams(ctypes.Structure):
    _fields_ = [("seed", u64), ("rounds", u32), ("ops", u32), ("nthreads", u32), ("region", u32),
                ("max_size", u32), ("mix", u32), ("ncounters", u32), ("warp_region", u32),
                ("check_every", u32), ("pe", u32), ("src", u64), ("wsrc", u64), ("get_src", u64),
                ("get_dst", u64), ("put_dst", u64), ("warp_dst", u64), ("sig", u64),
                ("counters", u64), ("results", u64), ("violations", u64), ("peer_view", u64)]


STRUCTS = {"Status": Status, "CqDesc": CqDesc, "QpDesc": QpDesc, "PeerDesc": PeerDesc,
           "DevCtx": DevCtx, "OpDesc": OpDesc, "SchedParams": SchedParams,
           "ProxyChannel": ProxyChannelDesc}
SIZES = {"Status": 128, "CqDesc": 32, "QpDesc": 192, "PeerDesc": 32, "DevCtx": 128, "OpDesc": 64,
         "SchedParams": 136, "ProxyChannel": 32}


def layout():
    """{struct name: (sizeof, {field: offsetof})} of the Python mirror."""
    out = {}
    for name, cls in STRUCTS.items():
        out[name] = (ctypes.sizeof(cls), {f[0]: getattr(cls, f[0]).offset for f in cls._fields_})
    return out


def alloc_struct(cls, count=None):
    """A zeroed ``cls`` (or ``cls * count``) in 64-byte-aligned memory ("device memory" on HOST).

    The backing numpy buffer is kept on the returned object (``._gpunet_buf``).
    """
    ty = cls if count is None else cls * count
    buf = aligned_zeros(ctypes.sizeof(ty))
    obj = ty.from_address(buf.ctypes.data)
    obj._gpunet_buf = buf
    return obj


def addr_of(obj):
    return ctypes.addressof(obj)


def status_error(st, what="device kernel"):
    """The GpunetError a Status block describes, or None if it records no failure."""
    code = int(st.code)
    if code == STATUS_OK:
        return None
    site = SITE_NAMES.get(int(st.site), "site %d" % st.site)
    where = "QP %d (peer %d), block %d thread %d" % (st.qpn, st.peer, st.block, st.thread)
    if not st.valid:
        return errors.GpunetError("%s: failure code %d recorded but its details were not published "
                                  "(the kernel did not finish?)" % (what, code))
    if code == STATUS_COMPLETION_ERROR:
        name = mlx5.syndrome_name(st.syndrome)
        return errors.CompletionError(
            "%s: error completion on %s: syndrome 0x%02x (%s), vendor syndrome 0x%02x, wqe_counter %d "
            "(WQEBB %d). Check the keys and bounds of the addresses posted, and that the peer is "
            "alive.%s" % (what, where, st.syndrome, name, st.vendor_syndrome, st.wqe_counter, st.wqe_index,
                          " (A collapsed CQ keeps only the newest CQE: the first error may have been "
                          "overwritten by this flush; an owner-bit CQ names it.)"
                          if st.syndrome == mlx5.SYNDROME_WR_FLUSH_ERR else ""),
            syndrome=int(st.syndrome), vendor_syndrome=int(st.vendor_syndrome), qpn=int(st.qpn),
            wqe_counter=int(st.wqe_counter))
    if code == STATUS_TIMEOUT:
        return errors.TimeoutError(
            "%s: timed out after %.3f s in %s on %s: expected %d, observed %d (WQEBB %d). The peer or "
            "NIC may be dead, or the timeout too short for the load." % (
                what, st.waited_ns / 1e9, site, where, st.expected, st.observed, st.wqe_index))
    if code == STATUS_BAD_ARGUMENT:
        return errors.ConfigError("%s: bad argument in %s on %s (limit %d, got %d)" % (
            what, site, where, st.expected, st.observed))
    if code == STATUS_QP_ERROR:
        return errors.CompletionError("%s: posted on %s, which is in error" % (what, where), qpn=int(st.qpn))
    return errors.GpunetError("%s: unknown failure code %d at %s" % (what, code, site))


def raise_for_status(st, what="device kernel"):
    """Raise the failure a Status block records (a GpunetError subclass), if any."""
    err = status_error(st, what)
    if err is not None:
        raise err
