"""The Python API's owner object: a Context holds one rank's NIC, symmetric heap, QPs and transports.

    import gpunet, torch
    with gpunet.init() as ctx:                       # torch.distributed group, or torchrun env
        x = ctx.alloc((1024,), torch.float32)        # symmetric: same offset on every rank
        gpunet.put(ctx.remote((ctx.rank + 1) % ctx.world_size, x), x)
        gpunet.quiet()
        gpunet.barrier()

Each host wrapper (put / get / put_signal / atomic_add / quiet / barrier) launches the device
kernel of gpunet/device/kernels/ops.cu with one thread: the same gpunet.cuh code a user kernel calls.
A failure the kernel records in its Status block is raised as a gpunet.GpunetError subclass.

Platforms (gpunet/host/platform.py decides; GPUNET_PLATFORM=cpu forces the CPU):
- ``cpu``: the HOST arm's SIMT emulator runs the kernel; every launch is synchronous and every
  wrapper raises its own errors. Heap tensors are CPU tensors.
- ``cuda``: the kernel runs on the GPU, launched on ``torch.cuda.current_stream()``.
  put / get / put_signal only ENQUEUE the launch and return (stream-ordered after the work the
  caller queued before, e.g. the kernel that produced the payload); quiet / barrier /
  wait_until / atomic_add synchronize the stream, copy the Status block back and raise. So an
  error of an earlier non-blocking call surfaces at the next synchronizing call (its message
  names that call, not the failed put). Heap tensors are CUDA tensors (``device="cuda"``) over
  ordinary DEVICE memory when some peer may be p2p (asked, or "auto": cudaMalloc of the
  policy's p2p_dst kind), fast for the user's kernels; a world asked for NIC transports only
  keeps them over the soft NIC's HOST-MAPPED arena (see _heap_in_device_memory for why;
  GPUNET_HEAP_MEMORY=device gives it device memory anyway). p2p peers open each other's heaps by CUDA IPC handles exchanged
  over the bootstrap and the kernels store into them directly. NIC peers (ibgda / proxy) reach
  it as a NIC reaches GPU memory: the soft NIC's engine moves the bytes with the CUDA runtime
  (SoftNic.attach_copy_engine: cudaMemcpyAsync on its own non-blocking stream, as a NIC's DMA
  over GPUDirect), each rank mapping a NIC peer's device heap by its IPC handle for its engine,
  atomics there a read-modify-write under the owning NIC's lock; a real NIC registers the heap
  by dma-buf (DevxNic.reg_mr) and maps nothing. The soft NIC's own structures (rings, CQs, the op
  lists) stay in its arena, pinned with cudaHostRegister; gpunet needs the
  registered arena's device pointer to equal its host address (UVA, x86-64 Linux), otherwise
  ConfigError. Several ranks on one GPU need an MPS daemon to run side by side (FACTS.md).
  Descriptors (DevCtx, PeerDesc, QpDesc, Status) are in device memory (gpunet/device/descriptors.py); the op
  lists of in-flight launches are in the mapped arena.

Transports are chosen per peer (gpunet/transports.py): ``ibgda`` (the kernel posts WQEs and rings
the doorbell itself), ``proxy`` (a CPU thread posts the kernel's commands) or ``p2p`` (stores into
the peer's heap mapped here); ``auto`` is p2p for the peers on this node on CUDA (this rank
too), otherwise ibgda where the NIC's doorbell can be mapped into the device, else the proxy,
and logs which and why.

What the Context owns, in the order it makes them (and closes them in reverse: gpunet.resource):
the bootstrap, the NIC (gpunet/host/nic.py open_nic), on CUDA the NIC's GPU mapping, the device
memory of the descriptors and the device heap, the transports (QPs, proxy channels
and engine, p2p peers' heap mappings: closed before the heap is freed), the close barrier with
the peers that map this heap (Transports.close_barrier: bounded), the launcher
(gpunet/_launch.py: on CUDA closing it first waits for the stream). The symmetric heap's
allocator is gpunet/heap.py.

User kernels: ``ctx.device_context()`` hands out the DevCtx pointer and the launch parameters a
kernel built with ``gpunet.build_extension`` needs; ``ctx.check()`` after the launch raises what
the kernel recorded (examples/exchange.py).
"""
import operator
import sys
from typing import NamedTuple

import numpy as np
import torch

from gpunet import _launch, config
from gpunet.device import abi
from gpunet.device.descriptors import DeviceContext
from gpunet.errors import ClosedError, ConfigError, GpunetError
from gpunet.heap import ALIGN, RESERVED_BYTES, SymmetricHeap, _cuda_view
from gpunet.host.bootstrap import Bootstrap
from gpunet.host.nic import KINDS as NICS, open_nic
from gpunet.host.platform import get_platform
from gpunet.resource import Resource
from gpunet.transports import Transports, check_transport, peer_transport, settled_kinds

_OPS1 = abi.OpDesc * 1
_SIGNAL_OPS = {"add": abi.SIGNAL_ADD, "set": abi.SIGNAL_SET}
_CMPS = {"eq": abi.CMP_EQ, "ne": abi.CMP_NE, "ge": abi.CMP_GE, "gt": abi.CMP_GT,
         "le": abi.CMP_LE, "lt": abi.CMP_LT}
_SIGNAL_DTYPES = (torch.int64, torch.uint64)


