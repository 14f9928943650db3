"""Raw-address memory access for numba nopython code: views, ordered loads/stores, atomics, memmove.

The soft NIC and the proxy work on virtual addresses, as a NIC does with DMA addresses, because
the rings and buffers they touch are written by other threads (the HOST arm's device code), other
processes (shared memory) or the GPU (host-mapped memory). These helpers are the only place that
turns an integer address into memory; everything else goes through them.

Ordering: ``load_acquire_*`` / ``store_release_*`` are LLVM atomic accesses with acquire / release
ordering, so numba can neither cache a polled word in a register nor move a payload store after
the store that publishes it. The atomics are sequentially consistent hardware read-modify-writes,
atomic with respect to every other thread and process mapping the same memory.

``address_of`` and ``aligned_zeros`` are the ground floor's (gpunet/_floor.py), named here too
because the numba code's callers take them with the intrinsics.
"""
import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.core import cgutils
from numba.core.registry import CPUDispatcher
from numba.extending import intrinsic

from gpunet._floor import address_of, aligned_zeros  # noqa: F401 - the floor's, re-exported here
from gpunet.errors import ConfigError

# --- Python entries into numba code -------------------------------------------------------------
# Rule: every njit function that Python code calls with a wire field (an address, a key, a 64-bit
# value, a command word) is declared with ``wire_njit``, and from Python every int argument enters
# it as an int64 holding the field's bits: ints in [2**63, 2**64) become the int64 with the same 64
# bits, ints outside [-2**63, 2**64) raise ConfigError. Inside, fields are bit patterns
# (``np.uint64(v)`` where the top bit matters); a negative int is its two's complement.
# Why: numba types a Python int as int64 when it fits and as uint64 when it does not, and unboxes
# it into whichever compiled specialization accepts that type: after a first call with small ints
# compiled the int64 one, a later 2**63 is forced into it and fails with "OverflowError: int too
# big to convert", while a process whose first call passed 2**63 compiled a uint64 one instead —
# the result depended on which call came first (and on nothing numba's disk cache records).
# With every int entering as int64 there is one integer specialization whatever the order.
# Numpy integer scalars pass unchanged (their type is explicit, so the choice is deterministic).
# Calls from nopython code do not pass through here. tests/test_entry_ranges.py guards the rule:
# every entry, boundary values in both orders, each order in a fresh process and numba cache.
_I64_MIN, _I64_END, _U64_END = -(1 << 63), 1 << 63, 1 << 64


def _as_i64_bits(a, fn, i):
    if type(a) is not int or _I64_MIN <= a < _I64_END:
        return a
    if _I64_END <= a < _U64_END:
        return a - _U64_END
    raise ConfigError("%s: argument %s = %d does not fit a 64-bit field (allowed: -2**63 .. "
                      "2**64 - 1)" % (fn, i, a))


class _WireDispatcher(CPUDispatcher):
    """A numba dispatcher whose Python calls pass ints as 64-bit patterns (the rule above)."""

    def __call__(self, *args, **kws):
        for a in args:
            if type(a) is int and not _I64_MIN <= a < _I64_END:
                name = self.py_func.__name__
                args = tuple(_as_i64_bits(x, name, i) for i, x in enumerate(args))
                break
        if kws:
            kws = {k: _as_i64_bits(v, self.py_func.__name__, k) for k, v in kws.items()}
        return super().__call__(*args, **kws)


def wire_njit(fn=None, *, cache=False, **options):
    """``numba.njit`` for functions Python calls with wire fields: ``@wire_njit(cache=True, ...)``
    takes njit's options; the function is callable from nopython code exactly like an njit one."""
    def wrap(f):
        targetoptions = dict(options, nopython=True)
        disp = _WireDispatcher(py_func=f, locals={}, targetoptions=targetoptions)
        if cache:
            disp.enable_caching()
        return disp
    return wrap if fn is None else wrap(fn)


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


