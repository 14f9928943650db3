"""The device-visible descriptors, mirrored from C++ byte for byte (ctypes Structures), and the one
decoder of a failure into a gpunet exception.

The C++ definitions are the source of truth: ``gpunet/device/include/gpunet/status.cuh`` (Status, the
status codes, the ONE site registry), ``qp.cuh`` (CqDesc, QpDesc), ``devctx.cuh`` (PeerDesc,
DevCtx, the transport kinds, the comparisons), ``proxy.cuh`` (ProxyChannel; the command format
and the HostCtrl / DevCtrl layouts as ``PROXY_*``) and
``gpunet/device/kernels/ops.cu`` (OpDesc). Every device-ABI mirror of the shipped code lives here (the
test kernels' parameter blocks live beside their binders in gpunet.device.testing); the code that
fills them from NIC and proxy objects is gpunet/device/descriptors.py.
``tests/test_device_qp.py::test_abi_layout_matches_cpp`` compiles a program that prints every
``offsetof`` / ``sizeof`` and compares it with :func:`layout`; ``tests/test_status.py`` checks every
STATUS_* / SITE_* / TRANSPORT_* / CMP_* value against the headers and that nothing else defines one.

:func:`failure_error` is the one place a failure record (:class:`Failure`) becomes an exception,
with a message that names what failed or waited (site, QP, peer, proxy channel, signal word) and
what to check. Its inputs: :func:`status_failure` (a device Status block; :func:`status_error`,
:func:`raise_for_status`), :func:`proxy_failure` (a proxy channel's HostCtrl error, from
gpunet/host/proxy.py) and :func:`coherence_error` (the soft NIC's strict-mode record). Also here:
:func:`alloc_struct` for descriptors in 64-byte-aligned memory that stays alive with the returned
object.
"""
import ctypes
from dataclasses import dataclass, field

from gpunet import errors, mlx5
from gpunet._floor import aligned_zeros

u32, u64, i32 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int32

# --- status.cuh ---------------------------------------------------------------------------------
STATUS_OK = 0
STATUS_TIMEOUT = 1
STATUS_COMPLETION_ERROR = 2
STATUS_BAD_ARGUMENT = 3
STATUS_QP_ERROR = 4
STATUS_NAMES = {STATUS_OK: "ok", STATUS_TIMEOUT: "timeout", STATUS_COMPLETION_ERROR: "completion error",
                STATUS_BAD_ARGUMENT: "bad argument", STATUS_QP_ERROR: "QP in error"}
# Host-only failure code (never written by device code): the soft NIC's strict coherence record.
FAILURE_COHERENCE = 0x100

SITE_NONE = 0
SITE_SQ_SPACE = 1
SITE_DOORBELL_TURN = 11
SITE_QUIET = 4
SITE_CQE = 5
SITE_WAIT_UNTIL = 6
SITE_ATOMIC = 7
SITE_POST_ARG = 8
SITE_PEER_RANGE = 9
SITE_PEER_KIND = 10
SITE_PROXY_FIFO = 16
SITE_PROXY_QUIET = 17
SITE_PROXY_ARG = 18
SITE_PROXY_CMD = 19
SITE_P2P_RANGE = 32
SITE_P2P_STORE_ONLY = 33
SITE_NAMES = {
    SITE_NONE: "nothing",
    SITE_SQ_SPACE: "a post waiting for send-queue space (completions)",
    SITE_DOORBELL_TURN: "a post on a serial-mode QP waiting for the posts reserved before it to ring",
    SITE_QUIET: "quiet waiting for completions",
    SITE_CQE: "the CQ poller (error CQE)",
    SITE_WAIT_UNTIL: "wait_until on a signal word",
    SITE_ATOMIC: "atomic_fetch_add waiting for its result",
    SITE_POST_ARG: "the argument checks of a post",
    SITE_PEER_RANGE: "the peer check of a verb (pe out of range)",
    SITE_PEER_KIND: "the peer check of a verb (no transport to that pe)",
    SITE_PROXY_FIFO: "a proxy push waiting for FIFO space (is the proxy thread running?)",
    SITE_PROXY_QUIET: "quiet waiting for the proxy's completed counter",
    SITE_PROXY_ARG: "the argument checks of a proxy command",
    SITE_PROXY_CMD: "a command the proxy rejected",
    SITE_P2P_RANGE: "the bounds check of a p2p access",
    SITE_P2P_STORE_ONLY: "the store-only rule of a p2p peer",
}
PEER_NONE = 0xFFFFFFFF          # Status.peer: the failure concerns no peer
CHANNEL_NONE = 0xFFFFFFFF       # Status.channel: no proxy channel
NO_HEAP_OFF = (1 << 64) - 1     # Status.heap_off: the address is outside the local heap