__all__ = ["Context", "Remote", "DeviceHandle", "current", "read_signal", "ALIGN", "RESERVED_BYTES"]

DEFAULT_HEAP_BYTES = 64 << 20     # per rank; the arena is sparse, untouched pages cost nothing
SCRATCH_SLOTS = 1024              # atomic_add result slots (one per concurrent device caller)
MAX_HEAP_BYTES = 1 << 39          # the proxy command carries 39-bit heap offsets (proxy.cuh)
MAX_TIMEOUT_S = 86400.0           # a device wait bound beyond a day is a units mistake
NIC_EXTRA_BYTES = 8 << 20         # NIC memory beside the heap: rings, CQs, op ring, proxy slots
U64 = (1 << 64) - 1
MAX_RANKS = 511                   # barrier slots: heap head words 1..511, below the scratch at 4096

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


class Remote:
    """A remote location: ``nbytes`` at symmetric heap offset ``offset`` on rank ``rank``.

    Made by ``ctx.remote(rank, tensor, offset)`` and tied to that Context and to the allocation of
    ``tensor``: an operation checks, before anything is posted, that it is this Context's Remote
    and that the allocation is still live, so a Remote of another Context, of a freed allocation,
    or made by hand (no Context) raises ConfigError instead of reaching the NIC. Immutable.
    """

    __slots__ = ("rank", "offset", "nbytes", "_ctx", "_alloc")

    def __init__(self, rank, offset, nbytes, _ctx=None, _alloc=None):
        # the slots' own setters (immutability is __setattr__'s): a fifth of a loop of
        # object.__setattr__ calls, on the hot path of ctx.remote (bench/cpu_put.py's ping-pong)
        _SET_RANK(self, rank)
        _SET_OFFSET(self, offset)
        _SET_NBYTES(self, nbytes)
        _SET_CTX(self, _ctx)
        _SET_ALLOC(self, _alloc)

    def __setattr__(self, name, value):
        raise AttributeError("a gpunet Remote is immutable: make another with ctx.remote()")

    def __repr__(self):
        return "Remote(rank=%r, offset=%r, nbytes=%r)" % (self.rank, self.offset, self.nbytes)


_SET_RANK, _SET_OFFSET, _SET_NBYTES, _SET_CTX, _SET_ALLOC = (
    getattr(Remote, k).__set__ for k in Remote.__slots__)


class DeviceHandle(NamedTuple):
    """What a user kernel needs from a Context (``ctx.device_context()``).

    ``ptr``: the address of the ``gpunet::DevCtx`` to pass to the kernel (device memory on a GPU,
    host memory the HOST arm reads on the CPU); ``arch``: the arm to build the kernel for ("host"
    | "cuda", what ``gpunet.build_extension`` picks); ``warp_size``: the warp size to launch with
    (``gpunet::LaunchSpec::warp_size``: the HOST arm emulates it, so it must be this Context's;
    GPUs use their own); ``stream``: the CUDA stream handle to launch on (``LaunchSpec::stream``:
    torch's current stream, so the kernel is ordered with the Context's own launches; 0 on the
    CPU); ``rank``, ``world_size``; ``heap_base``: the local symmetric heap's address (a heap
    tensor's ``data_ptr()`` is already a symmetric address the device API takes).
    """
    ptr: int
    arch: str
    warp_size: int
    stream: int
    rank: int
    world_size: int
    heap_base: int


def _check_pairs(everyone):
    """ConfigError unless both ends of every pair reach each other by one transport, as settled
    from the exchanged infos (gpunet/transports.py settled_kinds: "auto" on CUDA included), so
    every rank decides the same from the same data."""
    kinds = [settled_kinds(everyone, r) for r in range(len(everyone))]

    def how(i, j):
        return kinds[i][j] + (" (auto)" if j in everyone[i].get("auto", ()) else "")

    for i in range(len(everyone)):
        for j in range(i + 1, len(everyone)):
            if kinds[i][j] != kinds[j][i]:
                raise ConfigError(
                    "gpunet.init: rank %d reaches rank %d by %s, but rank %d reaches rank %d by %s; "
                    "both ends of a pair must use one transport (pass the same transport= on "
                    "every rank; on CUDA 'auto' is p2p between ranks of one node)"
                    % (i, j, how(i, j), j, i, how(j, i)))


