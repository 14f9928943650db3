"""One rank's symmetric heap: the range allocator, the records of live allocations, and the torch
tensors over it.

The heap is ``heap_bytes`` of NIC-registered memory (``nic.alloc``); offsets are the same on every
rank because every rank makes the same calls in the same order (Context.alloc / free are
collective and agree in one exchange). Layout: ``[0, RESERVED_BYTES)`` is the head (barrier word,
atomic result slots, NIC scratch: gpunet/context.py places them), allocations follow, each
``ALIGN``-aligned. Free ranges are kept sorted and coalesced, and the top is lowered when the
range below it is freed, so that after freeing everything one allocation of the whole heap fits
again (tests/test_api_adversarial.py::test_heap_model).
"""
import bisect
import math

import torch

from gpunet.errors import ConfigError

RESERVED_BYTES = 64 << 10         # heap head: barrier word, atomic result slots, NIC scratch
ALIGN = 256                       # symmetric allocations: 256-byte aligned (a GPU cache line x2)


class Alloc:
    """One live symmetric allocation: heap offset, size taken (ALIGN multiple), the bytes the
    caller asked for, and the storage of the tensor alloc returned, which every view shares: a
    tensor belongs to this allocation iff it has this storage (a freed one's record is gone)."""

    __slots__ = ("off", "size", "nbytes", "storage")

    def __init__(self, off, size, nbytes, storage):
        self.off, self.size, self.nbytes, self.storage = off, size, nbytes, storage


