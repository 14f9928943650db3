"""The Python API's owner object: a Context holds one rank's NIC, symmetric heap, QPs and transports.

    import gpunet, torch
    with gpunet.init() as ctx:                       # torch.distributed group, or torchrun env
        x = ctx.alloc((1024,), torch.float32)        # symmetric: same offset on every rank
        gpunet.put(ctx.remote((ctx.rank + 1) % ctx.world_size, x), x)
        gpunet.quiet()
        gpunet.barrier()

Each host wrapper (put / get / put_signal / atomic_add / quiet / barrier) launches the device
kernel of device/kernels/ops.cu with one thread: the same gpunet.cuh code a user kernel calls,
here run by the HOST arm's SIMT emulator (on the CPU the launch is synchronous). A failure the
kernel records in its Status block is raised as a gpunet.GpunetError subclass.

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
        from gpunet.device.loopback import Launch, load_ops
        from gpunet.host import verbs
        from gpunet.host.softnic import SoftNic

        self.platform = get_platform()
        if self.platform.name != "cpu":
            raise ConfigError("gpunet.init on %s: the Python API runs on the CPU platform (soft NIC, "
                              "HOST arm) in this release; GPU kernels are reached through the C++ "
                              "device API (see README). Set GPUNET_PLATFORM=cpu to use the CPU path."
                              % self.platform.name)
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
        self.heap_bytes = heap_bytes
        self._heap = self.nic.alloc(heap_bytes, 4096)
        kind = self.platform.policy("payload_dst").kind
        self._mr = self.nic.reg_mr(self._heap, kind=kind)
        self.heap_base = address_of(self._heap)
        self.timeout_s = timeout_s
        self.warp_size = warp_size or self.platform.warp_size
        self._launch = Launch(grid=1, block=1, warp_size=self.warp_size)
        self._ops_lib = load_ops("host")

        # Transports. The soft NIC's doorbell is ordinary memory, so "auto" gives ibgda; a real
        # NIC whose UAR cannot be mapped into the GPU (cudaHostRegister IoMemory refused) would
        # give the proxy here.
        n, me = self.world_size, self.rank
        self.transports, self.reasons = {}, {}
        for p in range(n):
            if transport == "proxy":
                t, why = "proxy", "asked for (transport='proxy')"
            elif transport == "ibgda":
                t, why = "ibgda", "asked for (transport='ibgda')"
            else:
                t, why = "ibgda", "auto: the soft NIC's doorbell is memory the device can store to"
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
                                  SCRATCH_SLOTS, scratch + SCRATCH_SLOTS * 8, timeout_s)
        for p in range(n):
            if self.transports[p] == "ibgda":
                self._dev.set_peer_qp(p, QpDescriptor(qps["ibgda", p], p), everyone[p]["heap"],
                                      everyone[p]["rkey"])
        if "proxy" in users:
            self._setup_proxy([p for p in range(n) if self.transports[p] == "proxy"],
                              [[qps["proxy", p]] for p in range(n)], everyone, proxy_threads)
        boot.barrier()

    def _setup_proxy(self, proxied, qps_per_peer, everyone, threads):
        """One proxy channel for this rank's device code, drained by ``threads`` proxy threads."""
        from gpunet.host.proxy import ProxyChannel, ProxyEngine

        if threads != 1:
            raise ConfigError("proxy_threads: one channel per rank is drained by one thread here")
        ch = ProxyChannel(depth=PROXY_DEPTH)
        self._closers.append(("proxy channel", ch.close))
        remote_heaps = [(everyone[p]["heap"], everyone[p]["rkey"]) for p in range(len(everyone))]
        eng = ProxyEngine(self.nic, [ch], qps_per_peer, (self.heap_base, self._mr.lkey),
                          remote_heaps, threads=threads)
        self._closers.append(("proxy engine", eng.close))
        self._proxy = eng
        desc = ch.descriptor()           # uint64[4]: kept alive by the DeviceContext
        for p in proxied:
            self._dev.set_peer_proxy(p, address_of(desc), everyone[p]["heap"],
                                     everyone[p]["rkey"], keep=desc)

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

        ``shape``: int or tuple; ``dtype``: a torch dtype. Returns a CPU torch tensor viewing the
        registered heap (so puts and gets reach it without a copy).
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
        if tensor.device.type != "cpu":
            raise ConfigError("%s: tensor is on %s; this Context's heap is on the CPU"
                              % (what, tensor.device))
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
    def _run(self, ops, what):
        self._check()
        self._dev.clear_status()
        rc = self._ops_lib.gpunet_ops_launch(*self._launch.args(), self._dev.addr,
                                             ctypes.addressof(ops), len(ops))
        if rc != 0:
            raise GpunetError("%s: device kernel launch failed (%d)" % (what, rc))
        self._dev.raise_for_status(what)
        if getattr(self, "_proxy", None) is not None:
            self._proxy.check()
        return ops

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
                                 src=self.heap_base + off, nbytes=tensor.nbytes)), "put")

    def get(self, tensor, remote):
        """Non-blocking get of ``tensor.nbytes`` from ``remote`` into heap ``tensor``; see quiet()."""
        off = self._offset_of(tensor, "get")
        self._check_remote(remote, tensor.nbytes, "get")
        self._run(self._ops(dict(kind=abi.OP_GET, pe=remote.rank, dst=self.heap_base + off,
                                 src=self.heap_base + remote.offset, nbytes=tensor.nbytes)), "get")

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
                                 value=int(value) & 0xFFFFFFFFFFFFFFFF)), "put_signal")

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


def read_signal(tensor_or_array, index=0):
    """The value of a NIC-updated 8-byte signal word (big-endian in memory) at element ``index``."""
    b = bytes(np.asarray(tensor_or_array).view(np.uint8)[8 * index:8 * index + 8])
    return int.from_bytes(b, "big")
