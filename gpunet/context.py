"""The Python API's owner object: a Context holds one rank's NIC, symmetric heap, QPs and transports.

    import gpunet, torch
    with gpunet.init() as ctx:                       # torch.distributed group, or torchrun env
        x = ctx.alloc((1024,), torch.float32)        # symmetric: same offset on every rank
        gpunet.put(ctx.remote((ctx.rank + 1) % ctx.world_size, x), x)
        gpunet.quiet()
        gpunet.barrier()

Each host wrapper (put / get / put_signal / atomic_add / quiet / barrier) launches the device
kernel of device/kernels/ops.cu with one thread: the same gpunet.cuh code a user kernel calls.
A failure the kernel records in its Status block is raised as a gpunet.GpunetError subclass.

Platforms (host/platform.py decides; GPUNET_PLATFORM=cpu forces the CPU):
- ``cpu``: the HOST arm's SIMT emulator runs the kernel; every launch is synchronous and every
  wrapper raises its own errors. Heap tensors are CPU tensors.
- ``cuda``: the kernel runs on the GPU, launched on ``torch.cuda.current_stream()``.
  put / get / put_signal only ENQUEUE the launch and return (stream-ordered after the work the
  caller queued before, e.g. the kernel that produced the payload); quiet / barrier /
  wait_until / atomic_add synchronize the stream, copy the Status block back and raise. So an
  error of an earlier non-blocking call surfaces at the next synchronizing call (its message
  names that call, not the failed put). Heap tensors are CUDA tensors (``device="cuda"``) over
  HOST-MAPPED memory: the soft NIC is a CPU thread that moves bytes with memmove, so the
  symmetric heap lives in its arena (pinned with cudaHostRegister); GPU kernels can compute on
  these tensors, but every access crosses PCIe (slow; copy into ordinary CUDA memory for heavy
  compute). gpunet needs the registered arena's device pointer to equal its host address (UVA,
  x86-64 Linux) because the NIC and the GPU use the same heap addresses; otherwise ConfigError.
  Descriptors (DevCtx, PeerDesc, QpDesc, Status) are in device memory (host/devctx.py); the op
  lists of in-flight launches are in the mapped arena.

Transports, per peer (DESIGN.md "Transports under one device API"):
- ``ibgda``: the kernel writes WQEs into the peer QP's send ring and rings its doorbell itself.
- ``proxy``: the kernel pushes 16-byte commands into a host-mapped FIFO and a CPU proxy thread
  posts them (host/proxy.py). ``auto`` picks ibgda where the NIC's doorbell can be mapped into the
  device (the soft NIC's always can), else the proxy, and logs which and why.
"""
import bisect
import ctypes
import logging
import math
import operator
import time

import numpy as np
import torch

from gpunet import mlx5
from gpunet.device import abi
from gpunet.errors import ClosedError, ConfigError, GpunetError
from gpunet.host.bootstrap import Bootstrap
from gpunet.host.devctx import DeviceContext, QpDescriptor
from gpunet.host.platform import get_platform
from gpunet.host.rawmem import address_of

log = logging.getLogger("gpunet")

TRANSPORTS = ("auto", "ibgda", "proxy")
NICS = ("auto", "soft", "verbs")
DEFAULT_HEAP_BYTES = 64 << 20     # per rank; the arena is sparse, untouched pages cost nothing
RESERVED_BYTES = 64 << 10         # heap head: barrier word, atomic result slots, NIC scratch
SCRATCH_SLOTS = 1024              # atomic_add result slots (one per concurrent device caller)
ALIGN = 256                       # symmetric allocations: 256-byte aligned (a GPU cache line x2)
SQ_WQEBBS = 256                   # per-peer send ring: 16 KiB, deep enough for a doorbell batch
PROXY_DEPTH = 1024                # proxy FIFO slots per channel
OPS_RING = 1024                   # GPU: OpDesc slots for launches in flight (64 KiB, mapped arena)
MAX_HEAP_BYTES = 1 << 39          # the proxy command carries 39-bit heap offsets (proxy.cuh)
MAX_TIMEOUT_S = 86400.0           # a device wait bound beyond a day is a units mistake
U64 = (1 << 64) - 1

# Open Contexts made by gpunet.init, oldest first. The module-level wrappers use the newest one
# still open, so closing a later Context falls back to the earlier one (a stack, not one slot).
# tests/test_api_adversarial.py::test_closing_a_second_context_falls_back_to_the_first.
_open = []


def current():
    """The most recently opened Context still open (the one ``gpunet.put`` & co. use)."""
    while _open and _open[-1].closed:
        _open.pop()
    if not _open:
        raise ClosedError("no open gpunet Context: call gpunet.init() first")
    return _open[-1]


def _make_current(ctx):
    _open.append(ctx)


# --- argument checks at the API boundary (ConfigError, never a TypeError from deeper down) -------
def _index(v, what):
    """``v`` as a Python int: an int, a numpy integer, anything with ``__index__`` — not a bool
    (True is not a rank) and not a float (1.0 is not an offset)."""
    if isinstance(v, (bool, np.bool_)):
        raise ConfigError("%s must be an integer, not a bool (%r)" % (what, v))
    try:
        return operator.index(v)
    except TypeError:
        raise ConfigError("%s must be an integer, not %s (%r)" % (what, type(v).__name__, v)) \
            from None


def _word(v, what):
    """A 64-bit operand (signal value, addend): an integer in [-2**63, 2**64), as unsigned."""
    v = _index(v, what)
    if not -(1 << 63) <= v <= U64:
        raise ConfigError("%s %d does not fit a 64-bit word (-2**63 .. 2**64 - 1)" % (what, v))
    return v & U64


def _shape(shape):
    """An alloc shape (an int, or a tuple / list / torch.Size of ints >= 0) as a tuple of ints."""
    dims = shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,)
    dims = tuple(_index(d, "alloc: shape entry") for d in dims)
    if any(d < 0 for d in dims):
        raise ConfigError("alloc: shape must be non-negative ints, got %r" % (dims,))
    return dims


