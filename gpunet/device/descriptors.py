"""Device descriptors for NIC resources: the QpDesc / PeerDesc / DevCtx / Status / ProxyChannel
that kernels read, filled from NIC objects (gpunet/device/abi.py holds their layouts).

Every user of device code (the Python API's Context, the tests' Loopback, the benchmarks) builds
them here, the same way. This module reads NIC and proxy objects only through their attributes
(the QP / CQ fields of gpunet/host/nic.py's interface, ``Nic.mapped_ranges()`` and ``io_ranges()``, a
proxy channel's device addresses), so the device side never imports host/ (tests/test_layers.py).

Where the descriptors live (the one place that chooses):
- HOST arm (CPU platform, ``mem=None``): "device memory" is ordinary 64-byte-aligned host memory
  (abi.alloc_struct); the kernels read the very objects Python fills.
- GPU (``mem=DeviceMemory(platform)``): Python fills host shadows (the same abi structs) and
  copies them into device memory (cudaMalloc + platform.memcpy); the kernels get the device
  copies' addresses. Status and QP heads are read back with ``get``. NIC rings (SQ, CQ, DBRs,
  doorbell word) stay where the NIC put them; :class:`NicMapping` registers the NIC's
  ``mapped_ranges()`` with the GPU and translates their addresses, and those of the MMIO pages
  ``map_doorbell`` mapped (``Nic.io_ranges()``), with ``g`` (identity where UVA gives device ==
  host).
"""
import bisect
import ctypes

import numpy as np

from gpunet import mlx5
from gpunet._floor import address_of
from gpunet.device import abi
from gpunet.errors import ConfigError
from gpunet.resource import Resource


class DeviceMemory(Resource):
    """Device-memory copies of ctypes objects / numpy arrays through a Platform (CPU: memmove).

    ``put(obj)`` -> device address of a new copy; ``zeros(n)``; ``get(obj, dptr)`` copies back into
    ``obj``; ``write(dptr, obj)`` overwrites. Each copy is a platform Allocation this object owns:
    ``close()`` frees them, newest first.
    """

    def __init__(self, plat):
        self.plat = plat

    @staticmethod
    def _span(obj):
        if isinstance(obj, np.ndarray):
            return obj.ctypes.data, obj.nbytes
        return ctypes.addressof(obj), ctypes.sizeof(obj)

    def put(self, obj):
        src, n = self._span(obj)
        a = self._adopt(self.plat.alloc("device", max(n, 64)), "device copy")
        self.plat.memcpy(a.ptr, src, n)
        return a.ptr

    def zeros(self, n):
        return self.put(np.zeros(max(int(n), 8), np.uint8))

    def get(self, obj, dptr):
        dst, n = self._span(obj)
        self.plat.memcpy(dst, dptr, n)
        return obj

    def write(self, dptr, obj):
        src, n = self._span(obj)
        self.plat.memcpy(dptr, src, n)


class NicMapping(Resource):
    """What a NIC says the GPU must reach (``nic.mapped_ranges()``: its rings, CQs, doorbell
    records and doorbell words, and the heap allocated from it), registered with the GPU
    (cudaHostRegister Mapped | Portable); ``close()`` unregisters them.

    ``ranges``: [(host address, nbytes, device pointer)], sorted; ``g(addr)`` translates an address
    inside them, or inside the NIC's MMIO pages (``nic.io_ranges()``: a real mlx5 NIC's UAR, which
    ``Nic.map_doorbell`` registers and owns); ``identity``: every device pointer of ``ranges``
    equals its host address (UVA), which code that hands the same heap addresses to the NIC and to
    GPU loads/stores needs (the MMIO pages hold no heap address, so they do not count).

    The MMIO pages are asked for at each ``g`` that misses ``ranges``, not once here: the Context
    builds this mapping before the transports map the doorbell (gpunet/context.py), so the UAR
    appears later. tests/test_devx.py::test_a_descriptor_built_after_the_mapping_reaches_the_uar.
    """

    def __init__(self, plat, nic):
        self.plat = plat
        self._nic = nic
        self.ranges = []
        try:
            for base, nbytes in sorted(nic.mapped_ranges()):
                dptr = plat.host_register(base, nbytes)
                self._adopt(_unregister(plat, base), "GPU registration of 0x%x" % base)
                self.ranges.append((int(base), int(nbytes), int(dptr)))
        except BaseException as e:
            self._close_noting(e)    # what was registered before the failure
            raise
        self._starts = [r[0] for r in self.ranges]

    def g(self, addr):
        """The GPU's address for host address ``addr`` (inside one of the mapped ranges)."""
        addr = int(addr)
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and addr < self.ranges[i][0] + self.ranges[i][1]:
            base, _, dptr = self.ranges[i]
            return addr - base + dptr
        io = self._nic.io_ranges()
        for base, nbytes, dptr in io:
            if base <= addr < base + nbytes:
                return addr - base + dptr
        raise ValueError("0x%x is not inside the NIC's mapped ranges (%s) nor its mapped MMIO "
                         "pages (%s; a doorbell is there only after Nic.map_doorbell)"
                         % (addr, _spans(self.ranges) or "none", _spans(io) or "none"))

    @property
    def identity(self):
        return all(base == dptr for base, _, dptr in self.ranges)


