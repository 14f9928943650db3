"""RecvPool: fresh torch tensors (like ``torch.empty``) whose bytes lie inside one byte region of
gpunet's symmetric heap, returned to the region when the last reference to their storage dies.

Why: the high-throughput dispatch allocates its receive tensors here, so peer GPUs, which map this
rank's heap, store rows straight into the tensors the caller gets, with no copy out of a staging
buffer. The bookkeeping is gpunet/device/kernels/pool_alloc.cpp (first fit, 4 KiB blocks, built once
per process with the host compiler); this file puts torch tensors on it:

- CPU (the region is a CPU tensor over the shared-memory arena): ``empty`` takes a block with
  ``gp_alloc_in`` and wraps a new numpy slice of the region; a ``weakref.finalize`` on that slice
  frees the block, and torch's storage is what holds the slice, so every view keeps the block.
- CUDA: a ``torch.cuda.MemPool`` whose allocator is pool_alloc's ``gp_torch_alloc`` /
  ``gp_torch_free`` (``CUDAPluggableAllocator``). torch's caching allocator asks it for whole segments
  and sub-allocates, caches and reuses blocks inside them in stream order, so ``record_stream`` and
  deferred frees work as for any CUDA tensor.
"""
from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from typing import Sequence

import torch

__all__ = ["RecvPool", "packed", "packed_empty"]

log = logging.getLogger("gpunet.ep")

# Block granularity of pool_alloc.cpp (kPage there): every block starts on it and is a multiple of it.
_PAGE = 4096

_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()
# The torch allocator object over gp_torch_alloc / gp_torch_free: one per process, shared by every
# RecvPool's MemPool (the region is chosen per call by gp_select, not by the allocator).
_torch_allocator = None


def _library() -> ctypes.CDLL:
    """pool_alloc.cpp built for the host (cached on disk by the loader) and bound, once per process."""
    global _lib
    if _lib is None:
        with _lib_lock:
            if _lib is None:
                from gpunet.device import loader
                lib = loader.build([loader.kernels_dir() / "pool_alloc.cpp"], arch="host")
                u64, i32 = ctypes.c_uint64, ctypes.c_int
                for name, args, res in (
                        ("gp_region_add", [u64, u64], i32),
                        ("gp_region_remove", [i32], None),
                        ("gp_region_used", [i32], u64),
                        ("gp_select", [i32], None),
                        ("gp_alloc_in", [i32, u64], u64),
                        ("gp_free_at", [u64], None),
                        ("gp_free_in", [i32, u64], None),
                        ("gp_bad_frees", [], u64)):
                    fn = getattr(lib, name)
                    fn.argtypes, fn.restype = args, res
                _lib = lib
    return _lib


def _cuda_allocator():
    """The process's ``torch._C._cuda_CUDAAllocator`` over pool_alloc's torch entry points.

    ``CUDAPluggableAllocator`` dlopens the same library file as ``_library()``, so both see one copy of
    the regions and of the thread-local selection."""
    global _torch_allocator
    lib = _library()
    with _lib_lock:
        if _torch_allocator is None:
            _torch_allocator = torch.cuda.memory.CUDAPluggableAllocator(
                lib.gpunet_path, "gp_torch_alloc", "gp_torch_free").allocator()
        return _torch_allocator


# Where each part of a packed allocation starts: a multiple of this, which is a multiple of every
# dtype's alignment and of the kernels' 16-byte vector accesses (the allocation itself starts on
# a 4 KiB page in the pool, on torch's 512-byte block boundary outside it).
_PART_ALIGN = 256


# specs (as a tuple) -> their layout (_layout): the HT dispatch asks for the same few on every call
_layouts: dict = {}
_LAYOUTS_MAX = 256