class _Alloc:
    """One live symmetric allocation: heap offset, size taken (ALIGN multiple), the bytes the
    caller asked for, and the storage of the tensor alloc returned, which every view shares: a
    tensor belongs to this allocation iff it has this storage (a freed one's record is gone)."""

    __slots__ = ("off", "size", "nbytes", "storage")

    def __init__(self, off, size, nbytes, storage):
        self.off, self.size, self.nbytes, self.storage = off, size, nbytes, storage


class Remote:
    """A remote location: ``nbytes`` at symmetric heap offset ``offset`` on rank ``rank``.

    Made by ``ctx.remote(rank, tensor, offset)`` and tied to that Context and to the allocation of
    ``tensor``: an operation checks, before anything is posted, that it is this Context's Remote
    and that the allocation is still live, so a Remote of another Context, of a freed allocation,
    or made by hand (no Context) raises ConfigError instead of reaching the NIC. Immutable.
    """

    __slots__ = ("rank", "offset", "nbytes", "_ctx", "_alloc")

    def __init__(self, rank, offset, nbytes, _ctx=None, _alloc=None):
        for k, v in (("rank", rank), ("offset", offset), ("nbytes", nbytes), ("_ctx", _ctx),
                     ("_alloc", _alloc)):
            object.__setattr__(self, k, v)

    def __setattr__(self, name, value):
        raise AttributeError("a gpunet Remote is immutable: make another with ctx.remote()")

    def __repr__(self):
        return "Remote(rank=%r, offset=%r, nbytes=%r)" % (self.rank, self.offset, self.nbytes)