def _make_ptr(nbty):
    @intrinsic
    def _ptr(typingctx, addr):
        if not isinstance(addr, types.Integer):
            return None
        sig = types.CPointer(nbty)(addr)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
        return sig, codegen
    return _ptr


# Typed pointers at an address: ``p = i64_ptr(addr); p[i]; p[i] = v`` are plain loads and stores
# (no bounds, no negative-index wrap). Unlike an array view (u8_at / u64_at), a pointer carries no
# reference count, so passing one to a helper costs nothing: numba increments and decrements the
# count of every array passed to a helper, inlined or not, each an out-of-line call (the proxy's
# drain loop, gpunet/host/proxy.py, keeps its per-command path on pointers for that reason).
i64_ptr = _make_ptr(types.int64)
i32_ptr = _make_ptr(types.int32)
u8_ptr = _make_ptr(types.uint8)


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


@wire_njit(inline="always")
def u8_at(addr, n):
    """A uint8 array view of ``n`` bytes at virtual address ``addr`` (no bounds beyond n)."""
    return carray(_voidptr(addr), (n,), np.uint8)


@wire_njit(inline="always")
def u64_at(addr, n):
    """A uint64 array view of ``n`` words at ``addr`` (8-byte aligned)."""
    return carray(_voidptr(addr), (n,), np.uint64)


@wire_njit(inline="always")
def memmove(dst, src, n):
    """libc memmove between two virtual addresses (full memcpy speed; overlap allowed)."""
    if n > 0:
        c_memmove(dst, src, n)


@wire_njit(inline="always")
def bswap64(v):
    v = np.uint64(v)
    r = np.uint64(0)
    for i in range(8):
        r = (r << np.uint64(8)) | ((v >> np.uint64(8 * i)) & np.uint64(0xFF))
    return r


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


@wire_njit(inline="always")
def i64_at(addr, n):
    return carray(_i64ptr(addr), (n,), np.int64)


@intrinsic
def _i64ptr(typingctx, addr):
    sig = types.CPointer(types.int64)(addr)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(64).as_pointer())
    return sig, codegen


# --- the idle policy of the CPU engines (soft NIC engine, proxy threads) -------------------------
# A polling engine thread that found no work on a pass, ``idle`` after its last work: a pure spin
# while idle < spin (an option, for machines with a core to spare per engine), then sched_yield()
# polling for IDLE_YIELD_NS more, then sleeps of idle / 10, at least IDLE_SLEEP_MIN_US and at most
# IDLE_SLEEP_MAX_US (so a doorbell after an idle spell waits ~10% of that spell, 200 us at most).
# Why: a user who is communicating rings a doorbell every few tens of us (a host-wrapper call
# costs ~10 us of Python, a CPU ping-pong hop ~50 us), and inside the yield window the engine sees
# it within one pass (a 20..200 us sleep back-off reached after 32 yields was most of a CPU put's
# ~120 us: bench/cpu_put.py). A yielding thread gives its core to any runnable thread, but it is
# always runnable and so still takes a fair share of a busy core: the window is short (a 200 us
# window made tests/test_api.py 8-20% slower on the 2-core CI machine), and the short sleeps after
# it cost one wake-up per 20+ us. Engine threads run with a 1 us timer slack
# (engine_thread_start), so a 20 us sleep ends after ~20 us, not after Linux's default 50 us slack.
# tests/test_proxy.py::test_idle_engines_answer_a_doorbell_in_time guards the policy.
# An engine whose waiters run its passes themselves (gpunet/host/progress.py: a Context on the CPU, whose
# ops library runs the hooks) serves on its own thread only work nobody waits for, so it may sleep
# up to HOOKED_IDLE_SLEEP_MAX_US (the cap is idle_pause's ``max_us``): an idle Context's engine
# thread then wakes ~1000 times a second instead of ~5000, each wake-up ~25 us of CPU on the CI VM
# (10% of a core per engine thread, measured), and wakes the callers' cores less often.
# tests/test_cpu_put.py::test_an_idle_cpu_contexts_nic_engine_wakes_at_most_every_ms.
IDLE_YIELD_NS = 50_000
IDLE_SLEEP_MIN_US = 20
IDLE_SLEEP_MAX_US = 200
HOOKED_IDLE_SLEEP_MAX_US = 1000