def _spans(ranges):
    return ", ".join("0x%x+0x%x" % (r[0], r[1]) for r in ranges)


def _unregister(plat, base):
    return lambda: plat.host_unregister(base)


def proxy_channel_desc(ch):
    """The device's ``ProxyChannel`` for proxy channel ``ch`` (gpunet/host/proxy.py ProxyChannel: its GPU
    addresses ``dev_fifo_addr`` / ``dev_hctrl_addr`` / ``dev_dctrl_addr``, ``depth`` and its index
    in the engine that drains it)."""
    d = abi.ProxyChannelDesc()
    d.fifo, d.host, d.dev = ch.dev_fifo_addr, ch.dev_hctrl_addr, ch.dev_dctrl_addr
    d.depth, d.id = ch.depth, ch.index or 0
    return d


def post_mode_of(post_mode):
    """QpDesc.post_mode for ``post_mode`` ("batched" or "serial"; qp.cuh's "Posting modes")."""
    try:
        return abi.POST_MODES[post_mode]
    except KeyError:
        raise ValueError("post_mode must be one of %s, not %r"
                         % (", ".join(sorted(abi.POST_MODES)), post_mode)) from None


def fill_qpdesc(d, qp, peer, slot_db, slot_nbb, slot_ready, g=int, post_mode="batched"):
    """Fill QpDesc ``d`` for NIC ``qp`` (gpunet/host/nic.py's QP attributes): ring addresses through
    ``g``, slot arrays given (zeroed; qp.cuh says what each holds); ``post_mode``: "batched"
    (any number of posters, one ring for several) or "serial" (fewest round trips for one poster
    at a time)."""
    cq = qp.send_cq
    d.post_mode = post_mode_of(post_mode)
    d.sq, d.dbrec, d.db = g(qp.sq_addr), g(qp.dbrec_addr), g(qp.db_addr)
    d.slot_db, d.slot_nbb, d.slot_ready = slot_db, slot_nbb, slot_ready
    d.sq_wqebbs, d.qpn, d.peer = qp.sq_wqebbs, qp.qpn, peer
    d.max_inline = qp.max_inline
    d.cq.buf, d.cq.dbrec, d.cq.cqe_cnt = g(cq.buf_addr), g(cq.dbrec_addr), cq.cqe_cnt
    d.cq.collapsed = int(cq.collapsed)
    return d


def device_qpdesc(m, dev, nic_qp, cq, peer, post_mode="batched"):
    """A host QpDesc for ``nic_qp`` whose ring pointers are GPU addresses (``m``: NicMapping) and
    whose slot arrays are in device memory (``dev``: DeviceMemory). ``cq`` must be its send CQ."""
    assert cq is nic_qp.send_cq
    return fill_qpdesc(abi.QpDesc(), nic_qp, peer, dev.zeros(nic_qp.sq_wqebbs * 8),
                       dev.zeros(nic_qp.sq_wqebbs * 4), dev.zeros(nic_qp.sq_wqebbs * 8), m.g,
                       post_mode)