class Context:
    """One rank's gpunet resources. Use :func:`gpunet.init` to make one.

    Attributes: ``rank``, ``world_size``, ``transports`` (dict peer -> "ibgda" | "proxy"),
    ``reasons`` (dict peer -> why that transport), ``platform``, ``nic``, ``heap_bytes``.
    ``transport`` is one kind for every peer ("auto" | "ibgda" | "proxy") or a per-peer choice:
    a dict {peer: kind, "default": kind} or a callable (rank, peer) -> kind (both ends of a pair
    must agree, e.g. ``lambda a, b: "proxy" if (a + b) % 2 else "ibgda"``: a mixed world).
    """

    def __init__(self, group=None, transport="auto", nic="auto", heap_bytes=DEFAULT_HEAP_BYTES,
                 timeout_s=10.0, warp_size=None, proxy_threads=1, **unknown):
        self.closed = False
        self._closers = []          # (name, fn), closed in reverse order
        self._allocs = {}           # heap offset -> _Alloc (live symmetric allocations)
        self._by_storage = {}       # storage id (_cdata) -> _Alloc
        self._free = []             # sorted, coalesced (offset, size) free ranges below _top
        self._top = RESERVED_BYTES  # [_top, heap_bytes) is free too
        self._barrier_epoch = 0
        self._proxy = None
        try:
            self._setup(group, dict(transport=transport, nic=nic, heap_bytes=heap_bytes,
                                    timeout_s=timeout_s, warp_size=warp_size,
                                    proxy_threads=proxy_threads), unknown)
        except BaseException:
            self.close()
            raise

    # --- set-up -----------------------------------------------------------------------------
    def _setup(self, group, args, unknown):
        """Collective: two steps, each ending in ONE exchange that carries this rank's result or
        its failure (Bootstrap.collective), so a bad argument or a failed resource on one rank
        raises a gpunet error on every rank at once. 1: check the arguments, make the NIC, heap
        and QPs, exchange what peers need; 2: connect and build the device context."""
        boot = Bootstrap(group) if group is not None else Bootstrap.from_env()
        self._boot = boot
        self._closers.append(("bootstrap", boot.close))
        self.rank, self.world_size = boot.rank, boot.world_size
        everyone = boot.collective("gpunet.init", self._setup_local, args, unknown)
        n = self.world_size
        sizes = [e["heap_bytes"] for e in everyone]
        if len(set(sizes)) != 1:
            raise ConfigError("gpunet.init is collective: every rank must pass the same heap_bytes "
                              "(%s)" % ", ".join("rank %d: %d" % rs for rs in enumerate(sizes)))
        for i in range(n):
            for j in range(n):
                if everyone[i]["transports"][j] != everyone[j]["transports"][i]:
                    raise ConfigError(
                        "gpunet.init: rank %d reaches rank %d by %s, but rank %d reaches rank %d by "
                        "%s; both ends of a pair must use one transport (pass the same transport= "
                        "on every rank)" % (i, j, everyone[i]["transports"][j], j, i,
                                            everyone[j]["transports"][i]))
        boot.collective("gpunet.init (connecting)", self._setup_connect, everyone)

    @staticmethod
    def _check_args(a, unknown):
        """ConfigError for init arguments of the wrong type or range (checked on every rank before
        anything is made; bool is not an int, a float is not a byte count)."""
        if unknown:
            raise ConfigError("unknown keyword argument(s) %s to gpunet.init (it takes group, "
                              "transport, nic, heap_bytes, timeout_s, warp_size, proxy_threads)"
                              % ", ".join(sorted(unknown)))
        _check_transport(a["transport"])
        if not isinstance(a["nic"], str) or a["nic"] not in NICS:
            raise ConfigError("nic must be one of %s, not %r" % (NICS, a["nic"]))
        hb = _index(a["heap_bytes"], "heap_bytes")
        if not RESERVED_BYTES + ALIGN <= hb <= MAX_HEAP_BYTES:
            raise ConfigError("heap_bytes must be at least %d and at most %d (2**39), not %d"
                              % (RESERVED_BYTES + ALIGN, MAX_HEAP_BYTES, hb))
        t = a["timeout_s"]
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, float, np.integer, np.floating)) \
                or not 0 < t <= MAX_TIMEOUT_S:
            raise ConfigError("timeout_s must be a number of seconds in (0, %g], not %r"
                              % (MAX_TIMEOUT_S, t))
        if a["warp_size"] is not None and _index(a["warp_size"], "warp_size") not in (32, 64):
            raise ConfigError("warp_size must be 32 or 64 (or None: the platform's), not %r"
                              % (a["warp_size"],))
        if _index(a["proxy_threads"], "proxy_threads") != 1:
            raise ConfigError("proxy_threads: one channel per rank is drained by one thread here, "
                              "so it must be 1, not %r" % (a["proxy_threads"],))
        return (a["transport"], a["nic"], hb, float(t),
                None if a["warp_size"] is None else int(a["warp_size"]), 1)

    def _setup_local(self, args, unknown):
        """Step 1 on this rank: arguments, NIC, heap, QPs; returns what the peers need."""
        from gpunet.device.ops import Launch, load_ops
        from gpunet.host import verbs
        from gpunet.host.softnic import SoftNic

        transport, nic, heap_bytes, timeout_s, warp_size, proxy_threads = \
            self._check_args(args, unknown)
        self._proxy_threads = proxy_threads
        self.platform = get_platform()
        self._gpu = self.platform.name == "cuda"
        self._tensor_device = "cuda" if self._gpu else "cpu"     # what ctx.alloc returns
        if self.platform.name not in ("cpu", "cuda"):
            raise ConfigError("gpunet.init on %s: the Python API runs on the CPU and CUDA platforms "
                              "in this release (the MACA arm is unverified); set GPUNET_PLATFORM=cpu "
                              "to use the CPU path." % self.platform.name)
        if self._gpu and not torch.cuda.is_available():
            raise ConfigError("gpunet.init on cuda: torch.cuda is not available (a CPU-only torch?); "
                              "install a CUDA build of torch or set GPUNET_PLATFORM=cpu")
        if warp_size is not None and self.platform.name != "cpu" and \
                warp_size != self.platform.warp_size:
            raise ConfigError("warp_size %d: the %s platform's warps have %d lanes"
                              % (warp_size, self.platform.name, self.platform.warp_size))
        if nic == "verbs" or (nic == "auto" and verbs.have_pyverbs() and verbs.available_devices()):
            verbs.VerbsNic()        # raises NoRdmaDeviceError with what to do when there is none
            raise ConfigError("nic='verbs': the real-NIC path is not wired into the Python API yet; "
                              "use nic='soft'")
        try:
            self.nic = SoftNic(profile=self.platform.profile,
                               retry_timeout_s=min(timeout_s / 2, 2.0),
                               arena_bytes=heap_bytes + (8 << 20), name="rank%d" % self.rank)
        except OSError as e:
            raise ConfigError("gpunet.init: cannot create the soft NIC's %d-byte shared-memory arena "
                              "in /dev/shm (%s); pass a smaller heap_bytes or free /dev/shm"
                              % (heap_bytes + (8 << 20), e)) from e
        self._closers.append(("soft NIC", self.nic.close))
        self._mem = None                 # descriptors: HOST arm = the host structs themselves
        if self._gpu:
            self._setup_gpu_memory()
        self.heap_bytes = heap_bytes
        self._heap = self.nic.alloc(heap_bytes, 4096)
        kind = self.platform.policy("payload_dst").kind
        self._mr = self.nic.reg_mr(self._heap, kind=kind)
        self.heap_base = address_of(self._heap)
        self.timeout_s = timeout_s
        self.warp_size = warp_size or self.platform.warp_size
        self._launch = Launch(grid=1, block=1, warp_size=self.warp_size)
        self._ops_lib = load_ops("cuda" if self._gpu else "host")
        if self._gpu:
            u32, vp = ctypes.c_uint32, ctypes.c_void_p
            f = self._ops_lib.gpunet_ops_launch_stream
            f.argtypes, f.restype = [u32, u32, u32, vp, vp, u32, vp, u32], ctypes.c_int
            self._ops_ring = self.nic.alloc(OPS_RING * ctypes.sizeof(abi.OpDesc), 4096)
            self._ops_top = 0            # next free OpDesc slot; reset after each stream sync

        # Transports, per peer (all peers share this NIC's doorbell page, so one probe decides).
        n, me = self.world_size, self.rank
        self.transports, self.reasons = {}, {}
        for p in range(n):
            t, why = choose_transport(_peer_transport(transport, me, p), self._probe_doorbell)
            if not isinstance(transport, str):
                why = "per-peer choice %r; %s" % (_peer_transport(transport, me, p), why)
            self.transports[p], self.reasons[p] = t, why
            log.info("gpunet rank %d -> peer %d: %s (%s)", me, p, t, why)

        # One RC QP per peer and transport user (the device, or the proxy threads: a QP has one
        # poster), plus loopback partners for this rank itself; exchanged over bootstrap.
        users = sorted(set(self.transports.values()))
        qps, partner = {}, {}
        for u in users:
            for p in range(n):
                cq = self.nic.create_cq(cqe_cnt=SQ_WQEBBS)
                qps[u, p] = self.nic.create_qp(cq, sq_wqebbs=SQ_WQEBBS)
            cq = self.nic.create_cq(cqe_cnt=SQ_WQEBBS)
            partner[u] = self.nic.create_qp(cq, sq_wqebbs=SQ_WQEBBS)
        self._qps, self._partner = qps, partner
        return {"qps": {k: q.info() for k, q in qps.items()}, "heap": self.heap_base,
                "rkey": self._mr.rkey, "heap_bytes": heap_bytes, "transports": dict(self.transports)}

    def _setup_connect(self, everyone):
        """Step 2 on this rank: connect the QPs to the peers', build the device context."""
        n, me = self.world_size, self.rank
        qps, partner = self._qps, self._partner
        users = sorted(set(self.transports.values()))
        heap_bytes, timeout_s = self.heap_bytes, self.timeout_s
        for (u, p), q in qps.items():
            if p == me:
                self.nic.connect(q, partner[u].info())
                self.nic.connect(partner[u], q.info())
            else:
                self.nic.connect(q, everyone[p]["qps"][u, me])

        # The device context.
        scratch = self.heap_base + 4096
        self._dev = DeviceContext(self.heap_base, heap_bytes, self._mr.lkey, n, me, scratch,
                                  SCRATCH_SLOTS, scratch + SCRATCH_SLOTS * 8, timeout_s, mem=self._mem)
        self._qpds = {}                  # peer -> QpDescriptor (ibgda peers)
        for p in range(n):
            if self.transports[p] == "ibgda":
                qpd = QpDescriptor(qps["ibgda", p], p, mem=self._mem,
                                   mapped=getattr(self, "_mapped", None))
                self._dev.set_peer_qp(p, qpd, everyone[p]["heap"], everyone[p]["rkey"])
                self._qpds[p] = qpd
        if "proxy" in users:
            self._setup_proxy([p for p in range(n) if self.transports[p] == "proxy"],
                              [[qps["proxy", p]] for p in range(n)], everyone,
                              self._proxy_threads)
        if self._gpu:                    # closed first: no kernel may run on freed descriptors
            self._closers.append(("CUDA stream", lambda: torch.cuda.current_stream().synchronize()))

    def _setup_gpu_memory(self):
        """CUDA: register the soft NIC's whole arena (heap, rings, CQs, DBRs, doorbell words, op
        lists) with the GPU, check UVA, and make the device-memory allocator for descriptors."""
        from gpunet.host.devctx import DeviceMemory, MappedArena

        torch.cuda.init()                # the runtime calls below then use torch's current device
        self._mapped = MappedArena(self.platform, self.nic)
        self._closers.append(("arena registration", self._mapped.close))
        if not self._mapped.identity:
            raise ConfigError("gpunet on cuda: the soft NIC arena registered at host 0x%x got device "
                              "pointer 0x%x; the Python API needs them equal (unified addressing, "
                              "x86-64 Linux with a 64-bit CUDA driver), because the NIC and the GPU "
                              "use the same heap addresses" % (self._mapped.base, self._mapped.dptr))
        self._mem = DeviceMemory(self.platform)
        self._closers.append(("device descriptors", self._mem.close))

    def _probe_doorbell(self):
        """Map the NIC's doorbell into the device, or raise VendorRuntimeError. The soft NIC's
        doorbell word lives in its arena: ordinary memory on the CPU, and on CUDA the arena is
        already registered (Mapped) by _setup_gpu_memory. A real mlx5 UAR would be registered here
        with cudaHostRegister(Mapped | IoMemory), which drivers may refuse (error 800)."""
        return "the soft NIC's doorbell word is %s" % (
            "host memory registered with the GPU (cudaHostRegister)" if self._gpu else
            "memory the HOST arm's device threads store to")

    def _setup_proxy(self, proxied, qps_per_peer, everyone, threads):
        """One proxy channel per proxied peer, all drained by ``threads`` proxy threads. Per peer,
        because a channel's recorded failure is sticky (every later quiet on it fails): a dead
        peer then fails the operations to it alone, and code that decides per peer (gpunet.ep's
        masking, tests/test_ep_ll.py's killed-rank tests over the proxy) can go on with the rest."""
        from gpunet.host.proxy import ProxyChannel, ProxyEngine

        self._proxy_channels = {}            # peer -> ProxyChannel
        for p in proxied:
            ch = ProxyChannel(depth=PROXY_DEPTH, platform=self.platform if self._gpu else None)
            self._closers.append(("proxy channel %d" % p, ch.close))
            self._proxy_channels[p] = ch
        remote_heaps = [(everyone[p]["heap"], everyone[p]["rkey"]) for p in range(len(everyone))]
        # kept to start a new engine on the same channels and QPs after a reset (_recover_proxy)
        self._proxy_args = (self.nic, list(self._proxy_channels.values()), qps_per_peer,
                            (self.heap_base, self._mr.lkey), remote_heaps)
        self._proxy = ProxyEngine(*self._proxy_args, threads=threads)
        self._closers.append(("proxy engine", lambda: self._proxy.close()))
        for p, ch in self._proxy_channels.items():
            desc = self._dev.place(ch.descriptor())  # uint64[4]: HOST arm in place, GPU a device copy
            self._dev.set_peer_proxy(p, desc, everyone[p]["heap"], everyone[p]["rkey"])

    # --- lifetime -----------------------------------------------------------------------------
    def close(self):
        """Free everything this Context made, in reverse order; idempotent, also after errors.

        Not collective, on purpose: close must work when peers have crashed (it never waits for
        them). Peers that later post to this rank get a TimeoutError / CompletionError (a dead
        peer), never a hang. The module-level wrappers fall back to the previous open Context."""
        if getattr(self, "_closing", False):
            return
        self._closing = True
        errs = []
        for name, fn in reversed(self._closers):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - close the rest, then report
                errs.append("%s: %s" % (name, e))
        self._closers = []
        self.closed = True
        if self in _open:
            _open.remove(self)
        if errs:
            raise GpunetError("errors while closing the gpunet Context: " + "; ".join(errs))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check(self):
        if self.closed:
            raise ClosedError("this gpunet Context is closed")

    # --- the symmetric heap ---------------------------------------------------------------------
    def alloc(self, shape, dtype=torch.float32):
        """A zeroed symmetric tensor: collective, the same offset on every rank.

        ``shape``: int or tuple of ints (0 allowed: an empty tensor that still owns its range, so
        free() of it frees exactly it); ``dtype``: a torch dtype. Returns a torch tensor viewing
        the registered heap (so puts and gets reach it without a copy): a CPU tensor on the CPU
        platform; on CUDA a ``device="cuda"`` tensor over the host-mapped heap (see the module
        docstring: GPU kernels can use it, over PCIe). On CUDA, alloc first synchronizes the
        current stream (a reused range must not still be read by an enqueued put).

        Collective with one exchange: a bad shape or a full heap on any rank raises ConfigError
        on every rank, and no rank keeps the range.
        """
        self._check()
        made = {}

        def local():
            # Everything that can fail on this rank happens before the one exchange, so that the
            # ranks agree: a range is kept everywhere or nowhere.
            if self._gpu:
                self._sync("alloc")
            dims = _shape(shape)
            if not isinstance(dtype, torch.dtype):
                raise ConfigError("alloc: dtype must be a torch dtype, got %r" % (dtype,))
            nbytes = math.prod(dims) * dtype.itemsize          # Python ints: no int64 wrap
            if nbytes > self.heap_bytes - RESERVED_BYTES:
                raise ConfigError("symmetric heap full: alloc of shape %r (%s) needs %d bytes, more "
                                  "than the whole heap (%d usable); pass a larger heap_bytes to "
                                  "gpunet.init" % (dims, dtype, nbytes,
                                                   self.heap_bytes - RESERVED_BYTES))
            size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
            off = self._take(size)
            try:
                self._heap[off:off + size] = 0
                if self._gpu:
                    whole = _cuda_view(self.heap_base + off, size, self)
                else:
                    whole = torch.frombuffer(memoryview(self._heap[off:off + size]),
                                             dtype=torch.uint8)
                made["t"] = whole[:nbytes].view(dtype).reshape(dims)
                made["alloc"] = _Alloc(off, size, nbytes, whole.untyped_storage())
            except BaseException:
                self._release(off, size)
                raise
            return off, size

        got = self._boot.collective("alloc", local, undo=lambda r: self._release(*r))
        off, size = got[self.rank]
        if any(g != (off, size) for g in got):
            self._release(off, size)
            raise ConfigError("alloc is collective: every rank must allocate the same shapes in the "
                              "same order (offsets/sizes per rank: %r)" % (got,))
        a = made["alloc"]
        self._allocs[off] = a
        self._by_storage[a.storage._cdata] = a
        return made["t"]

    def free(self, tensor):
        """Return a tensor from :meth:`alloc` to the heap (collective, like alloc).

        ``tensor`` must be the whole allocation (the tensor alloc returned, or a view of all of
        it): a part of one, a freed one or any other tensor raises ConfigError on every rank and
        frees nothing. Ranks must free the same allocation.
        """
        self._check()

        def local():
            a = self._whole_alloc(tensor)
            return a.off

        offs = self._boot.collective("free", local)
        if len(set(offs)) != 1:
            raise ConfigError("free is collective: every rank must free the same allocation (heap "
                              "offsets per rank: %r)" % (offs,))
        a = self._allocs.pop(offs[0])
        del self._by_storage[a.storage._cdata]
        self._release(a.off, a.size)

    def _whole_alloc(self, tensor):
        """The live allocation ``tensor`` is all of, or ConfigError."""
        a, off = self._locate(tensor, "free")
        if off != a.off or tensor.nbytes != a.nbytes:
            raise ConfigError("free: the tensor is %d bytes at +%d of an allocation of %d bytes; "
                              "pass the tensor ctx.alloc() returned" % (tensor.nbytes, off - a.off,
                                                                       a.nbytes))
        return a

    def _take(self, size):
        """First fit in the free ranges, else from the top; ConfigError when nothing fits."""
        for i, (o, s) in enumerate(self._free):
            if s >= size:
                if s == size:
                    self._free.pop(i)
                else:
                    self._free[i] = (o + size, s - size)
                return o
        if self._top + size > self.heap_bytes:
            largest = max([s for _, s in self._free] + [self.heap_bytes - self._top])
            raise ConfigError("symmetric heap full: %d bytes asked, the largest free range is %d "
                              "bytes (heap of %d); pass a larger heap_bytes to gpunet.init"
                              % (size, largest, self.heap_bytes))
        off = self._top
        self._top += size
        return off

    def _release(self, off, size):
        """Give [off, off + size) back: merged with the free ranges it touches, and the top
        lowered when the range ends there, so that after freeing everything one allocation of the
        whole heap fits again. tests/test_api_adversarial.py::test_heap_model."""
        i = bisect.bisect_left(self._free, (off, size))
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
            i -= 1
            off, size = self._free[i][0], self._free[i][1] + size
            self._free.pop(i)
        if i < len(self._free) and off + size == self._free[i][0]:
            size += self._free[i][1]
            self._free.pop(i)
        if off + size == self._top:
            self._top = off
        else:
            self._free.insert(i, (off, size))

    def _locate(self, tensor, what):
        """(allocation, heap offset of the first byte) of a view of a live symmetric allocation of
        this Context; ConfigError for anything else (wrong type or device, another Context's or a
        freed allocation, memory outside the heap)."""
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError("%s: expected a torch.Tensor, got %s" % (what, type(tensor).__name__))
        want = self._tensor_device
        if tensor.device.type != want:
            raise ConfigError("%s: tensor is on %s; this Context's heap tensors are %s tensors "
                              "(ctx.alloc)" % (what, tensor.device, want))
        try:
            st = tensor.untyped_storage()
        except Exception:  # noqa: BLE001 - sparse and other layouts have no plain storage
            raise ConfigError("%s: a %s tensor has no plain storage; heap tensors are dense"
                              % (what, tensor.layout)) from None
        # _cdata names the StorageImpl, which every view of the alloc'd tensor shares (torch keeps
        # one Python storage object per StorageImpl); the record holds it, so it is never reused
        a = self._by_storage.get(st._cdata)
        if a is None:
            inside = 0 <= st.data_ptr() - self.heap_base < self.heap_bytes
            raise ConfigError("%s: the tensor is %s; allocate it with ctx.alloc()" % (
                what, "in a freed allocation of the symmetric heap" if inside else
                "outside the symmetric heap (or in another Context's heap)"))
        return a, a.off + tensor.storage_offset() * tensor.element_size()

    def _offset_of(self, tensor, what):
        """Heap offset of a contiguous heap tensor's first byte (see _locate)."""
        a, off = self._locate(tensor, what)
        if not tensor.is_contiguous():
            raise ConfigError("%s: tensor is not contiguous; call .contiguous() on a heap tensor "
                              "view, or copy into a symmetric tensor first" % what)
        return off

    def _rank(self, rank, what):
        r = _index(rank, "%s: rank" % what)
        if not 0 <= r < self.world_size:
            raise ConfigError("%s: rank %r out of range [0, %d)" % (what, rank, self.world_size))
        return r

    def remote(self, rank, tensor, offset=0):
        """The copy of symmetric ``tensor`` on ``rank``, from element ``offset`` on: a Remote tied
        to this Context and to ``tensor``'s allocation (checked again at every use)."""
        self._check()
        rank = self._rank(rank, "remote")
        a, base = self._locate(tensor, "remote")
        if not tensor.is_contiguous():
            raise ConfigError("remote: tensor is not contiguous")
        offset = _index(offset, "remote: offset")
        if not 0 <= offset <= tensor.numel():
            raise ConfigError("remote: offset %d out of range for a tensor of %d elements"
                              % (offset, tensor.numel()))
        es = tensor.element_size()
        return Remote(rank, base + offset * es, tensor.nbytes - offset * es, self, a)

    # --- device launches -------------------------------------------------------------------------
    def _run(self, ops, what, blocking=True):
        """Launch ops.cu's op-list kernel on ``ops``. CPU: synchronous, raises. CUDA: enqueued on
        the current stream; ``blocking``: then synchronize and raise (see the module docstring).
        Returns the OpDesc array the kernel wrote (results valid once synchronized)."""
        self._check()
        if self._gpu:
            return self._run_gpu(ops, what, blocking)
        if self._dev.status.code:        # a kernel writes the Status only to record a failure:
            self._dev.clear_status()     # clear it only then (a memset a call cost ~1 us)
        rc = self._ops_lib.gpunet_ops_launch(*self._launch.args(), self._dev.addr,
                                             ctypes.addressof(ops), len(ops))
        if rc != 0:
            raise GpunetError("%s: device kernel launch failed (%d)" % (what, rc))
        err = abi.status_error(self._dev.read_status(), what)
        if err is None and self._proxy is not None:
            err = self._proxy_failure()
        if err is not None:
            self._fail(err)
        return ops

    def _run_gpu(self, ops, what, blocking):
        n = len(ops)
        if n > OPS_RING:
            raise ConfigError("%s: %d ops exceed the launch ring (%d)" % (what, n, OPS_RING))
        if self._ops_top + n > OPS_RING:
            self._sync(what)             # every slot in flight: wait for them (and raise)
        addr = address_of(self._ops_ring) + self._ops_top * ctypes.sizeof(abi.OpDesc)
        self._ops_top += n
        dops = (abi.OpDesc * n).from_address(addr)
        ctypes.memmove(addr, ctypes.addressof(ops), ctypes.sizeof(ops))
        stream = torch.cuda.current_stream()
        rc = self._ops_lib.gpunet_ops_launch_stream(1, 1, self.warp_size, self._dev.addr, addr, n,
                                                    stream.cuda_stream or None, 0)
        if rc != 0:
            raise GpunetError("%s: CUDA kernel launch failed (cudaError %d)" % (what, rc))
        if blocking:
            self._sync(what)
        return dops

    def _sync(self, what):
        """CUDA: wait for the current stream, then raise what the kernels (or the proxy) recorded
        since the last synchronizing call, and clear it."""
        torch.cuda.current_stream().synchronize()
        self._ops_top = 0
        err = abi.status_error(self._dev.read_status(),
                               what + " (or an earlier non-blocking call on this stream)")
        if err is not None:
            self._dev.clear_status()
        elif self._proxy is not None:
            err = self._proxy_failure()
        if err is not None:
            self._fail(err)

    # --- after a failure: put the transports back in working order, or say why not ---------------
    def _proxy_failure(self):
        try:
            self._proxy.check()
        except GpunetError as e:
            return e
        return None

    def _fail(self, err):
        """Raise ``err`` (a failure a kernel or the proxy recorded; nothing of ours is running)
        after :meth:`_recover`; its message then also says what was reset or what stays broken."""
        try:
            note = self._recover()
        except Exception as e:  # noqa: BLE001 - the original failure is what the caller needs
            note = ("recovery failed (%s: %s); close this Context and start a new one"
                    % (type(e).__name__, e))
        if note:
            err.args = ("%s [%s]" % (err.args[0] if err.args else "", note),) + tuple(err.args[1:])
        raise err

    def _recover(self):
        """Bring every QP of this Context that a failure left unusable back to RTS, so that the
        next good operation works: a QP the NIC moved to ERR (a protection error, a bad WQE) or
        whose device posting state cannot go on (an error CQE seen, a reservation never
        published) is reset at the NIC (SoftNic.reset_qp) and in its device descriptor
        (QpDescriptor.reset); the proxy's channel is drained, its engine restarted on the reset
        QPs and its recorded failure cleared. Work queued on a reset QP after the failed
        operation is discarded. A QP whose peer did not answer (retry exceeded: dead) is left in
        error, and the note says so: every later operation to that peer fails at once.
        Returns a note for the error message ("" when nothing needed doing).
        tests/test_api_adversarial.py::test_protection_error_is_raised_then_the_context_recovers.
        """
        notes = []
        for p, qpd in getattr(self, "_qpds", {}).items():
            if self.nic.qp_state(qpd.qp) != "ERR" and not qpd.needs_reset():
                continue
            if self._dead_peer(qpd.qp, p, notes):
                continue
            qpd.reset(self.nic.reset_qp(qpd.qp, timeout_s=self.timeout_s))
            notes.append("the QP to peer %d was reset to RTS (what was queued on it after the "
                         "failed operation was discarded)" % p)
        if self._proxy is not None:
            notes += self._recover_proxy()
        return "; ".join(notes)

    def _dead_peer(self, qp, peer, notes):
        if self.nic.qp_error_syndrome(qp) != mlx5.SYNDROME_TRANSPORT_RETRY_EXC_ERR:
            return False
        notes.append("the QP to peer %d stays in error: the peer did not answer (retry exceeded: "
                     "dead?), so every later operation to it fails at once; close this Context"
                     % peer)
        return True

    def _recover_proxy(self):
        from gpunet.host.proxy import ProxyEngine, resume_after_reset

        chans = list(self._proxy_channels.values())
        bad = [(p, row[0]) for p, row in enumerate(self._proxy_args[2])
               if self.nic.qp_state(row[0]) == "ERR"]
        if all(ch.error() is None for ch in chans) and not bad:
            return []
        # Every command pushed so far completes first (those behind an error flush), so that the
        # new engine, which resumes at `completed`, takes none of them again.
        deadline = time.monotonic() + self.timeout_s
        for ch in chans:
            head = self._proxy_head(ch)
            while ch.completed < head:
                if time.monotonic() > deadline or self._proxy.alive_threads() == []:
                    return ["a proxy channel did not drain (%d of %d commands completed), so it "
                            "stays failed; close this Context" % (ch.completed, head)]
                time.sleep(50e-6)
        self._proxy.close()
        notes = []
        for p, qp in bad:
            if self._dead_peer(qp, p, notes):
                continue
            resume_after_reset(qp, self.nic.reset_qp(qp, timeout_s=self.timeout_s))
            notes.append("the proxy's QP to peer %d was reset to RTS (what was queued on it after "
                         "the failed command was discarded)" % p)
        for ch in chans:
            ch.clear_error()
        self._proxy = ProxyEngine(*self._proxy_args, threads=self._proxy_threads)
        return notes or ["the proxy channel's failure was cleared"]

    def _proxy_head(self, ch):
        """Commands pushed into proxy channel ``ch`` so far (DevCtrl.head; on a GPU device memory)."""
        if not self._gpu:
            return ch.head
        word = np.zeros(1, dtype=np.uint64)
        self.platform.memcpy(word.ctypes.data, ch.dctrl_addr, 8)
        return int(word[0])

    def _ops(self, *specs):
        ops = (abi.OpDesc * len(specs))()
        for o, s in zip(ops, specs):
            for k, v in s.items():
                setattr(o, k, v)
        return ops

    def _check_remote(self, remote, nbytes, what):
        """Before anything is posted: ``remote`` is this Context's, its allocation is live, and
        ``nbytes`` fit it (so no range outside the peer's live heap reaches the NIC)."""
        if not isinstance(remote, Remote):
            raise ConfigError("%s: expected a gpunet Remote (ctx.remote(rank, tensor)), got %s"
                              % (what, type(remote).__name__))
        if remote._ctx is not self:
            raise ConfigError("%s: %r was %s; a Remote names a range of the Context that made it "
                              "(use this Context's ctx.remote(rank, tensor))" % (
                                  what, remote, "made by another Context" if remote._ctx is not None
                                  else "not made by ctx.remote()"))
        a = remote._alloc
        if self._allocs.get(a.off) is not a:
            raise ConfigError("%s: %r points into an allocation that was freed" % (what, remote))
        if nbytes > remote.nbytes:
            raise ConfigError("%s: %d bytes do not fit the remote range of %d bytes"
                              % (what, nbytes, remote.nbytes))

    def put(self, remote, tensor):
        """Non-blocking put of ``tensor`` (a heap tensor, any dtype) to ``remote``; see quiet()."""
        off = self._offset_of(tensor, "put")
        self._check_remote(remote, tensor.nbytes, "put")
        self._run(self._ops(dict(kind=abi.OP_PUT, pe=remote.rank, dst=self.heap_base + remote.offset,
                                 src=self.heap_base + off, nbytes=tensor.nbytes)), "put",
                  blocking=False)

    def get(self, tensor, remote):
        """Non-blocking get of ``tensor.nbytes`` from ``remote`` into heap ``tensor``; see quiet()."""
        off = self._offset_of(tensor, "get")
        self._check_remote(remote, tensor.nbytes, "get")
        self._run(self._ops(dict(kind=abi.OP_GET, pe=remote.rank, dst=self.heap_base + off,
                                 src=self.heap_base + remote.offset, nbytes=tensor.nbytes)), "get",
                  blocking=False)

    def put_signal(self, remote, tensor, signal, value=1):
        """Put ``tensor`` to ``remote``, then add ``value`` to the 8-byte ``signal`` (a Remote on
        the same rank), in that order: a peer that sees the signal sees the payload."""
        off = self._offset_of(tensor, "put_signal")
        self._check_remote(remote, tensor.nbytes, "put_signal")
        self._check_remote(signal, 8, "put_signal (signal)")
        value = _word(value, "put_signal: value")
        if signal.rank != remote.rank:
            raise ConfigError("put_signal: payload and signal must be on the same rank")
        if signal.offset % 8:
            raise ConfigError("put_signal: the signal word must be 8-byte aligned")
        self._run(self._ops(dict(kind=abi.OP_PUT_SIGNAL, pe=remote.rank,
                                 dst=self.heap_base + remote.offset, src=self.heap_base + off,
                                 nbytes=tensor.nbytes, sig=self.heap_base + signal.offset,
                                 value=value)), "put_signal",
                  blocking=False)

    def atomic_add(self, remote, value):
        """Atomically add ``value`` to the 8-byte word at ``remote``; returns the old value (int).

        The word is a big-endian uint64, as the NIC's atomics see it: read it with
        :func:`gpunet.read_signal`.
        """
        self._check_remote(remote, 8, "atomic_add")
        if remote.offset % 8:
            raise ConfigError("atomic_add: the word must be 8-byte aligned")
        value = _word(value, "atomic_add: value")
        ops = self._run(self._ops(dict(kind=abi.OP_ATOMIC_ADD, pe=remote.rank,
                                       dst=self.heap_base + remote.offset, value=value)),
                        "atomic_add")
        return int(ops[0].result)

    def wait_until(self, signal, value, cmp="ge", index=0):
        """Wait (bounded by the Context's timeout) until the 8-byte signal word ``signal[index]``
        (an int64 or uint64 heap tensor, NIC-updated, big-endian) compares ``cmp`` to ``value``
        (an integer in -2**63 .. 2**64 - 1, compared as unsigned 64-bit):
        "eq" | "ne" | "ge" | "gt" | "le" | "lt". After it returns, every payload the signalling
        peer put before the signal is visible. Raises gpunet.TimeoutError on timeout."""
        cmps = {"eq": abi.CMP_EQ, "ne": abi.CMP_NE, "ge": abi.CMP_GE, "gt": abi.CMP_GT,
                "le": abi.CMP_LE, "lt": abi.CMP_LT}
        if not isinstance(cmp, str) or cmp not in cmps:
            raise ConfigError("wait_until: cmp must be one of %s, not %r" % (sorted(cmps), cmp))
        off = self._offset_of(signal, "wait_until")
        if signal.dtype not in (torch.int64, torch.uint64):
            raise ConfigError("wait_until: the signal tensor must be int64 (or uint64), not %s: "
                              "the NIC's atomics update 64-bit integer words" % (signal.dtype,))
        index = _index(index, "wait_until: index")
        if not 0 <= index < signal.numel():
            raise ConfigError("wait_until: index %d out of range" % index)
        value = _word(value, "wait_until: value")
        off += 8 * index
        self._run(self._ops(dict(kind=abi.OP_WAIT_UNTIL, pe=self.rank, dst=self.heap_base + off,
                                 cmp=cmps[cmp], value=value)), "wait_until")

    def quiet(self):
        """Wait until every put/get/put_signal this rank issued has completed."""
        self._run(self._ops(dict(kind=abi.OP_QUIET)), "quiet")

    def barrier(self, blocking=True):
        """All ranks meet here, through the NIC (bounded: a dead rank raises TimeoutError).

        Every earlier operation of this rank completes first (quiet), then each rank adds 1 to a
        word on every rank and waits until its own word counts every rank's arrival.
        ``blocking=False`` (CUDA): only enqueue it on the current stream, so work enqueued after
        it starts on every rank when the last rank arrives (bench/ep.py aligns timed calls of
        ranks sharing a GPU this way); a failure then surfaces at the next synchronizing call.
        On the CPU the barrier is always synchronous.
        """
        self._check()
        self._barrier_epoch += 1
        word = self.heap_base                      # offset 0 of the reserved head
        specs = [dict(kind=abi.OP_QUIET)]
        specs += [dict(kind=abi.OP_PUT_SIGNAL, pe=p, dst=word, src=word, nbytes=0, sig=word, value=1)
                  for p in range(self.world_size)]
        specs += [dict(kind=abi.OP_QUIET),
                  dict(kind=abi.OP_WAIT_UNTIL, pe=self.rank, dst=word, cmp=abi.CMP_GE,
                       value=self._barrier_epoch * self.world_size)]
        ops = done = self._ops(*specs)
        try:
            done = self._run(ops, "barrier", blocking=False)    # the OpDescs the kernel writes
            if self._gpu and blocking:
                self._sync("barrier")
        except GpunetError:
            # An earlier failure stopped the first quiet: no arrival was signalled, so this
            # barrier did not happen and the next one must wait for the same count again.
            if not done[0].ok:
                self._barrier_epoch -= 1
            raise