# --- devctx.cuh: the comparisons (Status.cmp records one) -----------------------------------------
CMP_EQ, CMP_NE, CMP_GE, CMP_GT, CMP_LE, CMP_LT = range(6)
CMP_SYMBOLS = {CMP_EQ: "==", CMP_NE: "!=", CMP_GE: ">=", CMP_GT: ">", CMP_LE: "<=", CMP_LT: "<"}


# --- devctx.cuh: PeerDesc.kind -------------------------------------------------------------------
TRANSPORT_NONE = 0
TRANSPORT_IBGDA = 1
TRANSPORT_PROXY = 2
TRANSPORT_P2P = 3
TRANSPORT_NAMES = {TRANSPORT_NONE: "none", TRANSPORT_IBGDA: "ibgda", TRANSPORT_PROXY: "proxy",
                   TRANSPORT_P2P: "p2p"}
P2P_STORE_ONLY = 1              # PeerDesc.rkey of a p2p peer: stores only (the c500 profile)
P2P_SAME_DEVICE = 2             # ... its heap is on this GPU: signals release at device scope
SIGNAL_ADD, SIGNAL_SET = 0, 1   # put_signal's signal operation (OpDesc.cmp of OP_PUT_SIGNAL)
DEVCTX_SIGNAL_BE = 1            # DevCtx.flags: signal words are big-endian (the NIC's atomics run
                                # big-endian: Nic.atomic_endianness "big"); clear: native order
P2P_REFUSED = {1: "a get (remote loads)", 2: "an atomic", 3: "an ADD signal (a remote atomic)"}

# --- qp.cuh -------------------------------------------------------------------------------------
MAX_INLINE = 4 * mlx5.WQEBB - 32 - 4        # gpunet::kMaxInline (qp.cuh: kMaxWqeBBs = 4)
POST_BATCHED, POST_SERIAL = 0, 1              # QpDesc.post_mode (qp.cuh "Posting modes")
POST_MODES = {"batched": POST_BATCHED, "serial": POST_SERIAL}

# --- ops.cu ------------------------------------------------------------------------------------
OP_NOP, OP_PUT, OP_PUT_INLINE, OP_GET, OP_PUT_SIGNAL, OP_ATOMIC_ADD, OP_QUIET, OP_FENCE, \
    OP_WAIT_UNTIL, OP_PUT_WARP = range(10)


# --- proxy.cuh: the proxy channel (namespace gpunet::proxy: proxy::X is PROXY_X here) -----------
# The command format (gpunet/host/proxy.py drains it; tests/test_proxy.py checks it against compiled C++).
PROXY_CMD_BYTES = 16
PROXY_OP_NOP = 0          # completes when every earlier command of the channel has; moves no data
PROXY_OP_PUT = 1          # RDMA WRITE  local[loff, +size) -> peer[roff, +size)
PROXY_OP_GET = 2          # RDMA READ   peer[roff, +size) -> local[loff, +size)
PROXY_OP_SIGNAL_ADD = 3   # 8-byte fetch-add of a 64-bit value on peer[roff]; the old value is dropped
PROXY_OP_ATOMIC_FA = 4    # 8-byte fetch-add on peer[roff]; old value -> local[loff]; addend: next slot
PROXY_OP_SIGNAL_SET = 5   # 8-byte store of a 64-bit value to peer[roff] (an inline RDMA WRITE)
PROXY_OP_OPERAND = 6      # the 64-bit operand (w1) of the command in the slot before it (ATOMIC_FA)
PROXY_OP_MAX = 6
PROXY_OP_NAMES = {PROXY_OP_NOP: "NOP", PROXY_OP_PUT: "PUT", PROXY_OP_GET: "GET",
                  PROXY_OP_SIGNAL_ADD: "SIGNAL_ADD", PROXY_OP_ATOMIC_FA: "ATOMIC_FA",
                  PROXY_OP_SIGNAL_SET: "SIGNAL_SET", PROXY_OP_OPERAND: "OPERAND"}