class SymmetricHeap:
    """The allocator and the live allocations of one heap.

    ``buf``: the heap's bytes (np.uint8[heap_bytes], NIC-registered), or None for a heap in GPU
    device memory (CUDA: no CPU view, zeroed by a stream-ordered fill); ``base``: its address;
    ``device``: "cpu" or "cuda", the kind of tensor :meth:`make` makes (CUDA: a view of the
    device memory; of host-mapped bytes, a heap given as ``buf``, it needs device pointer ==
    host address). Attributes ``top`` (everything
    at or above it is free), ``free`` (sorted, coalesced (offset, size) ranges below ``top``),
    ``allocs`` (offset -> Alloc).
    """

    def __init__(self, buf, base, heap_bytes, device, owner):
        self.buf, self.base, self.heap_bytes, self.device = buf, base, heap_bytes, device
        self._owner = owner         # what CUDA views keep alive (the Context)
        self.allocs = {}            # heap offset -> Alloc
        self._by_storage = {}       # storage id (_cdata) -> Alloc
        self.free = []
        self.top = RESERVED_BYTES

    # --- ranges ----------------------------------------------------------------------------------
    def take(self, size):
        """First fit in the free ranges, else from the top; ConfigError when nothing fits."""
        for i, (o, s) in enumerate(self.free):
            if s >= size:
                if s == size:
                    self.free.pop(i)
                else:
                    self.free[i] = (o + size, s - size)
                return o
        if self.top + size > self.heap_bytes:
            largest = max([s for _, s in self.free] + [self.heap_bytes - self.top])
            raise ConfigError("symmetric heap full: %d bytes asked, the largest free range is %d "
                              "bytes (heap of %d); pass a larger heap_bytes to gpunet.init"
                              % (size, largest, self.heap_bytes))
        off = self.top
        self.top += size
        return off

    def release(self, off, size):
        """Give [off, off + size) back: merged with the free ranges it touches, and the top
        lowered when the range ends there."""
        i = bisect.bisect_left(self.free, (off, size))
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == off:
            i -= 1
            off, size = self.free[i][0], self.free[i][1] + size
            self.free.pop(i)
        if i < len(self.free) and off + size == self.free[i][0]:
            size += self.free[i][1]
            self.free.pop(i)
        if off + size == self.top:
            self.top = off
        else:
            self.free.insert(i, (off, size))

    # --- allocations -----------------------------------------------------------------------------
    def make(self, dims, dtype):
        """Take a range for a ``dims`` tensor of ``dtype``, zero it and view it; returns (tensor,
        Alloc) without recording it (:meth:`add` does, once every rank agreed). ConfigError when
        it does not fit; the range is given back if anything fails."""
        nbytes = math.prod(dims) * dtype.itemsize          # Python ints: no int64 wrap
        if nbytes > self.heap_bytes - RESERVED_BYTES:
            raise ConfigError("symmetric heap full: alloc of shape %r (%s) needs %d bytes, more "
                              "than the whole heap (%d usable); pass a larger heap_bytes to "
                              "gpunet.init" % (dims, dtype, nbytes, self.heap_bytes - RESERVED_BYTES))
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        off = self.take(size)
        try:
            if self.buf is not None:
                self.buf[off:off + size] = 0
            if self.device == "cuda":
                whole = _cuda_view(self.base + off, size, self._owner)
                if self.buf is None:
                    # device heap: a fill on the current stream, then WAITED for. Context.alloc's
                    # sync comes before it, and a peer may store into the range (NIC or p2p) as
                    # soon as the alloc's exchange returns on its side: a fill still queued then
                    # would erase the peer's first rows and signals after they landed.
                    # tests/test_heap_zero.py
                    whole.zero_()
                    torch.cuda.current_stream().synchronize()
            else:
                whole = torch.frombuffer(memoryview(self.buf[off:off + size]), dtype=torch.uint8)
            t = whole[:nbytes].view(dtype).reshape(dims)
            return t, Alloc(off, size, nbytes, whole.untyped_storage())
        except BaseException:
            self.release(off, size)
            raise

    def add(self, a):
        self.allocs[a.off] = a
        self._by_storage[a.storage._cdata] = a

    def pop(self, off):
        """Forget the allocation at ``off`` and give its range back."""
        a = self.allocs.pop(off)
        del self._by_storage[a.storage._cdata]
        self.release(a.off, a.size)
        return a

    def is_live(self, a):
        return self.allocs.get(a.off) is a

    def locate(self, tensor, what):
        """(allocation, heap offset of the first byte) of a view of a live allocation of this
        heap; ConfigError for anything else (wrong type or device, another heap's or a freed
        allocation, memory outside the heap, a lazy conjugate or negative view)."""
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError("%s: expected a torch.Tensor, got %s" % (what, type(tensor).__name__))
        # is_cuda / is_cpu: a tenth of tensor.device's cost (bench/cpu_put.py's hot path)
        if not (tensor.is_cuda if self.device == "cuda" else tensor.is_cpu):
            raise ConfigError("%s: tensor is on %s; this Context's heap tensors are %s tensors "
                              "(ctx.alloc)" % (what, tensor.device, self.device))
        try:
            st = tensor.untyped_storage()
        except Exception:  # noqa: BLE001 - sparse and other layouts have no plain storage
            raise ConfigError("%s: a %s tensor has no plain storage; heap tensors are dense"
                              % (what, tensor.layout)) from None
        # _cdata names the StorageImpl, which every view of the alloc'd tensor shares (torch keeps
        # one Python storage object per StorageImpl); the record holds it, so it is never reused
        a = self._by_storage.get(st._cdata)
        if a is None:
            inside = 0 <= st.data_ptr() - self.base < self.heap_bytes
            raise ConfigError("%s: the tensor is %s; allocate it with ctx.alloc()" % (
                what, "in a freed allocation of the symmetric heap" if inside else
                "outside the symmetric heap (or in another Context's heap)"))
        if tensor.is_conj() or tensor.is_neg():
            # torch's lazy views keep the original bytes plus a flag that only torch's own ops
            # apply; the NIC moves bytes, so a put sent the values unconjugated (un-negated)
            kind, fix = (("conjugate", "resolve_conj") if tensor.is_conj()
                         else ("negative", "resolve_neg"))
            raise ConfigError("%s: the tensor is a lazy %s view, whose bytes are the values before "
                              "the flag torch applies; the NIC moves the bytes. Pass a plain heap "
                              "tensor (e.g. copy t.%s() into one)" % (what, kind, fix))
        return a, a.off + tensor.storage_offset() * tensor.element_size()

    def offset_of(self, tensor, what):
        """Heap offset of a contiguous heap tensor's first byte (see :meth:`locate`)."""
        a, off = self.locate(tensor, what)
        if not tensor.is_contiguous():
            raise ConfigError("%s: tensor is not contiguous; call .contiguous() on a heap tensor "
                              "view, or copy into a symmetric tensor first" % what)
        return off

    def whole(self, tensor, what="free"):
        """The live allocation ``tensor`` is all of, or ConfigError."""
        a, off = self.locate(tensor, what)
        if off != a.off or tensor.nbytes != a.nbytes:
            raise ConfigError("%s: the tensor is %d bytes at +%d of an allocation of %d bytes; "
                              "pass the tensor ctx.alloc() returned" % (what, tensor.nbytes,
                                                                       off - a.off, a.nbytes))
        return a


class _MappedBytes:
    """``nbytes`` of host-mapped (or device) memory at ``addr`` as a CUDA array (``__cuda_array_interface__``);
    holds ``owner`` (the Context) so the heap's Python objects outlive the tensor's storage."""

    def __init__(self, addr, nbytes, owner):
        self._owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False),
                                         "strides": None, "version": 3, "stream": None}


def _cuda_view(addr, nbytes, owner):
    """A torch uint8 CUDA tensor over the heap bytes [addr, addr + nbytes) (host-mapped or
    device memory)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device="cuda")
    t = torch.as_tensor(_MappedBytes(addr, nbytes, owner), device="cuda")
    if t.data_ptr() != addr:
        raise ConfigError("alloc: torch placed the heap view at 0x%x, not at the heap address 0x%x"
                          % (t.data_ptr(), addr))
    return t