class QpDescriptor:
    """A QpDesc (plus its per-slot arrays) for one NIC QP whose send CQ the device polls.

    ``qp``: a NIC QP (gpunet/host/nic.py); ``peer``: the PE it reaches. The CQ must hold at least
    ``qp.sq_wqebbs`` CQEs in owner-bit mode (every device WQE is signalled), or be collapsed. ``mem``/``mapped``: on a GPU,
    a DeviceMemory for the descriptor and slot arrays and the NicMapping holding the rings.
    ``post_mode``: "batched" (default) or "serial" (fill_qpdesc).
    """

    def __init__(self, qp, peer, mem=None, mapped=None, post_mode="batched"):
        cq = qp.send_cq
        if not cq.collapsed and cq.cqe_cnt < qp.sq_wqebbs:
            raise ValueError("device QPs signal every WQE: the CQ needs >= %d CQEs (has %d)"
                             % (qp.sq_wqebbs, cq.cqe_cnt))
        self.qp, self._mem = qp, mem
        self.desc = abi.alloc_struct(abi.QpDesc)
        if mem is None:
            self.slot_db = np.zeros(qp.sq_wqebbs, dtype=np.uint64)
            self.slot_nbb = np.zeros(qp.sq_wqebbs, dtype=np.uint32)
            self.slot_ready = np.zeros(qp.sq_wqebbs, dtype=np.uint64)
            fill_qpdesc(self.desc, qp, peer, address_of(self.slot_db),
                        address_of(self.slot_nbb), address_of(self.slot_ready),
                        post_mode=post_mode)
            self._dptr = None
        else:
            fill_qpdesc(self.desc, qp, peer, mem.zeros(qp.sq_wqebbs * 8),
                        mem.zeros(qp.sq_wqebbs * 4), mem.zeros(qp.sq_wqebbs * 8),
                        mapped.g if mapped is not None else int, post_mode)
            self._dptr = mem.put(self.desc)

    @property
    def addr(self):
        return abi.addr_of(self.desc) if self._dptr is None else self._dptr

    def heads(self):
        """(resv_head, ready_head, db_head, done_head): the device's posting counters."""
        if self._dptr is not None:
            self._mem.get(self.desc, self._dptr)
        d = self.desc
        return int(d.resv_head), int(d.ready_head), int(d.db_head), int(d.done_head)

    def state(self):
        """The device's posting state: heads, ``errored`` and the CQ consumer index (a dict)."""
        resv, ready, db, done = self.heads()
        return {"resv_head": resv, "ready_head": ready, "db_head": db, "done_head": done,
                "errored": int(self.desc.errored), "cq_ci": int(self.desc.cq.ci)}

    def needs_reset(self):
        """True when device posting on this QP cannot go on as is: an error CQE was seen
        (``errored``: every post fails fast), or a post reserved WQEBBs it never published
        (resv_head != ready_head with no kernel running: nothing reserved after it is ever rung)."""
        s = self.state()
        return bool(s["errored"]) or s["resv_head"] != s["ready_head"]

    def reset(self, cq_ci):
        """Restart device posting after the NIC QP was reset (``Nic.reset_qp``, which returns
        ``cq_ci``): its send queue restarts at WQE counter 0, so the heads restart at 0, the poll
        lock is free and ``errored`` is clear. The CQ, owned by this QP alone, resumes at ``cq_ci``:
        every CQE before it is of the old life (its consumer record says so to the NIC). A
        collapsed CQ's single slot is marked invalid instead, so that its old wqe_counter cannot
        be read as a completion of the new life. No kernel may be running on this QP.
        tests/test_api_adversarial.py::test_protection_error_is_raised_then_the_context_recovers.
        """
        if self._dptr is not None:
            self._mem.get(self.desc, self._dptr)
        d = self.desc
        d.resv_head = d.ready_head = d.db_head = d.done_head = 0
        d.poll_lock = d.errored = 0
        # The publish tags hold ends (and turn markers) of the old life's reservations: zero, or
        # a restarted ring would read them as ready (qp.cuh "Why a tag is exact").
        if self._dptr is None:
            self.slot_ready[:] = 0
        else:
            self._mem.write(d.slot_ready, np.zeros(self.qp.sq_wqebbs, np.uint64))
        cq = self.qp.send_cq
        if cq.collapsed:
            mlx5.init_cq(cq.buf, 1)
        else:
            d.cq.ci = int(cq_ci)
            mlx5.set_cq_dbrec(cq.dbrec, 0, int(cq_ci))
        if self._dptr is not None:
            self._mem.write(self._dptr, self.desc)