def _check_transport(transport):
    """ConfigError unless ``transport`` is one of TRANSPORTS, a dict {peer: kind, "default": kind}
    or a callable (rank, peer) -> kind (see _peer_transport)."""
    if isinstance(transport, str) and transport in TRANSPORTS:
        return
    if isinstance(transport, dict):
        for k, v in transport.items():
            if not (k == "default" or (isinstance(k, int) and not isinstance(k, bool) and k >= 0)):
                raise ConfigError("transport dict: keys are peer ranks or 'default', not %r" % (k,))
            if not isinstance(v, str) or v not in TRANSPORTS:
                raise ConfigError("transport dict: peer %r -> %r is not one of %s" % (k, v, TRANSPORTS))
        return
    if callable(transport):
        return
    raise ConfigError("transport must be one of %s, a dict {peer: transport, 'default': transport} or "
                      "a callable (rank, peer) -> transport, not %r" % (TRANSPORTS, transport))


def _peer_transport(transport, rank, peer):
    """The transport asked for between ``rank`` and ``peer``: one kind for every peer (a str), a
    dict {peer: kind} with an optional "default" ("auto" if absent), or a callable
    (rank, peer) -> kind, e.g. ``lambda a, b: "proxy" if (a + b) % 2 else "ibgda"``. Both ends of
    a pair must get the same kind (init checks it); a callable symmetric in its arguments does."""
    if isinstance(transport, str):
        return transport
    if isinstance(transport, dict):
        return transport.get(peer, transport.get("default", "auto"))
    kind = transport(rank, peer)
    if not isinstance(kind, str) or kind not in TRANSPORTS:
        raise ConfigError("transport(%d, %d) returned %r, not one of %s" % (rank, peer, kind, TRANSPORTS))
    return kind