def _layout(specs) -> tuple:
    """``(parts, total)`` for ``packed``: each part None or ``(element offset, shape, strides,
    dtype)``, total the allocation's bytes. Kept per specs (a Python loop of a few microseconds a
    call otherwise); specs that do not hash (a shape given as a list) are laid out every time."""
    try:
        key = tuple(specs)
        got = _layouts.get(key)
    except TypeError:
        key, got = None, None
    if got is not None:
        return got
    parts, total = [], 0
    for sd in specs:
        if sd is None:
            parts.append(None)
            continue
        shape = (sd[0],) if isinstance(sd[0], int) else tuple(sd[0])
        if any(d < 0 for d in shape):
            raise ValueError("packed: negative dimension in shape %s" % (shape,))
        strides, n = [], 1                      # contiguous, innermost last
        for d in reversed(shape):
            strides.append(n)
            n *= d
        parts.append((total // sd[1].itemsize, shape, tuple(strides[::-1]), sd[1]))
        total += -(-n * sd[1].itemsize // _PART_ALIGN) * _PART_ALIGN
    got = (tuple(parts), total)
    if key is not None:
        if len(_layouts) >= _LAYOUTS_MAX:
            _layouts.clear()
        _layouts[key] = got
    return got


def packed(specs: Sequence[tuple | None], alloc) -> list | None:
    """Uninitialised tensors of ``specs`` (``(shape, dtype)`` or None: None) as views of one
    ``torch.uint8`` allocation ``alloc(nbytes)``, each part starting on a _PART_ALIGN boundary of
    it; None when ``alloc`` returns None (no room). The views share one storage: it lives while
    any of them does.

    Each part is one ``as_strided`` of the allocation viewed once per dtype (a part starts on a
    multiple of every itemsize): a third less host time than slicing and viewing each part (the
    HT dispatch calls this on every call); the layout is computed once per specs (_layout)."""
    parts, total = _layout(specs)
    whole = alloc(total)
    if whole is None:
        return None
    typed = {}                                  # dtype -> (whole viewed as it, its storage offset)
    out = []
    for p in parts:
        if p is None:
            out.append(None)
            continue
        wo = typed.get(p[3])
        if wo is None:
            w = whole.view(p[3])
            wo = typed[p[3]] = (w, w.storage_offset())   # (a call that costs as much as the view)
        out.append(wo[0].as_strided(p[1], p[2], wo[1] + p[0]))
    return out


def packed_empty(specs: Sequence[tuple | None], device) -> list:
    """``packed`` in ordinary torch memory on ``device`` (torch.empty's current allocator)."""
    return packed(specs, lambda n: torch.empty(n, dtype=torch.uint8, device=device))


class RecvPool:
    """Hands out fresh tensors inside one region; see the module docstring for how.

    Args:
        region: contiguous 1-D ``torch.uint8`` tensor, CPU or CUDA, inside the symmetric heap. Only its
            page-aligned part (4 KiB) is used. The pool never writes it; it must outlive every tensor
            the pool hands out (they are invalid once the heap is freed).

    Raises:
        ValueError: region is not a contiguous 1-D uint8 tensor, holds no whole aligned 4 KiB page,
            overlaps a region already registered in this process, or 64 regions are registered.

    ``close()`` is idempotent; the pool is a context manager.
    """

    def __init__(self, region: torch.Tensor):
        if region.dtype != torch.uint8 or region.dim() != 1 or not region.is_contiguous():
            raise ValueError("RecvPool: region must be a contiguous 1-D torch.uint8 tensor, got %s %s"
                             % (region.dtype, tuple(region.shape)))
        self._lib = lib = _library()
        self._region = region
        self._base = region.data_ptr()
        self._end = self._base + region.numel()
        self._device = region.device
        self._cuda = region.device.type == "cuda"
        rid = lib.gp_region_add(self._base, region.numel())
        if rid < 0:
            raise ValueError("RecvPool: gp_region_add(0x%x, %d) refused the region: it holds no whole "
                             "aligned 4 KiB page, overlaps a registered region, or 64 regions are "
                             "registered" % (self._base, region.numel()))
        self._id = rid
        # Removes the region if the pool is dropped without close(), so its slot is not leaked.
        self._fin = weakref.finalize(self, lib.gp_region_remove, rid)
        self._fin.atexit = False
        self._select = lib.gp_select
        self._alloc_in = lib.gp_alloc_in
        # CUDA: set when the pool ran out of room (empty_many); empty then returns None at once
        self.exhausted = False
        if self._cuda:
            self._np = None
            self._dev_index = region.device.index if region.device.index is not None \
                else torch.cuda.current_device()
            # MemPool binds the current device when made (c10 MemPool's constructor).
            with torch.cuda.device(self._dev_index):
                self._pool = torch.cuda.MemPool(_cuda_allocator())
        else:
            # One numpy view of the whole region; empty() slices it (each slice a new ndarray).
            self._np = region.numpy()
            self._pool = None

    # -- allocation ---------------------------------------------------------------------------

    def empty(self, shape: Sequence[int] | int, dtype: torch.dtype) -> torch.Tensor | None:
        """A fresh, uninitialised tensor of ``shape`` and ``dtype`` (any torch dtype, float8 and
        bfloat16 included) on the region's device whose bytes lie inside the region, or ``None``
        when it does not fit, the pool is closed, or (CUDA) the current stream is being captured
        into a graph; the caller then uses ordinary memory. Never raises for lack of room.

        The caller owns the tensor like one from ``torch.empty``; its bytes return to the region when
        the last tensor sharing its storage (views included) dies. A tensor with 0 elements holds no
        bytes: it is an ordinary empty tensor (``contains`` is True, ``offset`` 0 for it).

        CPU: each tensor takes its own block, its byte size rounded up to 4 KiB. CUDA: torch's caching
        allocator carves tensors out of segments it takes from the region (2 MiB for requests up to
        1 MiB, 20 MiB up to 10 MiB, else the size rounded up to 2 MiB) and keeps freed blocks cached
        in the pool for reuse; a request the region cannot serve makes torch release its cached
        blocks (a device synchronisation) before ``None`` comes back.
        """
        got = self.empty_many([(shape, dtype)])
        return None if got is None else got[0]

    def empty_many(self, specs: Sequence[tuple | None]) -> list | None:
        """``empty`` for several tensors at once, all or none: ``specs`` a list of ``(shape,
        dtype)`` or None; returns the tensors (None where the spec is None), or None when they
        do not fit. They are views of ONE allocation (``packed``: each part on a 256-byte
        boundary), so their bytes go back when the last of them dies: one allocation instead of
        one per tensor (the HT dispatch makes five a call, and its host time counts)."""
        if self._id < 0 or self.exhausted:
            return None
        if self._cuda:
            if torch.cuda.is_current_stream_capturing():
                return None
            self._select(self._id)
            try:
                with torch.cuda.use_mem_pool(self._pool, self._dev_index):
                    return packed_empty(specs, self._device)
            except torch.OutOfMemoryError:
                # each such try costs a device synchronisation (torch releases its other cached
                # blocks before it gives up) and torch never gives this pool's cached blocks
                # back while the pool lives: once out of room, it stays so
                self.exhausted = True
                return None
            finally:
                self._select(-1)
        return packed(specs, self._empty_host)

    def _empty_host(self, nbytes):
        """A uint8 tensor of ``nbytes`` over a block of the region (a numpy slice of it whose
        finaliser frees the block), an ordinary empty one for 0 bytes, or None: no room."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        addr = self._alloc_in(self._id, nbytes)
        if not addr:
            return None
        off = addr - self._base
        arr = self._np[off:off + nbytes]
        weakref.finalize(arr, self._lib.gp_free_in, self._id, addr).atexit = False
        return torch.from_numpy(arr)

    # -- queries --------------------------------------------------------------------------------

    def contains(self, t: torch.Tensor) -> bool:
        """Whether every byte of ``t`` (from ``t.data_ptr()``, ``t.numel() * t.element_size()`` long)
        lies inside the region and ``t`` is on the region's device. True for 0-element tensors."""
        if t.numel() == 0:
            return True
        p = t.data_ptr()
        return (t.device == self._device and self._base <= p
                and p + t.numel() * t.element_size() <= self._end)

    def offset(self, t: torch.Tensor) -> int:
        """Byte offset of ``t.data_ptr()`` from the region's start (what a peer adds to its mapping
        of this region); 0 for a 0-element tensor, which holds no bytes.

        Raises:
            ValueError: ``t`` is not inside the region (see ``contains``).
        """
        if not self.contains(t):
            raise ValueError("RecvPool.offset: tensor at 0x%x (%d bytes, %s) is not inside the region "
                             "[0x%x, 0x%x) on %s" % (t.data_ptr(), t.numel() * t.element_size(),
                                                     t.device, self._base, self._end, self._device))
        return 0 if t.numel() == 0 else t.data_ptr() - self._base

    def capacity_bytes(self) -> int:
        """Bytes the pool can hand out: the region's whole, 4 KiB-aligned pages (an upper bound on
        ``used_bytes``)."""
        lo = -(-self._base // _PAGE) * _PAGE
        return max(0, self._end // _PAGE * _PAGE - lo)

    def used_bytes(self) -> int:
        """Bytes of the region currently handed out: on CPU the live tensors' sizes rounded up to
        4 KiB; on CUDA the segments torch's caching allocator holds (live tensors and cached free
        blocks). 0 after close()."""
        return self._lib.gp_region_used(self._id) if self._id >= 0 else 0

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Give the region up; afterwards ``empty`` returns None. Idempotent.

        On CUDA the MemPool is dropped and torch's cache emptied first, so segments with no live tensor
        go back. Bytes still in use (live tensors) make it log a warning: those tensors stay usable
        only while the heap under the region stays mapped, and are invalid once it is freed."""
        if self._id < 0:
            return
        if self._cuda:
            self._pool = None
            if self._lib.gp_region_used(self._id):
                torch.cuda.empty_cache()
        used = self._lib.gp_region_used(self._id)
        if used:
            log.warning("RecvPool.close: %d bytes of region [0x%x, 0x%x) are still held by live tensors; "
                        "they are invalid once the symmetric heap is freed", used, self._base, self._end)
        self._id = -1
        self._fin()
        self._np = None

    def __enter__(self) -> "RecvPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._id < 0 else "id=%d used=%d" % (self._id, self.used_bytes())
        return "RecvPool([0x%x, 0x%x) on %s, %s)" % (self._base, self._end, self._device, state)
