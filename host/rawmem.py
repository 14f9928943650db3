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
import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

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
        c_memmove(dst, src, n)


@njit(inline="always")
def bswap64(v):
    v = np.uint64(v)
    r = np.uint64(0)
    for i in range(8):
        r = (r << np.uint64(8)) | ((v >> np.uint64(8 * i)) & np.uint64(0xFF))
    return r


def aligned_zeros(nbytes, align=64):
    """A zeroed uint8 array of ``nbytes`` whose first byte is ``align``-aligned (the view keeps
    its over-allocated base alive)."""
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes]


def address_of(arr):
    """The virtual address of a numpy array's (or a buffer's) first byte."""
    return int(np.asarray(arr).ctypes.data)


# --- libc calls as LLVM declarations -----------------------------------------------------------
# Declared in the generated code rather than called through ctypes function pointers, so that
# the njit functions calling them stay cacheable on disk and never take the GIL.


def _libc_fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


@intrinsic
def c_memmove(typingctx, dst, src, n):
    """memmove(dst, src, n) on integer addresses."""
    sig = types.void(dst, src, n)

    def codegen(context, builder, signature, args):
        vp = cgutils.voidptr_t
        fn = _libc_fn(builder, "memmove", vp, [vp, vp, ir.IntType(64)])
        builder.call(fn, [builder.inttoptr(args[0], vp), builder.inttoptr(args[1], vp),
                          context.cast(builder, args[2], signature.args[2], types.int64)])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def clock_ns(typingctx):
    """CLOCK_MONOTONIC in nanoseconds (system-wide: comparable across processes)."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        fn = _libc_fn(builder, "clock_gettime", i32, [i32, i64.as_pointer()])
        ts = cgutils.alloca_once(builder, i64, size=2)
        builder.call(fn, [ir.Constant(i32, 1), ts])      # CLOCK_MONOTONIC = 1
        sec = builder.load(ts)
        nsec = builder.load(builder.gep(ts, [ir.Constant(i32, 1)]))
        return builder.add(builder.mul(sec, ir.Constant(i64, 1000000000)), nsec)
    return sig, codegen


@intrinsic
def c_usleep(typingctx, us):
    sig = types.void(us)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        fn = _libc_fn(builder, "usleep", i32, [i32])
        builder.call(fn, [context.cast(builder, args[0], signature.args[0], types.int32)])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def c_sched_yield(typingctx):
    sig = types.void()

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        builder.call(_libc_fn(builder, "sched_yield", i32, []), [])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def c_kill0(typingctx, pid):
    """kill(pid, 0): 0 while the process exists."""
    sig = types.int32(pid)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        fn = _libc_fn(builder, "kill", i32, [i32, i32])
        return builder.call(fn, [context.cast(builder, args[0], signature.args[0], types.int32),
                                 ir.Constant(i32, 0)])
    return sig, codegen


@njit(inline="always")
def i64_at(addr, n):
    return carray(_i64ptr(addr), (n,), np.int64)


@intrinsic
def _i64ptr(typingctx, addr):
    sig = types.CPointer(types.int64)(addr)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(64).as_pointer())
    return sig, codegen