PROXY_VALID_SHIFT = 63
PROXY_OP_SHIFT = 58
PROXY_OP_MASK = 0x1F
PROXY_PEER_SHIFT = 46
PROXY_PEER_MASK = 0xFFF
PROXY_LOCAL_HI_SHIFT = 39
PROXY_REMOTE_HI_SHIFT = 32
PROXY_HI_MASK = 0x7F
PROXY_ARG_MASK = 0xFFFFFFFF
PROXY_OFFSET_BITS = 39
PROXY_MAX_OFFSET = (1 << PROXY_OFFSET_BITS) - 1
PROXY_MAX_PEERS = PROXY_PEER_MASK + 1
PROXY_MAX_SIZE = PROXY_ARG_MASK

# The channel's control blocks
PROXY_HOST_CTRL_BYTES = 64
PROXY_HC_TAIL = 0          # u64 word indices into HostCtrl
PROXY_HC_COMPLETED = 1
PROXY_HC_ERROR = 2
PROXY_HC_ERR_SEQ = 3
PROXY_HC_ERR_PEER = 4      # the failed command's destination rank (written before HC_ERROR)
PROXY_COMPLETED_ERROR = 1 << 63   # HostCtrl.completed's top bit: HostCtrl.error holds a failure
PROXY_DEV_CTRL_BYTES = 128
PROXY_DC_HEAD = 0          # u64 word indices into DevCtrl: head and cached_tail on separate 64 B lines
PROXY_DC_CACHED_TAIL = 8

# packed error word (HostCtrl.error): code(8) | syndrome(8) | vendor syndrome(8) | wqe_counter(16)
# | qpn(24). 0 means no error.
PROXY_ERR_NONE = 0
PROXY_ERR_CQE = 1          # an error CQE: syndrome, vendor syndrome, qpn and wqe_counter are valid
PROXY_ERR_BAD_COMMAND = 2  # the proxy could not decode the command (op or peer out of range)


class Status(ctypes.Structure):
    _fields_ = [("code", u64), ("valid", u64), ("site", u32), ("qpn", u32), ("peer", u32),
                ("syndrome", u32), ("vendor_syndrome", u32), ("wqe_counter", u32), ("block", u32),
                ("thread", u32), ("wqe_index", u64), ("expected", u64), ("observed", u64),
                ("waited_ns", u64), ("addr", u64), ("heap_off", u64), ("cmp", u32),
                ("channel", u32), ("seq", u64), ("reserved", u64 * 2)]


class CqDesc(ctypes.Structure):
    _fields_ = [("buf", u64), ("dbrec", u64), ("cqe_cnt", u32), ("collapsed", u32), ("ci", u64)]


class QpDesc(ctypes.Structure):
    _fields_ = [("sq", u64), ("dbrec", u64), ("db", u64), ("slot_db", u64), ("slot_nbb", u64),
                ("sq_wqebbs", u32), ("qpn", u32), ("peer", u32),
                ("max_inline", u32), ("post_mode", u32), ("pad0", u32), ("cq", CqDesc), ("slot_ready", u64),
                ("pad1", u64 * 3),
                ("resv_head", u64), ("ready_head", u64), ("db_head", u64), ("done_head", u64),
                ("poll_lock", u64), ("errored", u64), ("pad2", u64 * 2)]