class DeviceContext:
    """A DevCtx with its PeerDesc array and Status block.

    ``local_base``/``heap_bytes``/``lkey``: this PE's registered symmetric heap; ``npes``/``my_pe``;
    ``scratch``/``discard``: addresses inside the heap for atomic results and NIC-written scratch;
    ``timeout_s``: the bound of every device wait. ``mem``: None (HOST arm: the structs are the
    device's) or a DeviceMemory (GPU: device copies, pushed on every change; the Status is read
    back by ``raise_for_status``). ``atomic_endianness``: the NICs' (``Nic.atomic_endianness``,
    "host" | "big"): "big" sets DEVCTX_SIGNAL_BE, so device code reads and writes signal words
    big-endian (devctx.cuh api::signal_order).
    """

    def __init__(self, local_base, heap_bytes, lkey, npes, my_pe, scratch, scratch_slots, discard,
                 timeout_s, max_wqe_bytes=0, mem=None, atomic_endianness="host"):
        if atomic_endianness not in ("host", "big"):
            raise ConfigError("atomic_endianness must be 'host' or 'big', not %r"
                              % (atomic_endianness,))
        self._mem = mem
        self.status = abi.alloc_struct(abi.Status)
        self.peers = abi.alloc_struct(abi.PeerDesc, npes)
        c = self.ctx = abi.alloc_struct(abi.DevCtx)
        c.local_base, c.heap_bytes, c.lkey = local_base, heap_bytes, lkey
        c.npes, c.my_pe, c.scratch_slots = npes, my_pe, scratch_slots
        c.timeout_ns = int(timeout_s * 1e9)
        c.scratch, c.discard = scratch, discard
        c.max_wqe_bytes = max_wqe_bytes
        c.flags = abi.DEVCTX_SIGNAL_BE if atomic_endianness == "big" else 0
        self.atomic_endianness = atomic_endianness
        self._keep = []
        if mem is None:
            c.peers, c.status = abi.addr_of(self.peers), abi.addr_of(self.status)
            self._status_dptr = self._peers_dptr = self._ctx_dptr = None
        else:
            self._status_dptr, self._peers_dptr = mem.put(self.status), mem.put(self.peers)
            c.peers, c.status = self._peers_dptr, self._status_dptr
            self._ctx_dptr = mem.put(c)

    def _push_peers(self):
        if self._mem is not None:
            self._mem.write(self._peers_dptr, self.peers)

    def set_peer_qp(self, pe, qpd, remote_base, rkey):
        """PE ``pe`` is reached by GPU-initiated posting on ``qpd`` (a QpDescriptor)."""
        p = self.peers[pe]
        p.kind, p.qp, p.proxy = abi.TRANSPORT_IBGDA, qpd.addr, 0
        p.remote_base, p.rkey = remote_base, rkey
        self._keep.append(qpd)
        self._push_peers()

    def set_peer_proxy(self, pe, channel_desc_addr, remote_base, rkey, keep=None):
        """PE ``pe`` is reached through a CPU-proxy channel (the address of its ProxyChannel
        descriptor: ``place(proxy_channel_desc(ch))``)."""
        p = self.peers[pe]
        p.kind, p.qp, p.proxy = abi.TRANSPORT_PROXY, 0, channel_desc_addr
        p.remote_base, p.rkey = remote_base, rkey
        if keep is not None:
            self._keep.append(keep)
        self._push_peers()

    def set_peer_p2p(self, pe, mapped_base, store_only, keep=None, same_device=False):
        """PE ``pe`` is reached by device stores into its heap, mapped in this process at
        ``mapped_base`` (transport/p2p.cuh); ``store_only``: no remote loads or atomics (the c500
        profile: get, atomics and ADD signals to it fail). ``keep``: the mapping, kept alive as
        long as this context. ``same_device``: the heap is on this GPU (P2P_SAME_DEVICE: a
        signal's release needs device scope only)."""
        p = self.peers[pe]
        p.kind, p.qp, p.proxy = abi.TRANSPORT_P2P, 0, 0
        p.remote_base = mapped_base
        p.rkey = (abi.P2P_STORE_ONLY if store_only else 0) | (abi.P2P_SAME_DEVICE if same_device else 0)
        if keep is not None:
            self._keep.append(keep)
        self._push_peers()

    def place(self, obj):
        """The address device code should use for a small host object (ctypes / numpy) that must
        outlive this context: the object itself on the HOST arm, a device copy on a GPU."""
        self._keep.append(obj)
        if self._mem is None:
            return address_of(obj) if isinstance(obj, np.ndarray) else abi.addr_of(obj)
        return self._mem.put(obj)

    @property
    def addr(self):
        return abi.addr_of(self.ctx) if self._ctx_dptr is None else self._ctx_dptr

    def clear_status(self):
        ctypes.memset(abi.addr_of(self.status), 0, ctypes.sizeof(self.status))
        if self._mem is not None:
            self._mem.write(self._status_dptr, self.status)

    def read_status(self):
        """The Status block as the device last wrote it (a GPU: copied back; sync first)."""
        if self._mem is not None:
            self._mem.get(self.status, self._status_dptr)
        return self.status

    def raise_for_status(self, what="device kernel"):
        abi.raise_for_status(self.read_status(), what)
