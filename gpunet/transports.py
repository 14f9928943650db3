"""Per-peer transport wiring of one rank: which transport reaches each peer, the RC QPs, the device
descriptors of ibgda peers, and the proxy channels and engine of proxy peers (DESIGN.md
"Transports under one device API").

- ``ibgda``: the kernel writes WQEs into the peer QP's send ring and rings its doorbell itself
  (gpunet/device/descriptors.py QpDescriptor).
- ``proxy``: the kernel pushes 16-byte commands into a channel's host-mapped FIFO and a CPU proxy
  thread posts them (gpunet/host/proxy.py). One channel per proxied peer.
- ``p2p``: this rank maps the peer's heap into its own address space (on the CPU the peer soft
  NIC's arena by name, ``Nic.map_peer_heap``; on CUDA the peer's device-memory heap by its IPC
  handle, ``Platform.ipc_open``) and the kernel stores into it directly (transport/p2p.cuh). A
  peer asked for by name (``transport="p2p"``, or per peer) that cannot be mapped raises
  ConfigError. On the ``c500`` profile p2p peers are store-only (get, atomics and ADD signals to
  them fail with a ConfigError; SET signals work). On CUDA every heap is device memory, so NIC
  peers of the soft NIC map it too, for its copy engine (``Nic.add_peer_memory``); a real NIC
  reaches its own heap by DMA and maps nothing.

``auto``: p2p for the peers whose heap this rank maps, the NIC otherwise. On CUDA that is every
peer on the same node (this rank too): p2p, the heap opened by CUDA IPC; a peer on another node
gets ibgda where the NIC's doorbell can be mapped into the device, else the proxy. Same node means
the same node identity (``node_identity``: hostname and boot id), which every rank publishes in
its ``info()``, so both ends of a pair settle on one kind from the same exchanged data (never
from a local attempt that may work on one end only); a same-node heap that cannot be opened
raises ConfigError naming the peer (pass 'ibgda' or 'proxy' for it). On the CPU (and MACA)
``auto`` is the NIC only: ibgda, or the proxy where the doorbell cannot be mapped. The CPU
platform is the NIC test bench and maps no peer's arena under auto; on MACA (c500) p2p is
store-only, so auto would refuse atomics there. Every choice is logged with its reason.

The choice is per peer: one kind for every peer, a dict {peer: kind, "default": kind} or a
callable (rank, peer) -> kind; both ends of a pair must agree (gpunet/context.py checks it in the
init exchange, on the settled kinds: ``settled_kinds``).

Set-up is two steps around the Context's exchanges: :class:`Transports` makes the QPs and
returns what peers need (``info``), then :meth:`Transports.connect` settles ``auto`` (CUDA),
connects the QPs to the peers' and fills the device context. Under ``auto`` on CUDA the NIC QPs
are made for every peer before the exchange, since only the exchange says which peers are on
another node. Every QP a rank makes has a partner only on peers that use the same transport
somewhere: a QP whose peer made no partner for it is left unconnected and unused, and one whose
peer settled on p2p is connected and unused
(tests/test_transports.py::test_a_rank_that_never_uses_the_proxy_beside_one_that_does).
"""
import logging
import os
import socket
import time

import numpy as np

from gpunet import config, mlx5
from gpunet._floor import Deadline
from gpunet.device import abi
from gpunet.device.descriptors import QpDescriptor, proxy_channel_desc
from gpunet.errors import ConfigError, GpunetError
from gpunet.resource import Resource

log = logging.getLogger("gpunet")

TRANSPORTS = ("auto", "ibgda", "proxy", "p2p")
SQ_WQEBBS = 256                   # per-peer send ring: 16 KiB, deep enough for a doorbell batch
PROXY_DEPTH = 1024                # proxy FIFO slots per channel
# Close barrier (Transports.close_barrier): heap offset of one 8-byte word per rank, in the heap
# head (gpunet/heap.py RESERVED_BYTES; below it: barrier slots, atomic scratch, discard word,
# which end at 12296 B); a peer sets its word once it is done with this heap.
CLOSE_SLOTS_OFF = 16 << 10
CLOSE_POLL_S = 1e-3               # between reads of the close words: a close, not a hot path