class PeerDesc(ctypes.Structure):
    _fields_ = [("qp", u64), ("remote_base", u64), ("rkey", u32), ("kind", u32), ("proxy", u64)]


class DevCtx(ctypes.Structure):
    _fields_ = [("local_base", u64), ("heap_bytes", u64), ("lkey", u32), ("npes", u32),
                ("my_pe", u32), ("scratch_slots", u32), ("peers", u64), ("status", u64),
                ("timeout_ns", u64), ("scratch", u64), ("discard", u64), ("max_wqe_bytes", u64),
                ("flags", u32), ("pad", u32), ("reserved", u64 * 5)]


class ProxyChannelDesc(ctypes.Structure):
    """proxy.cuh's ``gpunet::proxy::ProxyChannel``: the device's handle of one proxy channel (GPU
    addresses of its FIFO, HostCtrl and DevCtrl; ``id``: the channel's index in its engine).
    Filled by gpunet/device/descriptors.py:proxy_channel_desc from a gpunet/host/proxy.py ProxyChannel."""
    _fields_ = [("fifo", u64), ("host", u64), ("dev", u64), ("depth", u32), ("id", u32)]


class OpDesc(ctypes.Structure):
    _fields_ = [("kind", u32), ("pe", i32), ("dst", u64), ("src", u64), ("nbytes", u64),
                ("sig", u64), ("value", u64), ("cmp", u32), ("ok", u32), ("result", u64)]


STRUCTS = {"Status": Status, "CqDesc": CqDesc, "QpDesc": QpDesc, "PeerDesc": PeerDesc,
           "DevCtx": DevCtx, "OpDesc": OpDesc, "ProxyChannel": ProxyChannelDesc}
SIZES = {"Status": 128, "CqDesc": 32, "QpDesc": 192, "PeerDesc": 32, "DevCtx": 128, "OpDesc": 64,
         "ProxyChannel": 32}


def layout(structs=None):
    """{struct name: (sizeof, {field: offsetof})} of the Python mirrors in ``structs`` ({name:
    ctypes Structure}; default: this module's STRUCTS)."""
    out = {}
    for name, cls in (STRUCTS if structs is None else structs).items():
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


# --- the one decoder ------------------------------------------------------------------------------
@dataclass
class Failure:
    """One failure, whatever recorded it: the fields of a device Status block (status.cuh) with
    their "does not apply" values as defaults, plus the soft NIC's coherence fields. Every
    exception :func:`failure_error` returns carries its Failure as ``.failure``."""
    code: int
    site: int = SITE_NONE
    qpn: int = 0
    peer: int = PEER_NONE
    syndrome: int = 0
    vendor_syndrome: int = 0
    wqe_counter: int = 0
    block: int = None
    thread: int = None
    wqe_index: int = 0
    expected: int = 0
    observed: int = 0
    waited_ns: int = 0
    addr: int = 0
    heap_off: int = NO_HEAP_OFF
    cmp: int = 0
    channel: int = CHANNEL_NONE
    seq: int = 0
    valid: bool = True
    extra: dict = field(default_factory=dict)   # FAILURE_COHERENCE: opcode, key, length, ...


def _where(f):
    """What the failure concerns, in words: QP, peer, proxy channel, device thread."""
    parts = []
    if f.qpn:
        parts.append("QP %d" % f.qpn)
    if f.peer != PEER_NONE:
        parts.append("peer %d" % f.peer)
    if f.channel != CHANNEL_NONE:
        parts.append("proxy channel %d" % f.channel)
    if f.block is not None:
        parts.append("block %d thread %d" % (f.block, f.thread))
    return ", ".join(parts) or "no QP or peer"


def _word(f):
    if f.heap_off != NO_HEAP_OFF:
        return "the signal word at heap offset %d (0x%x, address 0x%x)" % (f.heap_off, f.heap_off,
                                                                          f.addr)
    return "the word at address 0x%x (outside the symmetric heap)" % f.addr


