"""Rank jobs for tests/test_p2p_cuda.py (run by mp_ranks.Ranks): p2p over CUDA IPC, every value
returned to the test as a CPU object (the test process need not touch the GPU)."""
import ctypes
import os

import torch

import gpunet
from gpunet.host.platform import get_platform
from mp_jobs import _pattern

SLOT = 1 << 18                    # bytes per slot of the destination tensor
MEMORY_TYPE_HOST = 1              # cudaMemoryTypeHost: host memory registered with the GPU
MEMORY_TYPE_DEVICE = 2            # cudaMemoryTypeDevice (cudaPointerAttributes.type)


class _PointerAttributes(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p),
                ("reserved", ctypes.c_long * 8)]     # room for fields a newer runtime adds


def memory_type(ptr):
    """cudaPointerGetAttributes(ptr).type: 2 for device memory, 1 host, 3 managed."""
    rt = get_platform().runtime()
    a = _PointerAttributes()
    fn = rt.lib.cudaPointerGetAttributes
    fn.argtypes, fn.restype = (ctypes.POINTER(_PointerAttributes), ctypes.c_void_p), ctypes.c_int
    rc = fn(ctypes.byref(a), ctypes.c_void_p(ptr))
    assert rc == 0, "cudaPointerGetAttributes(0x%x) failed with %d" % (ptr, rc)
    return a.type


def self_p2p_proxy(a, b):
    """p2p for a rank to itself (so every heap is device memory), the proxy between ranks."""
    return "p2p" if a == b else "proxy"


def self_p2p_ibgda(a, b):
    """p2p for a rank to itself, ibgda between ranks."""
    return "p2p" if a == b else "ibgda"


def rank0_p2p_else_ibgda(a, b):
    """p2p only for rank 0 to itself, ibgda for every other pair: rank 0's heap is device memory,
    the others' (no p2p peer) the host-mapped heap of NIC-only CUDA worlds, so the world mixes both
    heap kinds."""
    return "p2p" if a == b == 0 else "ibgda"


def init(state, heap_bytes=8 << 20, timeout_s=20.0, transport="p2p"):
    """gpunet.init with ``transport`` (a gpunet transport, or the name of a per-pair function
    above) and the allocations the jobs use; returns what the rank's heap and mappings are."""
    t = globals().get(transport, transport)
    ctx = gpunet.init(transport=t, nic="soft", heap_bytes=heap_bytes, timeout_s=timeout_s)
    state["ctx"] = ctx
    n = ctx.world_size
    state["src"] = ctx.alloc((SLOT,), torch.uint8)
    state["dst"] = ctx.alloc((2 * n * SLOT,), torch.uint8)   # slot r: from rank r; n + r: got from r
    state["sig"] = ctx.alloc((2 * n + 1,), torch.int64)  # word r: ADDed by r; n + r: SET by r;
    # 2n: the atomics' counter
    ctx.barrier()
    return {"rank": ctx.rank, "transports": dict(ctx.transports), "reasons": dict(ctx.reasons),
            "pid": os.getpid(),
            "heap_type": memory_type(ctx.heap_base), "alloc_type": memory_type(state["dst"].data_ptr()),
            "mapped_peers": sorted(ctx._transports.peer_heaps),
            "dma_peers": sorted(ctx._transports.dma_heaps),
            "peer_types": {p: memory_type(m.base) for p, m in ctx._transports.peer_heaps.items()}}


def verbs(state, nbytes, rnd, count):
    """One round: each rank fills src with pattern ``rnd``, puts src[:nbytes] to the next rank's
    slot ``me``, then put_signal src[nbytes:2 nbytes] behind it with ADD 1 on word ``me`` and a
    SET of 10 rnd on word n + me; waits for its previous rank's ADD word to reach ``count`` (the
    rounds so far); gets the next rank's src[:nbytes]
    into its slot n + next; barrier. Returns what landed here (CPU tensors, signal values)."""
    ctx = state["ctx"]
    me, n = ctx.rank, ctx.world_size
    src, dst, sig = state["src"], state["dst"], state["sig"]
    nxt, prv = (me + 1) % n, (me - 1) % n
    src.copy_(_pattern(me, rnd, SLOT).cuda())
    ctx.barrier()                  # every rank's src is ready before anyone gets it
    ctx.put(ctx.remote(nxt, dst, me * SLOT), src[:nbytes])
    ctx.put_signal(ctx.remote(nxt, dst, me * SLOT + nbytes), src[nbytes:2 * nbytes],
                   ctx.remote(nxt, sig, me))
    ctx.put_signal(ctx.remote(nxt, dst, me * SLOT + nbytes), src[nbytes:2 * nbytes],
                   ctx.remote(nxt, sig, n + me), value=10 * rnd, op="set")
    ctx.wait_until(sig, count, "ge", index=prv)
    after_signal = dst[prv * SLOT:prv * SLOT + 2 * nbytes].cpu()   # the signal implies the payload
    g = (n + nxt) * SLOT
    ctx.get(dst[g:g + nbytes], ctx.remote(nxt, src))
    ctx.quiet()
    ctx.barrier()
    return {"after_signal": after_signal, "got": dst[g:g + nbytes].cpu(),
            "add": gpunet.read_signal(sig, prv), "set": gpunet.read_signal(sig, n + prv)}


def atomics(state, k):
    """Every rank adds 1 to rank 0's word 2n ``k`` times (device atomics on the peer's
    mapped heap); returns the old values it saw and rank 0's final value."""
    ctx = state["ctx"]
    n = ctx.world_size
    ctx.barrier()
    olds = [ctx.atomic_add(ctx.remote(0, state["sig"], 2 * n), 1) for _ in range(k)]
    ctx.barrier()
    return {"olds": olds,
            "final": gpunet.read_signal(state["sig"], 2 * n) if ctx.rank == 0 else None}


def cross_atomics(state, k):
    """Each rank adds 1 ``k`` times to the OTHER rank's counter (word 2n of sig): over a NIC
    transport in the mixed worlds, so on a device-memory heap the soft NIC's bounce under the
    owner's lock. Returns the old values it saw and its own counter's final value."""
    ctx = state["ctx"]
    n = ctx.world_size
    state["sig"][2 * n:].zero_()
    ctx.barrier()
    other = (ctx.rank + 1) % n
    olds = [ctx.atomic_add(ctx.remote(other, state["sig"], 2 * n), 1) for _ in range(k)]
    ctx.quiet()
    ctx.barrier()
    return {"olds": olds, "final": gpunet.read_signal(state["sig"], 2 * n)}


def close(state):
    ctx = state.pop("ctx", None)
    if ctx is not None:
        ctx.barrier()              # no peer still stores into this heap when it is freed
        ctx.close()
    return "closed"


def pointer_type(state, ptr):
    """(cudaPointerGetAttributes' return code, the type it gives) for ``ptr``, with no assertion:
    0 / 2 for a live device allocation (a CUDA IPC mapping too); after the mapping was closed the
    runtime no longer knows the address (type 0, unregistered, or an error code)."""
    rt = get_platform().runtime()
    a = _PointerAttributes()
    fn = rt.lib.cudaPointerGetAttributes
    fn.argtypes, fn.restype = (ctypes.POINTER(_PointerAttributes), ctypes.c_void_p), ctypes.c_int
    rc = fn(ctypes.byref(a), ctypes.c_void_p(ptr))
    if rc != 0:
        rt.lib.cudaGetLastError()          # a failed query leaves the error; clear it
    return rc, int(a.type) if rc == 0 else None