def _gpu_identity():
    """This process's current GPU, the same string in every process that uses it (its UUID), or
    None when torch cannot say: p2p peers on the same GPU release signals at device scope only
    (transport/p2p.cuh P2P_SAME_DEVICE)."""
    try:
        import torch
        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    except Exception:  # noqa: BLE001 - no identity: the peer is treated as on another GPU
        return None


def ranks_on_gpu(everyone, me):
    """The ranks whose processes use rank ``me``'s GPU, ``me`` included, whatever their transport,
    from the exchanged infos (Transports.info: "gpu" and "node"): kernels that wait for each
    other must all fit on its SMs (gpunet.ep's grid). (me,) without a GPU identity."""
    gpu, node = everyone[me].get("gpu"), everyone[me].get("node")
    return tuple(p for p in range(len(everyone)) if p == me or (
        gpu is not None and everyone[p].get("gpu") == gpu and everyone[p].get("node") == node))


def _maybe_alive(mapping):
    """False when ``mapping`` (a peer heap mapped here) says its owner's rank is gone
    (PeerHeap.owner_alive, IpcMapping.owner_alive: the exporting process exited); True when it
    cannot tell (no mapping here)."""
    alive = getattr(mapping, "owner_alive", None)
    return alive is None or bool(alive())


def check_transport(transport):
    """ConfigError unless ``transport`` is one of TRANSPORTS, a dict {peer: kind, "default": kind}
    or a callable (rank, peer) -> kind (see peer_transport)."""
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


def peer_transport(transport, rank, peer):
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
    if requested == "p2p":
        return "p2p", "asked for (transport='p2p'): stores into the peer's heap mapped here"
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



BOOT_ID = "/proc/sys/kernel/random/boot_id"