def failure_error(f, what="device kernel"):
    """The GpunetError subclass describing Failure ``f`` (None if it records no failure).

    The message names what failed or waited (site, QP, peer, proxy channel, signal word) and
    what to check; ``.failure`` on the exception holds ``f``."""
    code = f.code
    if code == STATUS_OK:
        return None
    if not f.valid:
        err = errors.GpunetError("%s: failure code %d recorded but its details were not published "
                                 "(the kernel did not finish?)" % (what, code))
        err.failure = f
        return err
    site = SITE_NAMES.get(f.site, "site %d" % f.site)
    where = _where(f)
    proxied = f.channel != CHANNEL_NONE
    if code == STATUS_COMPLETION_ERROR:
        at = ("command #%d" % f.seq) if proxied else ("WQEBB %d" % f.wqe_index)
        err = errors.CompletionError(
            "%s: error completion on %s: syndrome 0x%02x (%s), vendor syndrome 0x%02x, wqe_counter %d "
            "(%s). Check the keys and bounds of the addresses posted, and that the peer is "
            "alive.%s" % (what, where, f.syndrome, mlx5.syndrome_name(f.syndrome),
                          f.vendor_syndrome, f.wqe_counter, at,
                          " (A collapsed CQ keeps only the newest CQE: the first error may have been "
                          "overwritten by this flush; an owner-bit CQ names it.)"
                          if f.syndrome == mlx5.SYNDROME_WR_FLUSH_ERR and not proxied else ""),
            syndrome=f.syndrome, vendor_syndrome=f.vendor_syndrome, qpn=f.qpn,
            wqe_counter=f.wqe_counter)
    elif code == STATUS_TIMEOUT:
        secs = f.waited_ns / 1e9
        if f.site == SITE_WAIT_UNTIL:
            msg = ("%s: timed out after %.3f s in wait_until on %s: waited for value %s %d, last "
                   "read %d (%s). The peer that should signal it is dead, late, or never sends "
                   "this signal." % (what, secs, _word(f), CMP_SYMBOLS.get(f.cmp, "?%d" % f.cmp),
                                     f.expected, f.observed, where))
        elif f.site == SITE_PROXY_FIFO:
            msg = ("%s: timed out after %.3f s in %s on %s: command #%d needs the proxy's tail to "
                   "reach %d, it is at %d. Is the proxy thread running?" % (
                       what, secs, site, where, f.seq, f.expected, f.observed))
        elif f.site == SITE_PROXY_QUIET:
            msg = ("%s: timed out after %.3f s in %s on %s: waiting for every command below #%d "
                   "to complete, completed %d. The peer or NIC may be dead, or the timeout too "
                   "short for the load." % (what, secs, site, where, f.expected, f.observed))
        else:
            msg = ("%s: timed out after %.3f s in %s on %s: WQEBB counter expected %d, observed %d "
                   "(WQEBB %d). The peer or NIC may be dead, or the timeout too short for the "
                   "load." % (what, secs, site, where, f.expected, f.observed, f.wqe_index))
        err = errors.TimeoutError(msg)
    elif code == STATUS_BAD_ARGUMENT:
        if f.site == SITE_PEER_RANGE:
            detail = "pe %d is out of range [0, %d)" % (_signed32(f.observed), f.expected)
        elif f.site == SITE_PEER_KIND:
            detail = "pe %d has no transport (PeerDesc.kind %d: none, or a kind this build " \
                     "does not know or was built without: devctx.cuh GPUNET_TRANSPORTS)" \
                     % (f.peer, f.observed)
        elif f.site == SITE_P2P_STORE_ONLY:
            detail = ("pe %d is reached by p2p under the c500 profile, which allows stores only "
                      "(sustained remote loads over MetaXLink left C500s unusable, FACTS.md), so "
                      "%s to it is refused: use SET signals (put_signal(..., op='set'), one writer "
                      "per word) or reach this peer through a NIC transport (transport={%d: "
                      "'ibgda'})" % (f.peer, P2P_REFUSED.get(f.observed, "op %d" % f.observed),
                                     f.peer))
        elif f.site == SITE_P2P_RANGE:
            detail = ("a p2p access to pe %d at heap offset %d runs outside its %d-byte heap"
                      % (f.peer, f.observed, f.expected))
        elif f.site == SITE_PROXY_CMD:
            detail = "the proxy rejected command #%d on %s (op %d unknown or out of place, or a " \
                     "peer it does not serve)" % (f.seq, where, f.observed)
        else:
            detail = "%s on %s: limit %d, got %d" % (site, where, f.expected, f.observed)
        err = errors.ConfigError("%s: bad argument: %s" % (what, detail))
    elif code == STATUS_QP_ERROR:
        err = errors.CompletionError("%s: posted on %s, which is in error" % (what, where), qpn=f.qpn)
    elif code == FAILURE_COHERENCE:
        x = f.extra
        err = errors.CoherenceViolation(
            "NIC %s (QP %d of pid %d, opcode 0x%02x) %s c500 `device` memory at 0x%x (%d bytes, key "
            "0x%x) owned by %s: that memory is not coherent with the NIC (the NIC sees HBM, SMs see "
            "L2). Use `finegrained` memory for NIC-read payload and `host` memory for rings and "
            "signals." % ("write" if x["is_write"] else "read", f.qpn, x["pid"], x["opcode"],
                          "wrote" if x["is_write"] else "read", f.addr, x["length"], x["key"],
                          x["owner"]))
    else:
        err = errors.GpunetError("%s: unknown failure code %d at %s" % (what, code, site))
    err.failure = f
    return err