class Context(Resource):
    """One rank's gpunet resources. Use :func:`gpunet.init` to make one.

    Attributes: ``rank``, ``world_size``, ``transports`` (dict peer -> "ibgda" | "proxy" | "p2p"),
    ``reasons`` (dict peer -> why that transport), ``platform``, ``nic``, ``heap_bytes``,
    ``heap_base``, ``warp_size``, ``timeout_s``, ``atomic_endianness`` ("host" | "big": the byte
    order of signal words, the NIC's 8-byte atomics' (``Nic.atomic_endianness``), the same on
    every rank).
    ``transport`` is one kind for every peer ("auto" | "ibgda" | "proxy" | "p2p") or a per-peer choice:
    a dict {peer: kind, "default": kind} or a callable (rank, peer) -> kind (both ends of a pair
    must agree, e.g. ``lambda a, b: "proxy" if (a + b) % 2 else "ibgda"``: a mixed world).

    A gpunet.resource.Resource: ``close()`` frees everything in reverse order of creation (see
    the module docstring), idempotently, also after a failed set-up.
    """

    def __init__(self, group=None, transport="auto", nic="auto", heap_bytes=DEFAULT_HEAP_BYTES,
                 timeout_s=10.0, warp_size=None, proxy_threads=1, **unknown):
        self._barrier_epoch = 0
        self._transports = None
        try:
            self._setup(group, dict(transport=transport, nic=nic, heap_bytes=heap_bytes,
                                    timeout_s=timeout_s, warp_size=warp_size,
                                    proxy_threads=proxy_threads), unknown)
        except BaseException as e:
            self._close_noting(e)       # the failure of the set-up is the one to see
            raise

    # --- set-up -----------------------------------------------------------------------------
    def _setup(self, group, args, unknown):
        """Collective: two steps, each ending in ONE exchange that carries this rank's result or
        its failure (Bootstrap.collective), so a bad argument or a failed resource on one rank
        raises a gpunet error on every rank at once. 1: check the arguments, make the NIC, heap
        and QPs, exchange what peers need; 2: connect and build the device context."""
        boot = Bootstrap(group) if group is not None else Bootstrap.from_env()
        self._boot = self._adopt(boot, "bootstrap")
        self.rank, self.world_size = boot.rank, boot.world_size
        everyone = boot.collective("gpunet.init", self._setup_local, args, unknown)
        sizes = [e["heap_bytes"] for e in everyone]
        if len(set(sizes)) != 1:
            raise ConfigError("gpunet.init is collective: every rank must pass the same heap_bytes "
                              "(%s)" % ", ".join("rank %d: %d" % rs for rs in enumerate(sizes)))
        orders = [e["atomic_endianness"] for e in everyone]
        if len(set(orders)) != 1:
            # device code reads every signal word, local or a p2p peer's, in ONE order (DevCtx
            # DEVCTX_SIGNAL_BE), and a p2p CAS must agree with the NIC atomics on the same word
            raise ConfigError("gpunet.init: the ranks' NICs run 8-byte atomics in different byte "
                              "orders (%s); signal words need one order in the whole world (soft "
                              "NIC: set GPUNET_SOFTNIC_ATOMIC_ENDIANNESS alike on every rank)"
                              % ", ".join("rank %d: %s" % ro for ro in enumerate(orders)))
        _check_pairs(everyone)
        boot.collective("gpunet.init (connecting)", self._setup_connect, everyone)
        self._connected = True            # on every rank: the close barrier has partners

    @staticmethod
    def _check_args(a, unknown):
        """ConfigError for init arguments of the wrong type or range (checked on every rank before
        anything is made; bool is not an int, a float is not a byte count)."""
        if unknown:
            raise ConfigError("unknown keyword argument(s) %s to gpunet.init (it takes group, "
                              "transport, nic, heap_bytes, timeout_s, warp_size, proxy_threads)"
                              % ", ".join(sorted(unknown)))
        check_transport(a["transport"])
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
        transport, nic, heap_bytes, timeout_s, warp_size, proxy_threads = \
            self._check_args(args, unknown)
        if self.world_size > MAX_RANKS:
            raise ConfigError("gpunet.init: at most %d ranks (the barrier's slots), not %d"
                              % (MAX_RANKS, self.world_size))
        self.platform = get_platform()
        self._gpu = self.platform.name == "cuda"
        self._device_heap = self._heap_in_device_memory(transport)
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
        self.nic = self._adopt(open_nic(nic, profile=self.platform.profile,
                                        retry_timeout_s=min(timeout_s / 2, 2.0),
                                        arena_bytes=(0 if self._device_heap and self._gpu
                                                     else heap_bytes) + NIC_EXTRA_BYTES,
                                        name="rank%d" % self.rank), "NIC")
        self._mem = self._mapping = None     # descriptors: HOST arm = the host structs themselves
        if self._gpu:
            self._setup_gpu_memory()
        elif self._device_heap:
            self._attach_copy_engine()
        self.heap_bytes, self.timeout_s = heap_bytes, timeout_s
        if self._device_heap and not self._gpu:
            # CPU, GPUNET_HEAP_MEMORY=device: the heap stays in the arena (peers map it by name,
            # as p2p does), but the NIC is told it is device memory, so its engine reaches it
            # only through the copy engine (a memmove stand-in): the paths a CUDA device heap
            # takes, on the HOST arm
            buf = self.nic.alloc(heap_bytes, 4096)
            self.heap_base = buf.ctypes.data
            mr = self.nic.reg_mr(self.heap_base, heap_bytes, device_memory=True,
                                 kind=self.platform.policy("p2p_dst").kind)
            self._lkey, self._rkey = mr.lkey, mr.rkey
        elif self._device_heap:
            buf = None
            self.heap_base = self._setup_device_heap(heap_bytes)
            # NIC peers reach it as a NIC reaches GPU memory (GPUDirect): the soft NIC's engine
            # copies through the CUDA runtime (SoftNic.attach_copy_engine, in _setup_gpu_memory),
            # a real NIC registers it by dma-buf (DevxNic.reg_mr)
            mr = self.nic.reg_mr(self.heap_base, heap_bytes, device_memory=True,
                                 kind=self.platform.policy("p2p_dst").kind)
            self._lkey, self._rkey = mr.lkey, mr.rkey
        else:
            buf = self.nic.alloc(heap_bytes, 4096)
            mr = self.nic.reg_mr(buf, kind=self.platform.policy("payload_dst").kind)
            self._lkey, self._rkey = mr.lkey, mr.rkey
            self.heap_base = buf.ctypes.data
        self._heap = SymmetricHeap(buf, self.heap_base, heap_bytes,
                                   "cuda" if self._gpu else "cpu", self)
        self.warp_size = warp_size or self.platform.warp_size
        self._transports = self._adopt(Transports(self.nic, self.platform, self.rank,
                                                  self.world_size, transport,
                                                  lambda: self.nic.map_doorbell(self.platform),
                                                  proxy_threads, heap=(self.heap_base, heap_bytes),
                                                  device_heap=self._device_heap),
                                       "transports")
        self.transports, self.reasons = self._transports.kinds, self._transports.reasons
        # closed after the launcher (no kernel of ours runs) and before the transports unmap the
        # peers' heaps and this heap is released
        self._adopt(self._close_barrier, "close barrier with the peers that map this heap")
        # adopted last: closed first, so on CUDA no kernel still runs when the rest is freed
        self._launcher = self._adopt(_launch.Launcher(self.nic, self._gpu, self.warp_size),
                                     "launcher")
        self._quiet_ops = _launch.op_list(dict(kind=abi.OP_QUIET))  # quiet()'s op, built once
        self._devctx_out = False      # the DevCtx was handed out: user kernels may post (quiet())
        self.atomic_endianness = self.nic.atomic_endianness
        return dict(self._transports.info(), heap=self.heap_base, rkey=self._rkey,
                    heap_bytes=heap_bytes, atomic_endianness=self.atomic_endianness)

    def _setup_connect(self, everyone):
        """Step 2 on this rank: connect the QPs to the peers', build the device context."""
        scratch = self.heap_base + 4096
        self._dev = DeviceContext(self.heap_base, self.heap_bytes, self._lkey, self.world_size,
                                  self.rank, scratch, SCRATCH_SLOTS, scratch + SCRATCH_SLOTS * 8,
                                  self.timeout_s, mem=self._mem,
                                  atomic_endianness=self.atomic_endianness)
        self._transports.connect(everyone, self._dev, (self.heap_base, self._lkey),
                                 mem=self._mem, mapping=self._mapping)
        self._launcher.dev = self._dev
        # the ranks (this one included) whose processes share this rank's GPU: (rank,) on the CPU
        self.ranks_on_gpu = self._transports.ranks_on_gpu

    def _heap_in_device_memory(self, transport):
        """Whether this rank's heap is device memory (GPUNET_HEAP_MEMORY; ``_device_heap``).

        "auto" on CUDA: ordinary device memory when any peer may be p2p (asked, or "auto", which
        is p2p for this rank itself), fast for the user's kernels: p2p peers open it by CUDA IPC,
        NIC peers reach it as a NIC reaches GPU memory (the soft NIC's copy engine, a real NIC's
        dma-buf registration). A world asked for NIC transports only keeps the host-mapped heap:
        the soft NIC's copy engine, which moves a device heap's bytes with this process's CUDA
        runtime, stalls while the caller's thread is in a synchronous pageable copy (a .cpu())
        queued behind a running kernel, so a kernel waiting for NIC-set data then times out
        (bench/copy_engine_stall.py: 1.62 s of a 1.9 s kernel on the H200, 2026-12-02; EP over
        ibgda lost every peer's signal that way). "auto" on the CPU: the arena.

        "device": device memory whatever the transports. On the CPU that is the arena heap
        registered with the soft NIC as device memory (reg_mr(device_memory=True)) and reached
        by its engine only through the CPU platform's copy engine, with every host-side reader
        (gpunet.ep.Buffer's control mirror) taking the device-heap path: the test bench of the
        CUDA device heap's paths (tests/test_ep_ll.py's device-heap rounds)."""
        try:
            choice = config.get("GPUNET_HEAP_MEMORY")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if choice == "device":
            if not self._gpu and self.platform.profile != "nvidia":
                raise ConfigError("GPUNET_HEAP_MEMORY=device on the CPU needs the nvidia profile "
                                  "(the c500 model keeps CPU images of device memory instead), "
                                  "not GPUNET_PROFILE=%s" % self.platform.profile)
            return True
        return self._gpu and self._maybe_p2p(transport)

    def _attach_copy_engine(self):
        """How the NIC's engine reaches device memory (this rank's heap, or a peer's), as a NIC's
        DMA does over GPUDirect: the platform's copy engine (on the CPU a memmove stand-in); a
        NIC without the hook (a real one) reaches device memory by its own DMA."""
        attach = getattr(self.nic, "attach_copy_engine", None)
        if attach is not None:
            attach(self.platform.copy_engine())
        elif not self._gpu:
            raise ConfigError("GPUNET_HEAP_MEMORY=device on the CPU needs the soft NIC (its copy "
                              "engine hook), not %s" % type(self.nic).__name__)

    def _maybe_p2p(self, transport):
        """True when ``transport`` asks p2p or "auto" for some peer (this rank included)."""
        return any(peer_transport(transport, self.rank, p) in ("p2p", "auto")
                   for p in range(self.world_size))

    def _setup_device_heap(self, heap_bytes):
        """CUDA: the heap in GPU memory of the policy's p2p_dst kind (device on nvidia,
        Finegrained on c500: gpunet/host/platform.py says why), a child: freed when the Context closes,
        after the transports closed the peers' mappings of theirs; zeroed before any peer can
        store into it (the barrier slots and scratch of the head start at 0). Returns its
        address."""
        mem = self._adopt(self.platform.alloc(self.platform.policy("p2p_dst").kind, heap_bytes),
                          "device heap")
        _cuda_view(mem.ptr, heap_bytes, self).zero_()
        torch.cuda.current_stream().synchronize()
        return mem.ptr

    def _setup_gpu_memory(self):
        """CUDA: register what the NIC says the GPU must reach (its rings, CQs, DBRs, doorbell
        words, heap, op lists: Nic.mapped_ranges), check UVA, and make the device-memory allocator
        for descriptors."""
        from gpunet.device.descriptors import DeviceMemory, NicMapping

        torch.cuda.init()                # the runtime calls below then use torch's current device
        self._mapping = self._adopt(NicMapping(self.platform, self.nic), "NIC mapping")
        if not self._mapping.identity:
            raise ConfigError("gpunet on cuda: the NIC memory registered with the GPU got device "
                              "pointers other than its host addresses (%s); the Python API needs "
                              "them equal (unified addressing, x86-64 Linux with a 64-bit CUDA "
                              "driver), because the NIC and the GPU use the same heap addresses"
                              % ", ".join("0x%x -> 0x%x" % (b, d) for b, _, d in self._mapping.ranges))
        self._mem = self._adopt(DeviceMemory(self.platform), "device descriptors")
        self._attach_copy_engine()

    # --- lifetime -----------------------------------------------------------------------------
    _connected = False                   # init completed on every rank (set by _setup)

    def _close_barrier(self):
        """Closing, after this rank's kernels ended: wait, bounded by ``timeout_s``, until the
        peers that map this rank's heap (p2p peers; on CUDA every NIC peer of a soft NIC) are
        done with it, so that none stores into it after it is freed (Transports.close_barrier:
        a rank that is gone is not waited for; a silent one is named in a warning). Only after a
        complete init: a failed one raised on every rank before any peer used a mapping."""
        if self._connected:
            self._transports.close_barrier(self.timeout_s)

    def _release(self):
        """After every child closed (gpunet.resource): this Context stops being current.

        Not a collective of the bootstrap: close must work when peers have crashed. Its one wait
        is the close barrier with the peers that map this rank's heap (p2p; _close_barrier),
        bounded by ``timeout_s`` and skipping ranks known gone. Peers that later post to this
        rank get a TimeoutError / CompletionError (a dead peer), never a hang. The module-level
        wrappers fall back to the previous open Context."""
        if self in _open:
            _open.remove(self)

    def _check_open(self):
        if self.closed:
            raise ClosedError("this gpunet Context is closed")

    # --- the symmetric heap ---------------------------------------------------------------------
    def alloc(self, shape, dtype=torch.float32):
        """A zeroed symmetric tensor: collective, the same offset on every rank.

        ``shape``: int or tuple of ints (0 allowed: an empty tensor that still owns its range, so
        free() of it frees exactly it); ``dtype``: a torch dtype. Returns a torch tensor viewing
        the registered heap (so puts and gets reach it without a copy): a CPU tensor on the CPU
        platform; on CUDA a ``device="cuda"`` tensor over the device-memory heap (see the module
        docstring). On CUDA, alloc first synchronizes the current stream (a reused range must not
        still be read by an enqueued put).

        Collective with one exchange: a bad shape or a full heap on any rank raises ConfigError
        on every rank, and no rank keeps the range.
        """
        self._check_open()
        made = {}

        def local():
            # Everything that can fail on this rank happens before the one exchange, so that the
            # ranks agree: a range is kept everywhere or nowhere.
            if self._gpu:
                self._sync("alloc")
            dims = _shape(shape)
            if not isinstance(dtype, torch.dtype):
                raise ConfigError("alloc: dtype must be a torch dtype, got %r" % (dtype,))
            made["t"], made["alloc"] = self._heap.make(dims, dtype)
            return made["alloc"].off, made["alloc"].size

        got = self._boot.collective("alloc", local, undo=lambda r: self._heap.release(*r))
        off, size = got[self.rank]
        if any(g != (off, size) for g in got):
            self._heap.release(off, size)
            raise ConfigError("alloc is collective: every rank must allocate the same shapes in the "
                              "same order (offsets/sizes per rank: %r)" % (got,))
        self._heap.add(made["alloc"])
        return made["t"]

    def free(self, tensor):
        """Return a tensor from :meth:`alloc` to the heap (collective, like alloc).

        ``tensor`` must be the whole allocation (the tensor alloc returned, or a view of all of
        it): a part of one, a freed one or any other tensor raises ConfigError on every rank and
        frees nothing. Ranks must free the same allocation.
        """
        self._check_open()
        offs = self._boot.collective("free", lambda: self._heap.whole(tensor, "free").off)
        if len(set(offs)) != 1:
            raise ConfigError("free is collective: every rank must free the same allocation (heap "
                              "offsets per rank: %r)" % (offs,))
        self._heap.pop(offs[0])

    def _rank(self, rank, what):
        r = _index(rank, "%s: rank" % what)
        if not 0 <= r < self.world_size:
            raise ConfigError("%s: rank %r out of range [0, %d)" % (what, rank, self.world_size))
        return r

    def remote(self, rank, tensor, offset=0):
        """The copy of symmetric ``tensor`` on ``rank``, from element ``offset`` on: a Remote tied
        to this Context and to ``tensor``'s allocation (checked again at every use)."""
        self._check_open()
        if type(rank) is not int or not 0 <= rank < self.world_size:   # plain ints: checked
            rank = self._rank(rank, "remote")
        a, base = self._heap.locate(tensor, "remote")
        if not tensor.is_contiguous():
            raise ConfigError("remote: tensor is not contiguous")
        if type(offset) is not int:
            offset = _index(offset, "remote: offset")
        if not 0 <= offset <= tensor.numel():
            raise ConfigError("remote: offset %d out of range for a tensor of %d elements"
                              % (offset, tensor.numel()))
        es = tensor.element_size()
        return Remote(rank, base + offset * es, tensor.nbytes - offset * es, self, a)

    # --- user kernels ---------------------------------------------------------------------------
    def device_context(self):
        """The DevCtx pointer and launch parameters for a user kernel (a :class:`DeviceHandle`).

        The kernel takes ``gpunet::DevCtx*`` (``handle.ptr``), symmetric addresses (heap tensors'
        ``data_ptr()``) and peer ranks, and calls the device API of ``<gpunet/gpunet.cuh>``; its
        extern "C" host wrapper launches it with ``gpunet::launch_kernel`` using
        ``handle.warp_size`` and, on CUDA, ``handle.stream``. After the launch call
        :meth:`check`. The pointer stays valid until the Context is closed.
        """
        self._check_open()
        self._devctx_out = True
        return DeviceHandle(self._dev.addr, "cuda" if self._gpu else "host", self.warp_size,
                            int(self._launcher.stream()), self.rank, self.world_size,
                            self.heap_base)

    def device_context_image(self):
        """A copy of this Context's ``gpunet::DevCtx`` in host memory (a ``gpunet.device.abi.DevCtx``):
        the heap, the peers and the Status block the device API reads, for code that builds its
        own device contexts from it (gpunet.ep.Buffer gives each peer its own Status block and
        timeout). Changing the copy changes nothing in the Context; :meth:`device_context` is the
        pointer a kernel takes."""
        self._check_open()
        self._devctx_out = True
        return abi.DevCtx.from_buffer_copy(self._dev.ctx)

    def check(self, what="user kernel"):
        """Raise what a kernel recorded in this Context's Status block (a gpunet error: a
        TimeoutError, CompletionError, ... naming the site, QP and peer), or what the proxy
        recorded, after putting the Context back in working order where it can (the message
        says what was reset). Call it after launching a kernel on ``device_context()``: on CUDA
        it first waits for the current stream. Returns None when nothing failed."""
        self._check_open()
        self._sync(what)

    # --- device launches -------------------------------------------------------------------------
    def _ops(self, *specs):
        return _launch.op_list(*specs)

    def _run(self, ops, what, blocking=True, bulk=None):
        """Launch ops.cu's op-list kernel on ``ops`` (gpunet/_launch.py; ``bulk``: its bulk put,
        Launcher.bulk). CPU: synchronous, raises.
        CUDA: enqueued on the current stream; ``blocking``: then synchronize and raise (see the
        module docstring). Returns the OpDesc array the kernel wrote (results valid once
        synchronized)."""
        self._check_open()
        self._transports.refuse_lost_proxy(ops, what)
        done, err, finished = self._launcher.run(ops, what, blocking, bulk)
        if err is None and finished:
            err = self._transports.failure()
        if err is not None:
            self._fail(err)
        return done

    def _sync(self, what):
        """Wait for every launch so far (CUDA: the current stream), then raise what the kernels
        (or the proxy) recorded since the last synchronizing call, and clear it."""
        err = self._launcher.sync(what)
        if err is None:
            err = self._transports.failure()
        if err is not None:
            self._fail(err)

    def _fail(self, err):
        """Raise ``err`` (a failure a kernel or the proxy recorded; nothing of ours is running)
        after the transports' recovery (gpunet/transports.py Transports.recover); its message
        then also says what was reset or what stays broken."""
        try:
            note = "; ".join(self._transports.recover(self.timeout_s))
        except Exception as e:  # noqa: BLE001 - the original failure is what the caller needs
            note = ("recovery failed (%s: %s); close this Context and start a new one"
                    % (type(e).__name__, e))
        if note:
            err.args = ("%s [%s]" % (err.args[0] if err.args else "", note),) + tuple(err.args[1:])
        raise err

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
        if not self._heap.is_live(a):
            raise ConfigError("%s: %r points into an allocation that was freed" % (what, remote))
        if not (type(remote.offset) is int and type(remote.nbytes) is int
                and a.off <= remote.offset and remote.nbytes >= 0
                and remote.offset + remote.nbytes <= a.off + a.nbytes):
            # only a Remote built by hand gets here (ctx.remote makes ranges inside the allocation)
            raise ConfigError("%s: %r is not inside its allocation (heap offsets %d..%d)"
                              % (what, remote, a.off, a.off + a.nbytes))
        if nbytes > remote.nbytes:
            raise ConfigError("%s: %d bytes do not fit the remote range of %d bytes"
                              % (what, nbytes, remote.nbytes))

    def put(self, remote, tensor):
        """Non-blocking put of ``tensor`` (a heap tensor, any dtype) to ``remote``; see quiet()."""
        off = self._heap.offset_of(tensor, "put")
        nbytes = tensor.nbytes
        self._check_remote(remote, nbytes, "put")
        # The OpDesc field by field (a third of op_list's cost: bench/cpu_put.py's hot path)
        ops = _OPS1()
        o = ops[0]
        o.kind, o.pe, o.dst = abi.OP_PUT, remote.rank, self.heap_base + remote.offset
        o.src, o.nbytes = self.heap_base + off, nbytes
        self._run(ops, "put", blocking=False,
                  bulk=self._launcher.bulk(self.transports[remote.rank], nbytes))

    def put_batch(self, pairs):
        """Non-blocking puts of many ``(remote, tensor)`` pairs in ONE launch (see quiet()): the
        whole list is checked first (nothing is posted if any pair is bad). Where a p2p peer is
        among them, the launch is ops.cu's bulk put, its blocks sized to the bytes of the whole
        list (gpunet/_launch.py bulk_geometry); else one device thread posts them in order."""
        pairs = list(pairs)
        if not pairs:
            return
        specs, total, kinds = [], 0, set()
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise ConfigError("put_batch: item %d must be a (remote, tensor) pair, not %r"
                                  % (i, type(pair).__name__))
            remote, tensor = pair
            off = self._heap.offset_of(tensor, "put_batch")
            self._check_remote(remote, tensor.nbytes, "put_batch")
            specs.append(dict(kind=abi.OP_PUT, pe=remote.rank, dst=self.heap_base + remote.offset,
                              src=self.heap_base + off, nbytes=tensor.nbytes))
            total += tensor.nbytes
            kinds.add(self.transports[remote.rank])
        bulk = self._launcher.bulk("p2p" if "p2p" in kinds else "nic", total)
        self._run(self._ops(*specs), "put_batch", blocking=False, bulk=bulk)

    def get(self, tensor, remote):
        """Non-blocking get of ``tensor.nbytes`` from ``remote`` into heap ``tensor``; see quiet()."""
        off = self._heap.offset_of(tensor, "get")
        self._check_remote(remote, tensor.nbytes, "get")
        self._run(self._ops(dict(kind=abi.OP_GET, pe=remote.rank, dst=self.heap_base + off,
                                 src=self.heap_base + remote.offset, nbytes=tensor.nbytes)), "get",
                  blocking=False)

    def put_signal(self, remote, tensor, signal, value=1, op="add"):
        """Put ``tensor`` to ``remote``, then add ``value`` to the 8-byte ``signal`` (a Remote on
        the same rank), in that order: a peer that sees the signal sees the payload. ``op="set"``
        stores ``value`` instead (one writer per word): the form a store-only p2p peer (the
        c500 profile) accepts. The signal word is a native-endian int64 by default (so the
        receiver's ``sig[i]`` is the count), in the NICs' atomic order in general
        (``atomic_endianness``), whichever transport reaches the peer: p2p, ibgda and proxy
        updates of one word agree."""
        if not isinstance(op, str) or op not in _SIGNAL_OPS:
            raise ConfigError("put_signal: op must be 'add' or 'set', not %r" % (op,))
        off = self._heap.offset_of(tensor, "put_signal")
        nbytes = tensor.nbytes
        self._check_remote(remote, nbytes, "put_signal")
        self._check_remote(signal, 8, "put_signal (signal)")
        if type(value) is not int or not 0 <= value <= U64:     # plain words: checked
            value = _word(value, "put_signal: value")
        if signal.rank != remote.rank:
            raise ConfigError("put_signal: payload and signal must be on the same rank")
        if signal.offset % 8:
            raise ConfigError("put_signal: the signal word must be 8-byte aligned")
        ops = _OPS1()                 # field by field, as put() (bench/cpu_put.py's ping-pong)
        o = ops[0]
        o.kind, o.pe, o.dst = abi.OP_PUT_SIGNAL, remote.rank, self.heap_base + remote.offset
        o.src, o.nbytes, o.sig = self.heap_base + off, nbytes, self.heap_base + signal.offset
        o.value, o.cmp = value, _SIGNAL_OPS[op]
        self._run(ops, "put_signal", blocking=False)

    def atomic_add(self, remote, value):
        """Atomically add ``value`` to the 8-byte word at ``remote``; returns the old value (int,
        unsigned 64-bit).

        The word is a uint64 in the NICs' atomic order (``ctx.atomic_endianness``): native by
        default, so ``word[0]`` of an int64 heap tensor reads it (two's complement); big-endian
        with a NIC in the IB wire order. :func:`gpunet.read_signal` reads it in either.
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
        (an int64 or uint64 heap tensor, updated by put_signal / atomic_add from any transport,
        in the NICs' atomic order: native by default) compares ``cmp`` to ``value``
        (an integer in -2**63 .. 2**64 - 1, compared as unsigned 64-bit):
        "eq" | "ne" | "ge" | "gt" | "le" | "lt". After it returns, every payload the signalling
        peer put before the signal is visible. Raises gpunet.TimeoutError on timeout."""
        if not isinstance(cmp, str) or cmp not in _CMPS:
            raise ConfigError("wait_until: cmp must be one of %s, not %r" % (sorted(_CMPS), cmp))
        off = self._heap.offset_of(signal, "wait_until")
        if signal.dtype not in _SIGNAL_DTYPES:
            raise ConfigError("wait_until: the signal tensor must be int64 (or uint64), not %s: "
                              "the NIC's atomics update 64-bit integer words" % (signal.dtype,))
        if type(index) is not int:
            index = _index(index, "wait_until: index")
        if not 0 <= index < signal.numel():
            raise ConfigError("wait_until: index %d out of range" % index)
        if type(value) is not int or not 0 <= value <= U64:     # plain words: checked
            value = _word(value, "wait_until: value")
        ops = _OPS1()                 # field by field, as put() (bench/cpu_put.py's ping-pong)
        o = ops[0]
        o.kind, o.pe, o.dst = abi.OP_WAIT_UNTIL, self.rank, self.heap_base + off + 8 * index
        o.cmp, o.value = _CMPS[cmp], value
        self._run(ops, "wait_until")

    def quiet(self):
        """Wait until every put/get/put_signal this rank issued has completed."""
        if not self._gpu and not self._devctx_out:
            # The CPU arm runs every launch to its end, and each of our kernels quiets before it
            # ends (ops.cu k_ops, k_put_bulk): nothing of ours is outstanding, and no user kernel
            # can have posted (the DevCtx was never handed out). Only what was recorded remains
            # to be raised. Saves a launch per quiet (bench/cpu_put.py);
            # tests/test_cpu_put.py::test_cpu_quiet_launches_nothing_until_the_devctx_is_out.
            self._check_open()
            self._sync("quiet")
            return
        self._run(self._quiet_ops, "quiet")   # its inputs never change; nobody reads its outputs

    def barrier(self, blocking=True):
        """All ranks meet here, through the NIC (bounded: a dead rank raises TimeoutError).

        Every earlier operation of this rank completes first (quiet), then each rank SETs its own
        slot (heap head word 1 + rank) on every rank to the barrier's epoch and waits until every
        slot of its own reached it. SET, not ADD: one writer per slot, so the barrier works over
        store-only p2p peers (the c500 profile) as over the NIC transports.
        ``blocking=False`` (CUDA): only enqueue it on the current stream, so work enqueued after
        it starts on every rank when the last rank arrives (bench/ep.py aligns timed calls of
        ranks sharing a GPU this way); a failure then surfaces at the next synchronizing call.
        On the CPU the barrier is always synchronous.
        """
        self._check_open()
        self._barrier_epoch += 1
        slot = self.heap_base + 8                  # slot r: word 1 + r of the reserved head
        mine = slot + 8 * self.rank
        specs = [dict(kind=abi.OP_QUIET)]
        specs += [dict(kind=abi.OP_PUT_SIGNAL, pe=p, dst=mine, src=mine, nbytes=0, sig=mine,
                       value=self._barrier_epoch, cmp=abi.SIGNAL_SET)
                  for p in range(self.world_size)]
        specs += [dict(kind=abi.OP_QUIET)]
        specs += [dict(kind=abi.OP_WAIT_UNTIL, pe=self.rank, dst=slot + 8 * r, cmp=abi.CMP_GE,
                       value=self._barrier_epoch) for r in range(self.world_size)]
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