@wire_njit(cache=True, nogil=True)
def idle_pause(idle_ns, spin_ns, max_us=IDLE_SLEEP_MAX_US):
    """One idle pass of an engine thread, ``idle_ns`` after its last work (the policy above;
    ``max_us``: the sleep cap)."""
    if idle_ns < spin_ns:
        return
    if idle_ns < spin_ns + IDLE_YIELD_NS:
        c_sched_yield()
        return
    c_usleep(min(max((idle_ns - spin_ns) // 10_000, IDLE_SLEEP_MIN_US), max_us))


ENGINE_TIMER_SLACK_NS = 1000


def engine_thread_start(cpus=None):
    """What an engine thread (soft NIC, proxy) does first, before it enters numba: a timer slack
    of ENGINE_TIMER_SLACK_NS for its own sleeps (prctl PR_SET_TIMERSLACK, per thread; see the
    idle policy), then ``pin_current_thread(cpus)``, whose record it returns."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(29, ENGINE_TIMER_SLACK_NS, 0, 0, 0)     # PR_SET_TIMERSLACK
    except (OSError, AttributeError):   # not Linux: the default slack only lengthens idle sleeps
        pass
    return pin_current_thread(cpus)


def pin_current_thread(cpus=None):
    """Pin the calling thread to ``cpus`` (CPU numbers; None leaves its affinity as it is) and
    return ``{"tid": its Linux thread id, "cpus": the CPUs it may now run on}``. Linux applies
    sched_setaffinity(0, ...) to the calling thread only, so each engine thread (soft NIC, proxy)
    calls this itself before it enters numba. Pinning the engine, the proxy and the thread that
    waits on them to distinct cores removes the run-to-run variation of sharing a core
    (bench/proxy.py places them and records this)."""
    import os
    import threading

    if cpus is not None:
        want = {int(c) for c in cpus}
        try:
            os.sched_setaffinity(0, want)
        except (OSError, ValueError) as e:
            raise ConfigError("cannot pin a thread to CPUs %s: %s (allowed here: %s)"
                              % (sorted(want), e, sorted(os.sched_getaffinity(0)))) from None
    return {"tid": threading.get_native_id(), "cpus": sorted(os.sched_getaffinity(0))}


# --- a copy engine in native code (the CPU platform's; gpunet/host/platform.py Platform.copy_engine) ----
_memmove_engine = None


def memmove_copy_engine():
    """(copy, sync) addresses of two native functions with the copy engine's C signatures
    (gpunet/host/platform.py CopyEngine): ``int copy(void* dst, const void* src, size_t n, int kind,
    void* stream)`` does memmove(dst, src, n) and returns 0, ``int sync(void* stream)`` returns
    0. Numba cfuncs, compiled once per process: the soft NIC's engine calls them without the GIL
    (a ctypes callback would take it on every copy)."""
    global _memmove_engine
    if _memmove_engine is None:
        from numba import cfunc

        @cfunc(types.int32(types.voidptr, types.voidptr, types.uint64, types.int32, types.voidptr),
               nopython=True, cache=True)
        def _copy(dst, src, n, kind, stream):
            c_memmove(_int_of(dst), _int_of(src), n)
            return 0

        @cfunc(types.int32(types.voidptr), nopython=True, cache=True)
        def _sync(stream):
            return 0

        _memmove_engine = (_copy, _sync)            # the cfuncs keep their code alive
    return _memmove_engine[0].address, _memmove_engine[1].address


@intrinsic
def _int_of(typingctx, p):
    """A void* as an int64 address (c_memmove takes integer addresses)."""
    sig = types.int64(p)

    def codegen(context, builder, signature, args):
        return builder.ptrtoint(args[0], ir.IntType(64))
    return sig, codegen