def _signed32(v):
    v = int(v) & 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def proxy_failure(is_cqe, syndrome, vendor_syndrome, wqe_counter, qpn, seq, peer, channel):
    """The Failure a proxy channel's HostCtrl records, exactly as proxy.cuh's proxy_record_error
    copies it into a device Status. ``is_cqe``: an error CQE (else the proxy rejected the command:
    ``syndrome`` holds its op); the other fields come from gpunet/host/proxy.py's unpack_error, err_seq
    and err_peer; ``channel``: the channel's index (None: unknown)."""
    channel = CHANNEL_NONE if channel is None else int(channel)
    if is_cqe:
        return Failure(STATUS_COMPLETION_ERROR, SITE_CQE, qpn=int(qpn), peer=int(peer),
                       syndrome=int(syndrome), vendor_syndrome=int(vendor_syndrome),
                       wqe_counter=int(wqe_counter), channel=channel, seq=int(seq))
    return Failure(STATUS_BAD_ARGUMENT, SITE_PROXY_CMD, peer=int(peer), observed=int(syndrome),
                   channel=channel, seq=int(seq))


def coherence_error(qpn, opcode, key, addr, length, is_write, pid, owner):
    """The CoherenceViolation for the soft NIC's strict-mode record."""
    return failure_error(Failure(FAILURE_COHERENCE, qpn=int(qpn), addr=int(addr), extra=dict(
        opcode=int(opcode), key=int(key), length=int(length), is_write=bool(is_write),
        pid=int(pid), owner=owner)), "soft NIC")


_STATUS_FIELDS = ("code", "site", "qpn", "peer", "syndrome", "vendor_syndrome", "wqe_counter",
                  "block", "thread", "wqe_index", "expected", "observed", "waited_ns", "addr",
                  "heap_off", "cmp", "channel", "seq")


def status_failure(st):
    """The Failure a device Status block records (``code`` 0: none)."""
    f = Failure(**{k: int(getattr(st, k)) for k in _STATUS_FIELDS})
    f.valid = bool(st.valid)
    return f


def status_error(st, what="device kernel"):
    """The GpunetError a Status block describes, or None if it records no failure."""
    return failure_error(status_failure(st), what)


def raise_for_status(st, what="device kernel"):
    """Raise the failure a Status block records (a GpunetError subclass), if any."""
    err = status_error(st, what)
    if err is not None:
        raise err
