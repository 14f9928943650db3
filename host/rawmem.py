"""Raw-address memory access for numba nopython code: views, ordered loads/stores, atomics, memmove.

The soft NIC and the proxy work on virtual addresses, as a NIC does with DMA addresses, because
the rings and buffers they touch are written by other threads (the HOST arm's device code), other
processes (shared memory) or the GPU (host-mapped memory). These helpers are the only place that
turns an integer address into memory; everything else goes through them.

Ordering: ``load_acquire_*`` / ``store_release_*`` are LLVM atomic accesses with acquire / release
ordering, so numba can neither cache a polled word in a register nor move a payload store after
the store that publishes it. The atomics are sequentially consistent hardware read-modify-writes,
atomic with respect to every other thread and process mapping the same memory.
"""
import ctypes

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_libc = ctypes.CDLL(None)
_memmove = _libc.memmove
_memmove.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memmove.restype = ctypes.c_void_p


@intrinsic
def _voidptr(typingctx, addr):
    """Reinterpret an integer address as a void pointer."""
    if not isinstance(addr, types.Integer):
        return None
    sig = types.voidptr(addr)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return sig, codegen


def _make_load(bits, ordering):
    ity = ir.IntType(bits)
    nbty = types.uint32 if bits == 32 else types.uint64

    @intrinsic
    def _load(typingctx, addr):
        sig = nbty(addr)

        def codegen(context, builder, signature, args):
            ptr = builder.inttoptr(args[0], ity.as_pointer())
            return builder.load_atomic(ptr, ordering, bits // 8)
        return sig, codegen
    return _load


def _make_store(bits, ordering):
    ity = ir.IntType(bits)

    @intrinsic
    def _store(typingctx, addr, val):
        sig = types.void(addr, val)

        def codegen(context, builder, signature, args):
            ptr = builder.inttoptr(args[0], ity.as_pointer())
            v = context.cast(builder, args[1], signature.args[1],
                             types.uint32 if bits == 32 else types.uint64)
            builder.store_atomic(v, ptr, ordering, bits // 8)
            return context.get_dummy_value()
        return sig, codegen
    return _store


load_acquire_u32 = _make_load(32, "acquire")
load_acquire_u64 = _make_load(64, "acquire")
store_release_u32 = _make_store(32, "release")
store_release_u64 = _make_store(64, "release")


@intrinsic
def atomic_fetch_add_u64(typingctx, addr, val):
    """Atomically add ``val`` to the uint64 at ``addr``; returns the old value."""
    sig = types.uint64(addr, val)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        v = context.cast(builder, args[1], signature.args[1], types.uint64)
        return builder.atomic_rmw("add", ptr, v, "seq_cst")
    return sig, codegen


@intrinsic
def atomic_cas_u64(typingctx, addr, expected, desired):
    """Compare-and-swap on the uint64 at ``addr``; returns the old value (swapped iff == expected)."""
    sig = types.uint64(addr, expected, desired)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        e = context.cast(builder, args[1], signature.args[1], types.uint64)
        d = context.cast(builder, args[2], signature.args[2], types.uint64)
        pair = builder.cmpxchg(ptr, e, d, "seq_cst", "seq_cst")
        return builder.extract_value(pair, 0)
    return sig, codegen


@intrinsic
def fence_seq_cst(typingctx):
    """A full memory fence."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return sig, codegen


@njit(inline="always")
def u8_at(addr, n):
    """A uint8 array view of ``n`` bytes at virtual address ``addr`` (no bounds beyond n)."""
    return carray(_voidptr(addr), (n,), np.uint8)


@njit(inline="always")
def u64_at(addr, n):
    """A uint64 array view of ``n`` words at ``addr`` (8-byte aligned)."""
    return carray(_voidptr(addr), (n,), np.uint64)


@njit(inline="always")
def memmove(dst, src, n):
    """libc memmove between two virtual addresses (full memcpy speed; overlap allowed)."""
    if n > 0:
        _memmove(_voidptr(dst), _voidptr(src), n)


@njit(inline="always")
def bswap64(v):
    v = np.uint64(v)
    r = np.uint64(0)
    for i in range(8):
        r = (r << np.uint64(8)) | ((v >> np.uint64(8 * i)) & np.uint64(0xFF))
    return r


def address_of(arr):
    """The virtual address of a numpy array's (or a buffer's) first byte."""
    return int(np.asarray(arr).ctypes.data)