def choose_transport(requested, probe_doorbell):
    """("ibgda" | "proxy", reason) for a requested transport ("auto" | "ibgda" | "proxy").

    ``probe_doorbell()`` maps the NIC's doorbell into the device and returns a description, or
    raises host.platform.VendorRuntimeError when the driver refuses (cudaHostRegister with
    IoMemory: error 800 where the driver does not allow it). "auto" falls back to the CPU proxy
    then; "ibgda" cannot work and raises ConfigError; "proxy" does not probe.
    """
    from gpunet.host.platform import VendorRuntimeError

    if requested == "proxy":
        return "proxy", "asked for (transport='proxy')"
    try:
        how = probe_doorbell()
    except VendorRuntimeError as e:
        if requested == "ibgda":
            raise ConfigError("transport='ibgda' needs the NIC's doorbell mapped into the device, "
                              "and the driver refused (%s); use transport='auto' or 'proxy'" % e)
        return "proxy", ("auto: the doorbell cannot be mapped into the device (%s, code %s), so a "
                         "CPU proxy thread posts for the kernels" % (e.call or "runtime", e.code))
    if requested == "ibgda":
        return "ibgda", "asked for (transport='ibgda'); %s" % how
    return "ibgda", "auto: %s" % how


def read_signal(tensor_or_array, index=0):
    """The value of a NIC-updated 8-byte signal word (big-endian in memory) at element ``index``."""
    a = tensor_or_array
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu()             # CUDA (host-mapped heap): a stream-ordered copy
    b = bytes(np.asarray(a).view(np.uint8)[8 * index:8 * index + 8])
    return int.from_bytes(b, "big")


class _MappedBytes:
    """``nbytes`` of host-mapped memory at ``addr`` as a CUDA array (``__cuda_array_interface__``);
    holds ``owner`` (the Context) so the heap's Python objects outlive the tensor's storage."""

    def __init__(self, addr, nbytes, owner):
        self._owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False),
                                         "strides": None, "version": 3, "stream": None}


def _cuda_view(addr, nbytes, owner):
    """A torch uint8 CUDA tensor over the host-mapped heap bytes [addr, addr + nbytes)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device="cuda")
    t = torch.as_tensor(_MappedBytes(addr, nbytes, owner), device="cuda")
    if t.data_ptr() != addr:
        raise ConfigError("alloc: torch placed the heap view at 0x%x, not at the heap address 0x%x"
                          % (t.data_ptr(), addr))
    return t