def node_identity():
    """This machine's identity, (hostname, boot id): the same in every process on it, different
    on another machine, also one whose hostname is the same (a container image's): the kernel
    draws a new boot id at every boot (``BOOT_ID``). Ranks exchange it in the init, and "auto"
    on CUDA makes the peers with this rank's identity p2p (settle_auto)."""
    try:
        with open(BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:
        boot = ""                      # no procfs: the hostname alone tells machines apart
    return (socket.gethostname(), boot)


def _node_name(node):
    """A node identity for messages: its hostname and the start of its boot id."""
    if not node:
        return "unknown"
    host, boot = node
    return "%s, boot %s" % (host, boot[:8]) if boot else host


def settle_auto(nic_choice, here, there, itself=False):
    """(kind, reason) that "auto" on CUDA settles to between this rank, on node ``here``, and a
    peer on node ``there`` (node_identity() of each, as exchanged in the init; ``itself``: the
    peer is this rank). The same node: p2p, the peer's heap mapped here by CUDA IPC (this rank's
    own heap for itself). Another node: ``nic_choice``, choose_transport's ("ibgda" | "proxy",
    reason) for "auto"."""
    if here is not None and here == there:
        if itself:
            return "p2p", "auto: this rank itself (host %s): its own heap" % _node_name(here)
        return "p2p", "auto: same node (host %s), heap mapped by CUDA IPC" % _node_name(here)
    kind, why = nic_choice
    why = why[len("auto: "):] if why.startswith("auto: ") else why
    return kind, ("auto: another node (host %s; this rank on %s), so the NIC: %s"
                  % (_node_name(there), _node_name(here), why))


def settled_kinds(everyone, rank):
    """Rank ``rank``'s transport per peer once every rank's info() is known (``everyone``, by
    rank): its kinds before the exchange (info()["transports"]), each peer it asked "auto" for
    on CUDA (info()["auto"]) settled by settle_auto on the exchanged node identities
    (info()["node"]). Only exchanged data goes in, so both ends of a pair, and the init's
    check on every rank, compute the same kinds."""
    mine = everyone[rank]
    kinds = dict(mine["transports"])
    for p in mine.get("auto", ()):
        kinds[p] = settle_auto((kinds[p], ""), mine.get("node"), everyone[p].get("node"),
                               p == rank)[0]
    return kinds

class Transports(Resource):
    """The transports of one rank towards every peer (itself included, through loopback QPs).

    ``nic``: a gpunet/host/nic.py Nic; ``platform``: gpunet/host/platform.py's Platform (the proxy's FIFOs go in
    its host-mapped memory on a GPU); ``transport``: as gpunet.init takes it; ``probe_doorbell``:
    see choose_transport; ``proxy_threads``: threads draining the proxy channels.

    ``heap``: (address, nbytes) of this rank's heap; ``device_heap``: it is device memory (CUDA).

    Attributes: ``kinds`` (peer -> "ibgda" | "proxy" | "p2p"; a peer under "auto" on CUDA has
    the NIC's kind until :meth:`connect` settles it), ``reasons`` (peer -> why), ``node`` (this
    rank's node_identity()), after :meth:`connect` ``qpds`` (peer -> QpDescriptor, ibgda peers),
    ``channels`` (peer -> ProxyChannel, proxy peers), ``engine`` (the ProxyEngine, or None),
    ``peer_heaps`` / ``dma_heaps`` (peer -> its heap mapped here, for p2p / for the soft NIC).

    Close order (children, last made first): the proxy engine (its threads stop posting), then the
    proxy channels (their FIFO memory); the QPs go with the NIC, which the Context closes after.
    """

    def __init__(self, nic, platform, rank, world_size, transport, probe_doorbell, proxy_threads=1,
                 heap=None, device_heap=False):
        self.nic, self.platform = nic, platform
        self.rank, self.world_size = rank, world_size
        self._gpu = platform.name != "cpu"
        self._proxy_threads = proxy_threads
        self.qpds, self.channels, self.engine = {}, {}, None
        # set when a recovery closed the proxy engine and could not start a new one: what every
        # later failure() reports, since the channels then have nobody draining them
        self._proxy_lost = None
        self.peer_heaps = {}             # p2p peer -> its heap mapped here (Nic.map_peer_heap)
        self.dma_heaps = {}              # NIC peer -> its device heap mapped here for the NIC's
                                         # copy engine (CUDA IPC; Nic.add_peer_memory)
        self._heap = heap                # (address, nbytes) of this rank's heap: what p2p exports
        self._device_heap = bool(device_heap)   # this rank's heap is device memory (CUDA)
        self.node = node_identity()
        self.kinds, self.reasons = {}, {}
        # peers asked "auto" on CUDA -> the NIC's choice for them (choose_transport): their kind
        # until connect() settles it from the exchanged node identities (_settle), and the QPs
        # made below for it, so that a peer on another node falls back to the NIC
        self._auto = {}
        self._per_peer = not isinstance(transport, str)
        self._maps_nic_heaps = hasattr(nic, "add_peer_memory")   # a soft NIC: _map_for_nic
        self._mapped_by = set()          # peers that map this rank's heap (set in connect)
        n, me = world_size, rank
        # all peers share this NIC's doorbell page, so one probe decides for every one of them
        for p in range(n):
            asked = peer_transport(transport, me, p)
            t, why = choose_transport(asked, probe_doorbell)
            if asked == "auto" and platform.name == "cuda":
                self._auto[p] = (t, why)
            if self._per_peer:
                why = "per-peer choice %r; %s" % (asked, why)
            self.kinds[p], self.reasons[p] = t, why
            if p not in self._auto:      # the settled ones are logged by _settle
                log.info("gpunet rank %d -> peer %d: %s (%s)", me, p, t, why)
        # One RC QP per peer and transport user (the device, or the proxy threads: a QP has one
        # poster), plus a loopback partner per user for this rank itself.
        self._users = sorted(set(self.kinds.values()) - {"p2p"})
        self._qps, self._partner = {}, {}
        for u in self._users:
            for p in range(n):
                self._qps[u, p] = self.nic.create_qp(self.nic.create_cq(cqe_cnt=SQ_WQEBBS),
                                                     sq_wqebbs=SQ_WQEBBS)
            self._partner[u] = self.nic.create_qp(self.nic.create_cq(cqe_cnt=SQ_WQEBBS),
                                                  sq_wqebbs=SQ_WQEBBS)

    def info(self):
        """What the peers need to connect to this rank's QPs and map its heap (picklable):
        besides the QPs, its kinds before the exchange ("transports"), the peers whose kind
        "auto" settles in connect ("auto") and its node identity ("node"; settled_kinds)."""
        p2p = None
        if self._exported():
            if self._heap is None:
                raise ConfigError("transport='p2p' needs this rank's heap to export")
            # GPU: the heap is a device allocation, shared by its CUDA IPC handle (with p2p peers
            # and with NIC peers, whose soft NIC engine copies into it); CPU: the soft NIC's
            # arena range, by name
            p2p = (self.platform.ipc_export(self._heap[0]) if self._gpu
                   else self.nic.export_heap(*self._heap))
        return {"qps": {k: q.info() for k, q in self._qps.items()},
                "transports": dict(self.kinds), "auto": sorted(self._auto), "node": self.node,
                "p2p": p2p, "device_heap": self._device_heap,
                "maps_nic_heaps": self._maps_nic_heaps,
                "gpu": _gpu_identity() if self._gpu else None, "pid": os.getpid()}

    def _exported(self):
        """Whether a peer may map this rank's heap: a p2p peer, a peer "auto" may make p2p, or
        with a device heap any other peer (a soft NIC maps it for its copy engine)."""
        others = [p for p in range(self.world_size) if p != self.rank]
        return any(self.kinds[p] == "p2p" or p in self._auto for p in others) or \
            bool(self._device_heap and others)

    def connect(self, everyone, dev, local_heap, mem=None, mapping=None):
        """Connect every QP to its partner on the peer and fill ``dev`` (a DeviceContext): per
        ibgda peer a QpDescriptor, per proxy peer a channel drained by the proxy engine.

        ``everyone``: per rank, its ``info()`` plus "heap" and "rkey" (its heap's address and
        rkey); ``local_heap``: (address, lkey) of this rank's heap; ``mem`` / ``mapping``: on a
        GPU, the DeviceMemory for descriptors and the NicMapping of the NIC's rings."""
        n, me = self.world_size, self.rank
        post_mode = config.get("GPUNET_QP_POST_MODE")
        self.ranks_on_gpu = ranks_on_gpu(everyone, me)
        self._settle(everyone)
        for (u, p), q in self._qps.items():
            if p == me:
                self.nic.connect(q, self._partner[u].info())
                self.nic.connect(self._partner[u], q.info())
            elif (u, me) in everyone[p]["qps"]:
                self.nic.connect(q, everyone[p]["qps"][u, me])
            # else: peer p uses no `u` QPs at all, so this one has no partner and stays unused
            # (a proxied peer is reached through its channel only; kinds agree pairwise)
        for p in range(n):
            if self.kinds[p] == "ibgda":
                qpd = QpDescriptor(self._qps["ibgda", p], p, mem=mem, mapped=mapping,
                                   post_mode=post_mode)
                dev.set_peer_qp(p, qpd, everyone[p]["heap"], everyone[p]["rkey"])
                self.qpds[p] = qpd
        # who maps this rank's heap: its p2p peers, and with a device heap the NIC peers whose
        # soft NIC reaches it through a mapping (_map_for_nic); close_barrier waits for them
        self._mapped_by = {p for p in range(n) if p != me and (
            self.kinds[p] == "p2p" or (self._device_heap and everyone[p].get("maps_nic_heaps")))}
        for p in range(n):
            if self.kinds[p] == "p2p":
                self._setup_p2p(p, everyone, dev, local_heap)
            elif p != me and everyone[p].get("device_heap") and self._maps_nic_heaps:
                self._map_for_nic(p, everyone)
            # else: a real NIC (no add_peer_memory) needs no mapping of the peer's device heap:
            # the peer's NIC reaches it by DMA (its reg_mr took the dma-buf path)
        proxied = [p for p in range(n) if self.kinds[p] == "proxy"]
        if proxied:
            self._setup_proxy(proxied, everyone, dev, local_heap)

    def _settle(self, everyone):
        """Settle the kinds "auto" left open on CUDA (``_auto``) from the exchanged infos: p2p
        for a peer on this node, else the NIC's choice (settle_auto, the rule settled_kinds
        applies for the init's check), with the reason, logged once."""
        mine = everyone[self.rank].get("node")
        for p, nic_choice in sorted(self._auto.items()):
            kind, why = settle_auto(nic_choice, mine, everyone[p].get("node"), p == self.rank)
            self.kinds[p] = kind
            self.reasons[p] = ("per-peer choice 'auto'; " if self._per_peer else "") + why
            log.info("gpunet rank %d -> peer %d: %s (%s)", self.rank, p, kind, self.reasons[p])

    def _setup_p2p(self, p, everyone, dev, local_heap):
        """Map peer ``p``'s heap (this rank itself: its own heap) and make it a p2p peer: on the
        CPU the peer soft NIC's arena range (Nic.map_peer_heap), on a GPU the peer's device heap
        by its IPC handle (Platform.ipc_open). The mapping is a child, so it is unmapped when the
        transports close, also after a failed set-up. Store-only on the c500 profile
        (transport/p2p.cuh)."""
        store_only = self.platform.profile == "c500"
        if p == self.rank:
            dev.set_peer_p2p(p, local_heap[0], store_only, same_device=self._gpu)
            return
        from gpunet.host.platform import VendorRuntimeError
        try:
            if self._gpu:
                m = self.platform.ipc_open(everyone[p]["p2p"], everyone[p]["heap_bytes"],
                                           pid=everyone[p].get("pid"))
            else:
                m = self.nic.map_peer_heap(everyone[p]["p2p"])
        except (ConfigError, VendorRuntimeError) as e:
            if p in self._auto:
                raise ConfigError("transport='auto' to peer %d: it is on this node (host %s), so "
                                  "p2p, but its heap cannot be opened here (%s); pass "
                                  "transport='ibgda' or 'proxy' for peer %d (on both ends: a dict "
                                  "or a callable (rank, peer))"
                                  % (p, _node_name(self.node), e, p)) from e
            raise ConfigError("transport='p2p' to peer %d: cannot map its heap here (%s); p2p "
                              "needs the peer on this machine, alive; use transport='ibgda' or "
                              "'proxy' for it" % (p, e)) from e
        self.peer_heaps[p] = self._adopt(m, "p2p mapping of peer %d" % p)
        mine = everyone[self.rank].get("gpu")
        same = self._gpu and mine is not None and everyone[p].get("gpu") == mine
        dev.set_peer_p2p(p, m.base, store_only, keep=m, same_device=same)

    def _map_for_nic(self, p, everyone):
        """NIC peer ``p``'s heap is device memory and this rank's NIC is a soft NIC: map the heap
        here (CUDA: by its IPC handle; CPU: the peer arena's range) and tell the NIC where
        (Nic.add_peer_memory), so that
        this rank's soft NIC engine, which executes the RDMA writes, reads and atomics towards
        ``p`` itself, reaches it through its copy engine, as a responder NIC would by DMA. The
        mapping is a child, closed with the transports."""
        from gpunet.host.platform import VendorRuntimeError
        try:
            # CPU (GPUNET_HEAP_MEMORY=device): the peer's arena range, by name, as p2p maps it
            m = (self.platform.ipc_open(everyone[p]["p2p"], everyone[p]["heap_bytes"],
                                        pid=everyone[p].get("pid")) if self._gpu
                 else self.nic.map_peer_heap(everyone[p]["p2p"]))
        except (ConfigError, VendorRuntimeError) as e:
            raise ConfigError("peer %d (%s): its heap is device memory and this rank cannot map "
                              "it for the soft NIC (%s); the peer must be on this machine, alive"
                              % (p, self.kinds[p], e)) from e
        self.dma_heaps[p] = self._adopt(m, "NIC mapping of peer %d's device heap" % p)
        for u in self._users:
            q = everyone[p]["qps"].get((u, self.rank))
            if q is not None:
                self.nic.add_peer_memory(q, everyone[p]["heap"], everyone[p]["heap_bytes"],
                                         m.base)
        self.reasons[p] += "; its heap is device memory, mapped here (%s) for the NIC" % (
            "CUDA IPC" if self._gpu else "its arena")
        log.info("gpunet rank %d -> peer %d: %s over its device heap (the soft NIC's engine "
                 "copies through %s)", self.rank, p, self.kinds[p],
                 "the CUDA runtime" if self._gpu else "the CPU platform's copy engine")

    def _setup_proxy(self, proxied, everyone, dev, local_heap):
        """One proxy channel per proxied peer, all drained by the proxy threads. Per peer, because
        a channel's recorded failure is sticky (every later quiet on it fails): a dead peer then
        fails the operations to it alone, and code that decides per peer (gpunet.ep's masking,
        tests/test_ep_ll.py's killed-rank tests over the proxy) can go on with the rest."""
        from gpunet.host.proxy import ProxyChannel, ProxyEngine

        for p in proxied:
            self.channels[p] = self._adopt(
                ProxyChannel(depth=PROXY_DEPTH, platform=self.platform if self._gpu else None),
                "proxy channel %d" % p)
        remote_heaps = [(e["heap"], e["rkey"]) for e in everyone]
        # kept to start a new engine on the same channels and QPs after a reset (recover)
        self._engine_args = (self.nic, list(self.channels.values()),
                             [[self._qps["proxy", p]] for p in range(self.world_size)],
                             local_heap, remote_heaps)
        self.engine = ProxyEngine(*self._engine_args, threads=self._proxy_threads)
        self._adopt(lambda: self.engine.close(), "proxy engine")
        for p, ch in self.channels.items():
            dev.set_peer_proxy(p, dev.place(proxy_channel_desc(ch)), everyone[p]["heap"],
                               everyone[p]["rkey"])

    # --- after a failure ----------------------------------------------------------------------
    # ops that reach every peer (quiet, fence, wait_until's peer-agnostic wait is local: not here)
    _ALL_PEER_OPS = (abi.OP_QUIET, abi.OP_FENCE)

    def refuse_lost_proxy(self, ops, what):
        """Before a launch: once the proxy could not be restarted (_proxy_lost), raise that failure
        for ops that would need it (an op to a proxied peer, or a quiet / fence, which waits for
        every peer), instead of launching them to wait out their bound on a FIFO nothing drains."""
        if self._proxy_lost is None:
            return
        for o in ops:
            if o.kind in self._ALL_PEER_OPS or int(o.pe) in self.channels:
                raise GpunetError("%s refused before launch: %s" % (what, self._proxy_lost))

    def failure(self):
        """The failure the proxy recorded (a GpunetError), or None (also without a proxy)."""
        if self.engine is None:
            return None
        if self._proxy_lost is not None:
            return GpunetError(self._proxy_lost)
        try:
            self.engine.check()
        except GpunetError as e:
            return e
        return None

    def recover(self, timeout_s):
        """Bring every QP that a failure left unusable back to RTS, so that the next good
        operation works: a QP the NIC moved to ERR (a protection error, a bad WQE) or whose device
        posting state cannot go on (an error CQE seen, a reservation never published) is reset at
        the NIC (Nic.reset_qp) and in its device descriptor (QpDescriptor.reset); the proxy's
        channels are drained, its engine restarted on the reset QPs and their recorded failures
        cleared. Work queued on a reset QP after the failed operation is discarded. A QP whose
        peer did not answer (retry exceeded: dead) is left in error: every later operation to
        that peer fails at once. p2p peers whose rank is gone are named (_gone_p2p_peers). No
        kernel of ours may be running. Returns notes for the error message (an empty list when
        nothing needed doing).
        tests/test_api_adversarial.py::test_protection_error_is_raised_then_the_context_recovers.
        """
        notes = self._gone_p2p_peers()
        for p, qpd in self.qpds.items():
            if self.nic.qp_state(qpd.qp) != "ERR" and not qpd.needs_reset():
                continue
            if self._dead_peer(qpd.qp, p, notes):
                continue
            qpd.reset(self.nic.reset_qp(qpd.qp, timeout_s=timeout_s))
            notes.append("the QP to peer %d was reset to RTS (what was queued on it after the "
                         "failed operation was discarded)" % p)
        if self.engine is not None:
            notes += self._recover_proxy(timeout_s)
        return notes

    def _gone_p2p_peers(self):
        """Notes naming the p2p peers whose rank is gone (its process exited, or its NIC closed):
        no NIC reports a p2p peer dead (a store into its heap mapped here still succeeds), so a
        wait for it only times out, and this names whom it waited for. The mapping stays until
        this Context closes (tests/test_p2p.py::test_a_killed_p2p_peer_is_named_and_close_unmaps).
        Mappings that cannot tell (CUDA IPC) say nothing."""
        notes = []
        for p, m in sorted(self.peer_heaps.items()):
            alive = getattr(m, "owner_alive", None)
            if alive is not None and not alive():
                notes.append("p2p peer %d (pid %s) is gone: nothing it should signal will come; "
                             "its heap stays mapped here until this Context closes; close it"
                             % (p, getattr(m, "pid", "?")))
        return notes

    # --- close -------------------------------------------------------------------------------
    def close_barrier(self, timeout_s):
        """Before this rank's heap is released (Context.close, after its kernels ended and before
        these transports unmap the peers' heaps): say "done with your heap" to every peer whose
        heap this rank maps, by setting word ``rank`` of the CLOSE_SLOTS in that heap's head, then
        wait until every peer that maps this heap has set its word here, so that no peer stores
        into (or loads from) this heap after it is freed (on CUDA, freeing memory a peer still
        has open by IPC is undefined; on the CPU the peer's stores would vanish with the arena).
        Who maps this heap: p2p peers, and with a device heap every NIC peer of a soft NIC (it
        maps the heap for its copy engine, _map_for_nic; a real NIC maps nothing). Bounded by ``timeout_s``: a peer whose
        rank is gone (PeerHeap.owner_alive) is not waited for, and one that neither answers nor
        is known gone in time is named in a warning and the heap is released anyway: close never
        hangs on a peer. Returns the peers that did not answer.
        tests/test_p2p.py::test_close_waits_for_the_peers_that_map_its_heap.
        """
        me, n = self.rank, self.world_size
        mapped = dict(self.peer_heaps)
        mapped.update(self.dma_heaps)
        one = np.ones(1, dtype=np.uint64)
        for p, m in sorted(mapped.items()):
            # never into the heap of a rank known gone: its memory may be freed (CUDA IPC: the
            # exporter exited), the mapping is only closed (test_p2p_cuda.py's dead-peer test)
            if _maybe_alive(m):
                self.platform.memcpy(m.base + CLOSE_SLOTS_OFF + 8 * me, one.ctypes.data, 8)
        waiting = set(self._mapped_by)
        if not waiting:
            return []
        words = np.zeros(n, dtype=np.uint64)
        deadline = Deadline(timeout_s)
        while True:
            self.platform.memcpy(words.ctypes.data, self._heap[0] + CLOSE_SLOTS_OFF, 8 * n)
            waiting = {p for p in waiting if not words[p] and _maybe_alive(mapped.get(p))}
            if not waiting or deadline.expired():
                break
            time.sleep(CLOSE_POLL_S)
        if waiting:
            log.warning("gpunet rank %d: closing without word from peer(s) %s after %g s: they "
                        "still map this rank's heap, which is released now; a store of theirs "
                        "into it is lost (close every rank of a world together)",
                        me, sorted(waiting), timeout_s)
        return sorted(waiting)

    def _dead_peer(self, qp, peer, notes):
        if self.nic.qp_error_syndrome(qp) != mlx5.SYNDROME_TRANSPORT_RETRY_EXC_ERR:
            return False
        notes.append("the QP to peer %d stays in error: the peer did not answer (retry exceeded: "
                     "dead?), so every later operation to it fails at once; close this Context"
                     % peer)
        return True

    def _recover_proxy(self, timeout_s):
        from gpunet.host.proxy import ProxyEngine, resume_after_reset

        if self._proxy_lost is not None:
            return [self._proxy_lost]
        chans = list(self.channels.values())
        heads = [self.proxy_head(ch) for ch in chans]
        bad = [(p, row[0]) for p, row in enumerate(self._engine_args[2])
               if self.nic.qp_state(row[0]) == "ERR"]
        failed = bad or any(ch.error() is not None for ch in chans)
        if not failed and all(ch.completed >= h for ch, h in zip(chans, heads)):
            return []
        # Every command pushed so far completes first (those behind an error flush), so that the
        # new engine, which resumes at `completed`, takes none of them again. A push that gave up
        # while the FIFO was full (proxy.cuh wait_space) left its slots empty, and the proxy would
        # stop at the first for good: they get NOPs as the proxy frees their slots.
        deadline = Deadline(timeout_s)
        filled = 0
        for ch, head in zip(chans, heads):
            while ch.completed < head:
                filled += ch.fill_holes(head)
                if deadline.expired() or self.engine.alive_threads() == []:
                    return ["a proxy channel did not drain (%d of %d commands completed), so it "
                            "stays failed; close this Context" % (ch.completed, head)]
                time.sleep(50e-6)
        notes = ["%d proxy FIFO slot(s) that a push reserved and left empty (it gave up on a "
                 "failure) were filled with NOPs" % filled] if filled else []
        if not failed:
            return notes
        # from the old engine's close on, a failure leaves no proxy thread draining the channels:
        # a later put would sit in its FIFO and a later quiet only time out, so the Transports
        # remembers it and reports it on every later failure() and recover() instead
        # (tests/test_api_adversarial.py::test_a_proxy_that_cannot_be_restarted_is_reported_after)
        try:
            self.engine.close()
            for p, qp in bad:
                if self._dead_peer(qp, p, notes):
                    continue
                resume_after_reset(qp, self.nic.reset_qp(qp, timeout_s=timeout_s))
                notes.append("the proxy's QP to peer %d was reset to RTS (what was queued on it "
                             "after the failed command was discarded)" % p)
            for ch in chans:
                ch.clear_error()
            # the old engine's landing slots: NIC memory is never freed (ProxyEngine's scratch)
            self.engine = ProxyEngine(*self._engine_args, threads=self._proxy_threads,
                                      scratch=self.engine.scratch)
        except Exception as e:  # noqa: BLE001 - whatever stopped it, the proxy is gone
            self._proxy_lost = (
                "the proxy could not be restarted after a failure (%s: %s): nothing drains the "
                "proxy channels to peers %s any more, so operations to them cannot complete; "
                "close this Context" % (type(e).__name__, e, sorted(self.channels)))
            raise GpunetError(self._proxy_lost) from e
        return notes or ["the proxy channel's failure was cleared"]

    def proxy_head(self, ch):
        """Commands pushed into proxy channel ``ch`` so far (DevCtrl.head; on a GPU device memory)."""
        if not self._gpu:
            return ch.head
        word = np.zeros(1, dtype=np.uint64)
        self.platform.memcpy(word.ctypes.data, ch.dctrl_addr, 8)
        return int(word[0])
