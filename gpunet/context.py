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
import ctypes
import logging

import numpy as np
import torch

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

_current = None                   # the Context the module-level wrappers use


def current():
    """The most recent open Context (the one ``gpunet.put`` & co. use by default)."""
    if _current is None or _current.closed:
        raise ClosedError("no open gpunet Context: call gpunet.init() first")
    return _current


class Remote:
    """A remote location: ``nbytes`` at symmetric heap offset ``offset`` on rank ``rank``."""

    __slots__ = ("rank", "offset", "nbytes")

    def __init__(self, rank, offset, nbytes):
        self.rank, self.offset, self.nbytes = rank, offset, nbytes

    def __repr__(self):
        return "Remote(rank=%d, offset=%d, nbytes=%d)" % (self.rank, self.offset, self.nbytes)


class Context:
    """One rank's gpunet resources. Use :func:`gpunet.init` to make one.

    Attributes: ``rank``, ``world_size``, ``transports`` (dict peer -> "ibgda" | "proxy"),
    ``reasons`` (dict peer -> why that transport), ``platform``, ``nic``, ``heap_bytes``.
    """

    def __init__(self, group=None, transport="auto", nic="auto", heap_bytes=DEFAULT_HEAP_BYTES,
                 timeout_s=10.0, warp_size=None, proxy_threads=1):
        if transport not in TRANSPORTS:
            raise ConfigError("transport must be one of %s, not %r" % (TRANSPORTS, transport))
        if nic not in NICS:
            raise ConfigError("nic must be one of %s, not %r" % (NICS, nic))
        if heap_bytes < RESERVED_BYTES + ALIGN:
            raise ConfigError("heap_bytes must be at least %d" % (RESERVED_BYTES + ALIGN))
        self.closed = False
        self._closers = []          # (name, fn), closed in reverse order
        self._allocs = {}           # offset -> nbytes (live symmetric allocations)
        self._free = []             # (offset, nbytes) freed ranges, reused first-fit
        self._top = RESERVED_BYTES
        self._barrier_epoch = 0
        try:
            self._setup(group, transport, nic, heap_bytes, timeout_s, warp_size, proxy_threads)
        except BaseException:
            self.close()
            raise

    # --- set-up -----------------------------------------------------------------------------
    def _setup(self, group, transport, nic, heap_bytes, timeout_s, warp_size, proxy_threads):
        from gpunet.device.ops import Launch, load_ops
        from gpunet.host import verbs
        from gpunet.host.softnic import SoftNic

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
        boot = Bootstrap(group) if group is not None else Bootstrap.from_env()
        self._boot = boot
        self._closers.append(("bootstrap", boot.close))
        self.rank, self.world_size = boot.rank, boot.world_size
        if nic == "verbs" or (nic == "auto" and verbs.have_pyverbs() and verbs.available_devices()):
            verbs.VerbsNic()        # raises NoRdmaDeviceError with what to do when there is none
            raise ConfigError("nic='verbs': the real-NIC path is not wired into the Python API yet; "
                              "use nic='soft'")
        self.nic = SoftNic(profile=self.platform.profile, retry_timeout_s=min(timeout_s / 2, 2.0),
                           arena_bytes=heap_bytes + (8 << 20), name="rank%d" % self.rank)
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
        t, why = choose_transport(transport, self._probe_doorbell)
        self.transports = {p: t for p in range(n)}
        self.reasons = {p: why for p in range(n)}
        for p in range(n):
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
        mine = {"qps": {k: q.info() for k, q in qps.items()}, "heap": self.heap_base,
                "rkey": self._mr.rkey}
        everyone = boot.allgather_obj(mine)
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
        for p in range(n):
            if self.transports[p] == "ibgda":
                qpd = QpDescriptor(qps["ibgda", p], p, mem=self._mem,
                                   mapped=getattr(self, "_mapped", None))
                self._dev.set_peer_qp(p, qpd, everyone[p]["heap"], everyone[p]["rkey"])
        if "proxy" in users:
            self._setup_proxy([p for p in range(n) if self.transports[p] == "proxy"],
                              [[qps["proxy", p]] for p in range(n)], everyone, proxy_threads)
        if self._gpu:                    # closed first: no kernel may run on freed descriptors
            self._closers.append(("CUDA stream", lambda: torch.cuda.current_stream().synchronize()))
        boot.barrier()

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
        """One proxy channel for this rank's device code, drained by ``threads`` proxy threads."""
        from gpunet.host.proxy import ProxyChannel, ProxyEngine

        if threads != 1:
            raise ConfigError("proxy_threads: one channel per rank is drained by one thread here")
        ch = ProxyChannel(depth=PROXY_DEPTH, platform=self.platform if self._gpu else None)
        self._closers.append(("proxy channel", ch.close))
        remote_heaps = [(everyone[p]["heap"], everyone[p]["rkey"]) for p in range(len(everyone))]
        eng = ProxyEngine(self.nic, [ch], qps_per_peer, (self.heap_base, self._mr.lkey),
                          remote_heaps, threads=threads)
        self._closers.append(("proxy engine", eng.close))
        self._proxy = eng
        desc = self._dev.place(ch.descriptor())   # uint64[4]: HOST arm in place, GPU a device copy
        for p in proxied:
            self._dev.set_peer_proxy(p, desc, everyone[p]["heap"], everyone[p]["rkey"])

    # --- lifetime -----------------------------------------------------------------------------
    def close(self):
        """Free everything this Context made, in reverse order; idempotent, also after errors."""
        global _current
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
        if _current is self:
            _current = None
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

        ``shape``: int or tuple; ``dtype``: a torch dtype. Returns a torch tensor viewing the
        registered heap (so puts and gets reach it without a copy): a CPU tensor on the CPU
        platform; on CUDA a ``device="cuda"`` tensor over the host-mapped heap (see the module
        docstring: GPU kernels can use it, over PCIe). On CUDA, alloc first synchronizes the
        current stream (a reused range must not still be read by an enqueued put).
        """
        self._check()
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if any((not isinstance(s, int)) or s < 0 for s in shape):
            raise ConfigError("alloc: shape must be non-negative ints, got %r" % (shape,))
        if not isinstance(dtype, torch.dtype):
            raise ConfigError("alloc: dtype must be a torch dtype, got %r" % (dtype,))
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        size = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        off = self._take(size)
        offs = self._boot.allgather_obj((off, size))
        if any(o != (off, size) for o in offs):
            self._release(off, size)
            raise ConfigError("alloc is collective: every rank must allocate the same shapes in the "
                              "same order (offsets/sizes per rank: %r)" % (offs,))
        self._allocs[off] = size
        if self._gpu:
            self._sync("alloc")
            self._heap[off:off + size] = 0
            return _cuda_view(self.heap_base + off, nbytes, self).view(dtype).reshape(shape)
        self._heap[off:off + size] = 0
        t = torch.frombuffer(memoryview(self._heap[off:off + nbytes]), dtype=torch.uint8) \
            if nbytes else torch.empty(0, dtype=torch.uint8)
        return t.view(dtype).reshape(shape)

    def free(self, tensor):
        """Return a tensor from :meth:`alloc` to the heap (collective, like alloc)."""
        self._check()
        off = self._offset_of(tensor, "free")
        if off not in self._allocs:
            raise ConfigError("free: the tensor is not the start of a live symmetric allocation")
        self._release(off, self._allocs.pop(off))

    def _take(self, size):
        for i, (o, s) in enumerate(self._free):
            if s >= size:
                if s == size:
                    self._free.pop(i)
                else:
                    self._free[i] = (o + size, s - size)
                return o
        if self._top + size > self.heap_bytes:
            raise ConfigError("symmetric heap full: %d bytes asked, %d free at the top of %d; pass a "
                              "larger heap_bytes to gpunet.init" % (size, self.heap_bytes - self._top,
                                                                   self.heap_bytes))
        off = self._top
        self._top += size
        return off

    def _release(self, off, size):
        self._free.append((off, size))
        self._free.sort()

    def _offset_of(self, tensor, what):
        """Heap offset of a tensor's first byte; raises ConfigError if it is not a heap tensor."""
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError("%s: expected a torch.Tensor, got %s" % (what, type(tensor).__name__))
        want = self._tensor_device
        if tensor.device.type != want:
            raise ConfigError("%s: tensor is on %s; this Context's heap tensors are %s tensors "
                              "(ctx.alloc)" % (what, tensor.device, want))
        if not tensor.is_contiguous():
            raise ConfigError("%s: tensor is not contiguous; call .contiguous() on a heap tensor "
                              "view, or copy into a symmetric tensor first" % what)
        if tensor.numel() == 0:
            return RESERVED_BYTES       # an empty slice moves nothing; torch may give it no address
        addr = tensor.data_ptr()
        off = addr - self.heap_base
        if off < RESERVED_BYTES or off + tensor.nbytes > self.heap_bytes:
            raise ConfigError("%s: tensor is outside the symmetric heap; allocate it with ctx.alloc()"
                              % what)
        return off

    def remote(self, rank, tensor, offset=0):
        """The copy of symmetric ``tensor`` on ``rank``, from element ``offset`` on."""
        self._check()
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ConfigError("rank %r out of range [0, %d)" % (rank, self.world_size))
        base = self._offset_of(tensor, "remote")
        es = tensor.element_size()
        if not 0 <= offset <= tensor.numel():
            raise ConfigError("offset %d out of range for a tensor of %d elements"
                              % (offset, tensor.numel()))
        return Remote(rank, base + offset * es, tensor.nbytes - offset * es)

    # --- device launches -------------------------------------------------------------------------
    def _run(self, ops, what, blocking=True):
        """Launch ops.cu's op-list kernel on ``ops``. CPU: synchronous, raises. CUDA: enqueued on
        the current stream; ``blocking``: then synchronize and raise (see the module docstring).
        Returns the OpDesc array the kernel wrote (results valid once synchronized)."""
        self._check()
        if self._gpu:
            return self._run_gpu(ops, what, blocking)
        self._dev.clear_status()
        rc = self._ops_lib.gpunet_ops_launch(*self._launch.args(), self._dev.addr,
                                             ctypes.addressof(ops), len(ops))
        if rc != 0:
            raise GpunetError("%s: device kernel launch failed (%d)" % (what, rc))
        self._dev.raise_for_status(what)
        if getattr(self, "_proxy", None) is not None:
            self._proxy.check()
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
            raise err
        if getattr(self, "_proxy", None) is not None:
            self._proxy.check()

    def _ops(self, *specs):
        ops = (abi.OpDesc * len(specs))()
        for o, s in zip(ops, specs):
            for k, v in s.items():
                setattr(o, k, v)
        return ops

    def _check_remote(self, remote, nbytes, what):
        if not isinstance(remote, Remote):
            raise ConfigError("%s: expected a gpunet Remote (ctx.remote(rank, tensor)), got %s"
                              % (what, type(remote).__name__))
        if not 0 <= remote.rank < self.world_size:
            raise ConfigError("%s: rank %d out of range [0, %d)" % (what, remote.rank, self.world_size))
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
        if signal.rank != remote.rank:
            raise ConfigError("put_signal: payload and signal must be on the same rank")
        if signal.offset % 8:
            raise ConfigError("put_signal: the signal word must be 8-byte aligned")
        self._run(self._ops(dict(kind=abi.OP_PUT_SIGNAL, pe=remote.rank,
                                 dst=self.heap_base + remote.offset, src=self.heap_base + off,
                                 nbytes=tensor.nbytes, sig=self.heap_base + signal.offset,
                                 value=int(value) & 0xFFFFFFFFFFFFFFFF)), "put_signal",
                  blocking=False)

    def atomic_add(self, remote, value):
        """Atomically add ``value`` to the 8-byte word at ``remote``; returns the old value (int).

        The word is a big-endian uint64, as the NIC's atomics see it: read it with
        :func:`gpunet.read_signal`.
        """
        self._check_remote(remote, 8, "atomic_add")
        if remote.offset % 8:
            raise ConfigError("atomic_add: the word must be 8-byte aligned")
        ops = self._run(self._ops(dict(kind=abi.OP_ATOMIC_ADD, pe=remote.rank,
                                       dst=self.heap_base + remote.offset,
                                       value=int(value) & 0xFFFFFFFFFFFFFFFF)), "atomic_add")
        return int(ops[0].result)

    def wait_until(self, signal, value, cmp="ge", index=0):
        """Wait (bounded by the Context's timeout) until the 8-byte signal word ``signal[index]``
        (an int64 heap tensor, NIC-updated, big-endian) compares ``cmp`` to ``value``:
        "eq" | "ne" | "ge" | "gt" | "le" | "lt". After it returns, every payload the signalling
        peer put before the signal is visible. Raises gpunet.TimeoutError on timeout."""
        cmps = {"eq": abi.CMP_EQ, "ne": abi.CMP_NE, "ge": abi.CMP_GE, "gt": abi.CMP_GT,
                "le": abi.CMP_LE, "lt": abi.CMP_LT}
        if cmp not in cmps:
            raise ConfigError("wait_until: cmp must be one of %s, not %r" % (sorted(cmps), cmp))
        if signal.element_size() != 8:
            raise ConfigError("wait_until: the signal tensor must have 8-byte elements (int64)")
        if not 0 <= index < signal.numel():
            raise ConfigError("wait_until: index %d out of range" % index)
        off = self._offset_of(signal, "wait_until") + 8 * index
        self._run(self._ops(dict(kind=abi.OP_WAIT_UNTIL, pe=self.rank, dst=self.heap_base + off,
                                 cmp=cmps[cmp], value=int(value) & 0xFFFFFFFFFFFFFFFF)), "wait_until")

    def quiet(self):
        """Wait until every put/get/put_signal this rank issued has completed."""
        self._run(self._ops(dict(kind=abi.OP_QUIET)), "quiet")

    def barrier(self):
        """All ranks meet here, through the NIC (bounded: a dead rank raises TimeoutError).

        Every earlier operation of this rank completes first (quiet), then each rank adds 1 to a
        word on every rank and waits until its own word counts every rank's arrival.
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
        self._run(self._ops(*specs), "barrier")


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