def read_signal(tensor_or_array, index=0, endianness=None):
    """The value (unsigned 64-bit) of the 8-byte signal word ``index`` of a contiguous heap
    tensor or array, flattened (the word ``wait_until(t, ..., index=index)`` waits on: element
    ``index`` of an int64 tensor of any shape), read in the NICs' atomic order: ``endianness``
    "host" | "big", by default the ``atomic_endianness`` of the newest open Context
    (:func:`current`). ConfigError unless 0 <= index < the number of 8-byte words, or when the
    tensor is not contiguous.

    Signal words are native-endian by default, so ``sig[index]`` of an int64 tensor is the same
    number (two's complement); this reader is what the big-endian mode (a NIC whose atomics run
    in the IB wire order) needs, and it works in both. On CUDA the word is copied to the host
    (stream-ordered)."""
    if endianness is None:
        endianness = current().atomic_endianness
    if endianness not in ("host", "big"):
        raise ConfigError("read_signal: endianness must be 'host' or 'big', not %r" % (endianness,))
    if type(index) is not int:
        index = _index(index, "read_signal: index")
    a = tensor_or_array
    if isinstance(a, torch.Tensor):
        # checked before the copy: a CUDA view's .cpu() may come back contiguous, a CPU one not
        contiguous = a.is_contiguous()
    else:
        a = np.asarray(a)
        contiguous = a.flags.c_contiguous
    if not contiguous:
        raise ConfigError("read_signal: tensor is not contiguous; call .contiguous() on a heap "
                          "tensor view, or read the heap tensor itself")
    words = a.nbytes // 8
    if not 0 <= index < words:
        raise ConfigError("read_signal: index %d out of range: the tensor holds %d 8-byte words"
                          % (index, words))
    if isinstance(a, torch.Tensor):
        a = _launch.to_host(a.detach())  # CUDA: a stream-ordered copy
    b = bytes(np.asarray(a).reshape(-1).view(np.uint8)[8 * index:8 * index + 8])
    return int.from_bytes(b, "big" if endianness == "big" else sys.byteorder)
