"""The software mlx5 NIC: RC queue pairs, memory protection and the coherence model, on the CPU.

One ``SoftNic`` is one NIC. It owns an *arena*: one sparse shared-memory file under /dev/shm
(``gpunet-<pid>-<tag>``) holding a header, the MR / QP / CQ tables and a bump-allocated heap from
which rings, CQs, doorbell records, doorbell words and user buffers come. The tables are int64
words, so the engine (numba, nopython, nogil) reads them directly, and a peer process maps the
same file to act as the responder side of an RC connection.

The engine is one OS thread per NIC running ``engine_run``: an ``@njit(nogil=True)`` loop that
never takes the GIL. It notices changed doorbell words, latches the send DBR, executes WQEs in
order per QP straight from the ring, and writes CQEs. Time, sleeping and memmove come from libc
symbols declared in LLVM IR (below), not ctypes, so that the engine is cacheable (``cache=True``)
and a Python thread that holds the GIL (a compile, a long test) cannot stall a NIC's heartbeat.

Semantics chosen where the issue leaves a choice (docs/INTERFACES.md repeats them):
- Execution is synchronous and in order per QP. A WQE does not start before the previous one has
  completed, so FENCE (and INITIATOR_SMALL_FENCE) hold by construction, also when a READ or an
  atomic is stalled on a dead peer: the whole QP waits behind it until it completes with 0x15.
- Atomics follow the NIC's ``atomic_endianness`` (the mlx5 HCA's atomic_req_8B_endianness_mode):
  "host" (the default) treats the remote 8-byte word as a native number and writes the old value
  into the local data segment in native order; "big" treats the word as a big-endian number and
  writes the old value as the 8 big-endian bytes the IB wire carries. The word is read in the
  order of the NIC that owns it (the responder's memory), the old value written in the
  requester's. Both are done with hardware CAS on the target word, so they are atomic with
  respect to every other NIC atomic in any process (and to a p2p peer's device CAS on the word).
  tests/test_signal_endian.py.
- CQ overrun (owner-bit mode, the NIC would write more than ``cqe_cnt`` CQEs ahead of the
  consumer's DBR): the CQ enters error for good (``nic.cq_state(cq) == "ERR"``, no further CQE is
  ever written into it), the CQE that did not fit is dropped, and the QP that produced it moves to
  ERR; every other QP that later tries to complete into that CQ moves to ERR too. A WRITE_WITH_IMM
  whose responder CQE overruns moves the *responder* QP to ERR; the requester still completes.
- A data segment's byte_count of 0 moves 0 bytes (real mlx5 reads it as 2 GiB).
- A WQE whose ds runs past the posted DBR fails with SYNDROME_LOCAL_QP_OP_ERR and swallows every
  WQEBB up to the DBR (no way to find the next WQE boundary inside it).
- A DBR that claims more outstanding WQEBBs than the ring holds (the producer index went back
  behind the consumer index, or ran a lap ahead: a producer bug) moves the QP to ERR with one
  SYNDROME_LOCAL_QP_OP_ERR CQE naming the WQE at the consumer index, and is dropped (hardware
  would run the ring's stale WQEs; the model makes the bug loud instead).
- A peer is dead when its header's down flag is set (``mark_down()``, ``close()``), its heartbeat
  is older than ``retry_timeout_s``, or (cross-process, heartbeat older than PID_CHECK_NS) its pid
  no longer exists. A marked-down NIC's own engine stops executing too.
- SEND / SEND_IMM (no receive queues are modelled), masked atomics and unknown opcodes complete
  with SYNDROME_LOCAL_QP_OP_ERR.
- Coherence violations in strict mode are recorded in the header of the NIC that *owns* the
  memory (the one whose ``check()`` raises), first one wins.
"""
import atexit
import fcntl
import itertools
import os
import mmap
import threading
import time
import weakref

import numpy as np
from llvmlite import ir
from numba import cfunc, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from gpunet import mlx5
from gpunet._floor import pid_alive
from gpunet.device import abi
from gpunet.errors import ClosedError, ConfigError, GpunetError
from gpunet.host import progress
from gpunet.host.nic import Access, Nic, mr_region
from gpunet.resource import Resource
from gpunet.host.rawmem import (IDLE_SLEEP_MAX_US, address_of, atomic_cas_u64,
                                atomic_fetch_add_u64, bswap64, c_kill0,
                                c_memmove, c_sched_yield, clock_ns, i64_at, idle_pause,
                                engine_thread_start, load_acquire_u32, load_acquire_u64,
                                store_release_u32, store_release_u64, u8_at)

# --- arena layout (int64 word indices unless said otherwise) -------------------------------------
ARENA_MAGIC = 0x676E65745F534E31     # "gnet_SN1"
HEADER_BYTES = 4096
H_MAGIC, H_PID, H_HEARTBEAT, H_DOWN, H_PROFILE, H_STRICT, H_HEAP_TOP, H_SIZE = range(8)
H_STOP, H_NQP, H_NCQ, H_NMR, H_RETRY_NS, H_WQES, H_ITERS, H_SPIN_NS = range(8, 16)
H_VIO_CLAIM, H_VIO_VALID, H_VIO_QPN, H_VIO_OPCODE, H_VIO_KEY, H_VIO_ADDR, H_VIO_LEN, \
    H_VIO_WRITE, H_VIO_PID = range(16, 25)
H_ATOMIC_BE = 25                     # 1: atomics big-endian (atomic_endianness "big"), 0: native
# The copy engine (attach_copy_engine): how this NIC's engine reaches device memory.
H_DMA_COPY, H_DMA_SYNC, H_DMA_KIND, H_DMA_STREAM, H_DMA_SETDEV, H_DMA_DEVICE, H_DMA_ERR, \
    H_DMA_LOCK, H_DMA_COPIES = range(26, 35)
# The executor lock: whoever executes WQEs (the engine thread, or a waiting caller through the
# progress hook, gpunet/host/progress.py) holds it for one engine_step pass, so one thread at a
# time runs the engine's tables, scratch and QPs. 0 free, 1 held; only ever try-locked.
H_EXEC = 35
H_SLEEP_MAX_US = 36                  # the engine thread's idle sleep cap (set_idle_sleep_max)
# Copy-engine calls that took longer than DMA_STALL_NS (one copy: set-device, copy, sync), and
# the longest: on CUDA such a copy waited for another CUDA call of this process (timeout_hint)
H_DMA_STALLS, H_DMA_STALL_MAX_NS = 37, 38
DEVMAP_BASE = 160                    # words: per peer slot (addr, nbytes, mapped) of its device
DEVMAP_WORDS = 3                     # memory as reachable in this process (add_peer_memory)
H_NAME_BYTE = 1024                   # arena name, NUL-terminated, 256 bytes at most

MAX_MR = 4096                        # index 0 unused so that no key is 0
MR_WORDS = 16
M_KEY, M_PD, M_ADDR, M_LEN, M_ACCESS, M_KIND, M_LIVE_OFF, M_HBM_OFF, M_FETCH_OFF, M_VARIANT, \
    M_DMA, M_BUSY = range(12)        # M_DMA: device memory, moved only through the copy engine;
# M_BUSY: executors moving bytes of the region now, as the responder (dereg_mr waits for 0)

MAX_QP = 1024                        # qpn = table index; 0 unused
QP_WORDS = 32
Q_STATE, Q_PD, Q_SQ_OFF, Q_SQ_WQEBBS, Q_DBREC_OFF, Q_DB_OFF, Q_SCQ, Q_RCQ, Q_MAX_INLINE, \
    Q_LAST_DB, Q_SQ_CI, Q_TARGET, Q_PEER_SLOT, Q_PEER_QPN, Q_DEAD_SINCE, Q_RQ_COUNTER, \
    Q_NDONE, Q_ERR_SYND = range(18)

MAX_CQ = 1024
CQ_WORDS = 16
C_VALID, C_BUF_OFF, C_CNT, C_DBREC_OFF, C_COLLAPSED, C_PI, C_LOCK, C_STATE = range(8)

MR_BASE = HEADER_BYTES // 8
QP_BASE = MR_BASE + MAX_MR * MR_WORDS
CQ_BASE = QP_BASE + MAX_QP * QP_WORDS
TABLE_WORDS = CQ_BASE + MAX_CQ * CQ_WORDS
HEAP_START = (TABLE_WORDS * 8 + 4095) & ~4095

QPS_RESET, QPS_INIT, QPS_RTS, QPS_ERR = 0, 1, 3, 4
_QP_STATE_NAMES = {QPS_RESET: "RESET", QPS_INIT: "INIT", QPS_RTS: "RTS", QPS_ERR: "ERR"}

KIND_HOST, KIND_FINEGRAINED, KIND_DEVICE = 0, 1, 2
_KINDS = {"host": KIND_HOST, "finegrained": KIND_FINEGRAINED, "device": KIND_DEVICE}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
PROFILES = {"nvidia": 0, "c500": 1}
LINE_BYTES = 128                     # L2 line of the c500 coherence model

MAX_PEERS = 64                       # peer arena slots per NIC; slot 0 is the NIC's own arena
MAX_SQ_WQEBBS = 32768                # 16-bit WQE counters: the ring must be < 65536 WQEBBs
MIN_SQ_WQEBBS = 8
MAX_INLINE_LIMIT = mlx5.MAX_DS * mlx5.DS_UNIT - 32 - mlx5.INLINE_HDR_SIZE   # 972 bytes

ENGINE_BUDGET = 4096                 # WQEs per QP per engine pass: fairness between QPs
MAX_SLEEP_US = IDLE_SLEEP_MAX_US     # idle back-off cap (rawmem's idle policy): bounds the
                                     # doorbell-to-execution latency of an idle engine
PID_CHECK_NS = 5_000_000             # heartbeat age (> the idle sleep cap, 0.2 or 1 ms) after
                                     # which a cross-process peer's pid is checked: kill(pid, 0)
# The engine stores its heartbeat at most every HEARTBEAT_NS, not on every pass: a peer engine
# reads this header line for every WQE it executes towards this NIC (_peer_dead), and a line
# rewritten on every pass (a spinning engine: every ~100 ns) makes each of those reads a cache-line
# transfer from this engine's core, on the proxy round trip's critical path (bench/proxy.py). Far
# below what the heartbeat is compared with (PID_CHECK_NS, retry_timeout_s).
HEARTBEAT_NS = 100_000
CQ_LOCK_SPINS = 1 << 26              # bound on the CQ lock spin (a holder that died)
# A copy-engine call slower than this stalled: an 8-byte or row-sized copy takes ~10-200 us on
# the H200; one that waited for a .cpu() queued behind a kernel took 1.62 s
# (bench/copy_engine_stall.py)
DMA_STALL_NS = 20_000_000
STALE_MIN_AGE_S = 10.0               # an unlocked arena without a header is young for this long:
                                     # its creator may be between O_CREAT and flock


# --- engine ------------------------------------------------------------------------------------

@njit(cache=True, inline="always")
def _seg(rbytes, p):
    """Ring offset of the WQE segment at byte ``p`` of the ring (p may run past the end: it wraps).

    Segments are 16 bytes and the ring is a multiple of 64 bytes, so a segment never straddles the
    wrap: one reduction of p is enough. WQE fields are read with gpunet.mlx5's parsers at it.
    """
    if p >= rbytes:
        p = p % rbytes
    return p


@njit(cache=True)
def _record_violation(obase, qpn, opcode, key, addr, length, is_write, pid):
    """Strict mode: the first NIC access to non-coherent memory, in the owner's header."""
    if atomic_cas_u64(obase + H_VIO_CLAIM * 8, 0, 1) == 0:
        H = i64_at(obase, 32)
        H[H_VIO_QPN] = qpn
        H[H_VIO_OPCODE] = opcode
        H[H_VIO_KEY] = key
        H[H_VIO_ADDR] = addr
        H[H_VIO_LEN] = length
        H[H_VIO_WRITE] = is_write
        H[H_VIO_PID] = pid
        store_release_u64(obase + H_VIO_VALID * 8, 1)


@njit(cache=True)
def _mr_lookup(T, key, pd, addr, length, need):
    """MR entry word index for (key, pd, [addr, addr+length), access need), or -1."""
    idx = key >> 8
    if idx <= 0 or idx >= MAX_MR:
        return -1
    me = MR_BASE + idx * MR_WORDS
    if T[me + M_KEY] != key or T[me + M_PD] != pd:
        return -1
    a = T[me + M_ADDR]
    n = T[me + M_LEN]
    # no addr + length: near 2**63 it wraps negative and a range far outside would pass
    if addr < a or length < 0 or length > n or addr - a > n - length:
        return -1
    if (T[me + M_ACCESS] & need) != need:
        return -1
    return me


@njit(cache=True)
def _mr_nic_addr(T, obase, me, addr, same_proc):
    """Where the NIC reaches ``addr`` of MR entry ``me`` (owner arena at ``obase``); -1 if it can't."""
    hbm = T[me + M_HBM_OFF]
    if hbm >= 0:                                  # c500 `device` memory: the HBM image
        return obase + hbm + (addr - T[me + M_ADDR])
    if same_proc:
        return addr
    live = T[me + M_LIVE_OFF]
    if live < 0:                                  # private memory of another process
        return -1
    return obase + live + (addr - T[me + M_ADDR])


@njit(cache=True)
def _cq_push(cbase, cqn, opcode, qpn, counter, byte_cnt, imm, synd, wqe_op, scratch):
    """Write one CQE into CQ ``cqn`` of the arena at ``cbase``. False: CQ in error / overrun."""
    T = i64_at(cbase, TABLE_WORDS)
    ce = CQ_BASE + cqn * CQ_WORDS
    lock = cbase + (ce + C_LOCK) * 8
    spins = 0
    while atomic_cas_u64(lock, 0, 1) != 0:
        spins += 1
        if spins > CQ_LOCK_SPINS:
            return False
        if (spins & 1023) == 0:
            c_sched_yield()
    ok = False
    if T[ce + C_VALID] != 0 and T[ce + C_STATE] == 0:
        cnt = T[ce + C_CNT]
        pi = T[ce + C_PI]
        room = True
        if T[ce + C_COLLAPSED] == 0:
            ci = np.int64(mlx5.bswap32(load_acquire_u32(cbase + T[ce + C_DBREC_OFF]))) & 0xFFFFFF
            if ((pi - ci) & 0xFFFFFF) >= cnt:
                room = False
                T[ce + C_STATE] = 1
        if room:
            owner = 1 if (pi & cnt) != 0 else 0
            mlx5.write_cqe(scratch, 0, opcode, qpn, counter, byte_cnt, imm, owner, synd, 0, wqe_op)
            dst = cbase + T[ce + C_BUF_OFF] + (pi & (cnt - 1)) * mlx5.CQE_SIZE
            # every byte but the last word, then that word (wqe_counter, signature, op_own) with
            # a release: op_own last publishes the CQE (pollers acquire-load that word)
            c_memmove(dst, scratch.ctypes.data, mlx5.CQE_WQE_COUNTER)
            store_release_u32(dst + mlx5.CQE_WQE_COUNTER,
                              mlx5.get_le32(scratch, mlx5.CQE_WQE_COUNTER))
            T[ce + C_PI] = pi + 1
            ok = True
    store_release_u64(lock, 0)
    return ok


@intrinsic
def _dma_copy_call(typingctx, fn, dst, src, n, kind, stream):
    """The copy engine's ``int copy(void* dst, const void* src, size_t n, int kind, void*
    stream)`` at address ``fn`` (cudaMemcpyAsync's signature: gpunet/host/platform.py CopyEngine)."""
    sig = types.int32(fn, dst, src, n, kind, stream)

    def codegen(context, builder, signature, args):
        vp, i64, i32 = cgutils.voidptr_t, ir.IntType(64), ir.IntType(32)
        a = [context.cast(builder, v, t, types.int64) for v, t in zip(args, signature.args)]
        fty = ir.FunctionType(i32, [vp, vp, i64, i32, vp])
        f = builder.inttoptr(a[0], fty.as_pointer())
        return builder.call(f, [builder.inttoptr(a[1], vp), builder.inttoptr(a[2], vp), a[3],
                                builder.trunc(a[4], i32), builder.inttoptr(a[5], vp)])
    return sig, codegen


@intrinsic
def _dma_ptr_call(typingctx, fn, arg):
    """``int f(void*)`` at address ``fn`` (the copy engine's stream synchronize)."""
    sig = types.int32(fn, arg)

    def codegen(context, builder, signature, args):
        vp, i32 = cgutils.voidptr_t, ir.IntType(32)
        a = [context.cast(builder, v, t, types.int64) for v, t in zip(args, signature.args)]
        f = builder.inttoptr(a[0], ir.FunctionType(i32, [vp]).as_pointer())
        return builder.call(f, [builder.inttoptr(a[1], vp)])
    return sig, codegen


@intrinsic
def _dma_int_call(typingctx, fn, arg):
    """``int f(int)`` at address ``fn`` (the copy engine's set-device)."""
    sig = types.int32(fn, arg)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        a = [context.cast(builder, v, t, types.int64) for v, t in zip(args, signature.args)]
        f = builder.inttoptr(a[0], ir.FunctionType(i32, [i32]).as_pointer())
        return builder.call(f, [builder.trunc(a[1], i32)])
    return sig, codegen


@njit(cache=True)
def _dma_move(T, dst, src, n):
    """The one hook through which the engine reaches device memory: copy ``n`` bytes with the
    attached copy engine (select its device, copy on its non-blocking stream, wait for it), as a
    NIC's DMA engine reads and writes GPU memory over GPUDirect. False (the runtime's error code
    in H_DMA_ERR) when no copy engine is attached or the copy failed.
    tests/test_p2p_cuda.py::test_the_soft_nic_engine_moves_device_bytes_through_the_copy_hook."""
    if n <= 0:
        return True
    fn = T[H_DMA_COPY]
    if fn == 0:
        T[H_DMA_ERR] = -1
        return False
    rc = np.int32(0)
    t0 = clock_ns()
    if T[H_DMA_SETDEV] != 0:
        rc = _dma_int_call(T[H_DMA_SETDEV], T[H_DMA_DEVICE])
    if rc == 0:
        rc = _dma_copy_call(fn, dst, src, n, T[H_DMA_KIND], T[H_DMA_STREAM])
    if rc == 0:
        rc = _dma_ptr_call(T[H_DMA_SYNC], T[H_DMA_STREAM])
    took = clock_ns() - t0
    if took > DMA_STALL_NS:
        T[H_DMA_STALLS] += 1
        if took > T[H_DMA_STALL_MAX_NS]:
            T[H_DMA_STALL_MAX_NS] = took
    T[H_DMA_COPIES] += 1
    if rc != 0:
        T[H_DMA_ERR] = rc
        return False
    return True


@njit(cache=True, inline="always")
def _move(T, dev, dst, src, n):
    """Move bytes: through the copy engine when either side is device memory, else memmove."""
    if dev:
        return _dma_move(T, dst, src, n)
    c_memmove(dst, src, n)
    return True


@njit(cache=True)
def _devmap(T, slot, addr, length):
    """Where this process reaches [addr, addr + length) of peer slot ``slot``'s device memory
    (add_peer_memory), or -1."""
    e = DEVMAP_BASE + DEVMAP_WORDS * slot
    # `mapped` first (add_peer_memory clears it before changing start / nb, and sets it last),
    # then the range, then `mapped` again: a mapping replaced meanwhile is refused, never mixed
    mapped = load_acquire_u64(T.ctypes.data + 8 * (e + 2))
    start, nb = T[e], T[e + 1]
    if mapped == 0 or addr < start or length < 0 or length > nb or addr - start > nb - length:
        return -1
    if load_acquire_u64(T.ctypes.data + 8 * (e + 2)) != mapped:
        return -1
    return np.int64(mapped) + (addr - start)


@njit(cache=True)
def _dma_atomic(T, pb, rna, opcode, rbe, sa, cmp, scratch):
    """An 8-byte atomic on the peer's DEVICE memory at ``rna``, through a bounce: under the
    owning NIC's lock (H_DMA_LOCK in ITS header, so every engine of every process targeting that
    memory is serialised), copy the word in, compute, copy it back. Atomic with respect to every
    other NIC atomic on the word (each engine runs one WQE at a time, and they share the lock),
    NOT with a GPU thread's atomic on it (a p2p peer's CAS): a real NIC's read-modify-write over
    PCIe is not either. Returns (the old word's raw bytes as a u64, copies succeeded)."""
    tmp = scratch.ctypes.data
    lock = pb + H_DMA_LOCK * 8
    spins = 0
    while atomic_cas_u64(lock, 0, 1) != 0:
        spins += 1
        if spins > CQ_LOCK_SPINS:
            return np.uint64(0), False
        if (spins & 1023) == 0:
            c_sched_yield()
    old = np.uint64(0)
    ok = _dma_move(T, tmp, rna, 8)
    if ok:
        old = load_acquire_u64(tmp)
        if opcode == mlx5.OPCODE_ATOMIC_CS:
            write = old == _atomic_order(rbe, cmp)
            new = _atomic_order(rbe, sa)
        else:
            write = True
            new = _atomic_order(rbe, _atomic_order(rbe, old) + sa)
        if write:
            store_release_u64(tmp, new)
            ok = _dma_move(T, rna, tmp, 8)
    store_release_u64(lock, 0)
    return old, ok


@njit(cache=True, inline="always")
def _atomic_order(big, v):
    """An atomic word's value from its memory bytes read as a native u64, or the native u64 to
    store for a value: a byte swap when ``big`` (atomic_endianness "big"), else the identity."""
    v = np.uint64(v)
    return bswap64(v) if big else v


@njit(cache=True)
def _peer_dead(pb, now, retry_ns, own_pid):
    H = i64_at(pb, 32)
    if load_acquire_u64(pb + H_DOWN * 8) != 0:
        return True
    age = now - np.int64(load_acquire_u64(pb + H_HEARTBEAT * 8))
    if age > retry_ns:
        return True
    pid = H[H_PID]
    if age > PID_CHECK_NS and pid != own_pid:
        return c_kill0(pid) != 0
    return False


@njit(cache=True)
def _exec_qp(base, T, q, peer_bases, now, budget, scratch, segs):
    """Execute up to ``budget`` posted WQEs of QP ``q``; returns how many completed."""
    qe = QP_BASE + q * QP_WORDS
    nw = T[qe + Q_SQ_WQEBBS]
    mask = nw - 1
    rbytes = nw * mlx5.WQEBB
    ring = u8_at(base + T[qe + Q_SQ_OFF], rbytes)
    ci = T[qe + Q_SQ_CI]
    target = T[qe + Q_TARGET]
    pd = T[qe + Q_PD]
    scq = T[qe + Q_SCQ]
    max_inline = T[qe + Q_MAX_INLINE]
    own_pid = T[H_PID]
    retry_ns = T[H_RETRY_NS]
    done = 0
    while done < budget:
        pending = (target - ci) & 0xFFFF
        if pending == 0:
            break
        if pending > nw:
            # The DBR claims more WQEBBs than the ring holds: it went back behind the consumer
            # index (or jumped a lap ahead), a producer bug (qp.cuh: "the DBR never goes back").
            # Hardware would run stale WQEs; the model errors the QP once and drops this DBR.
            T[qe + Q_STATE] = QPS_ERR
            if T[qe + Q_ERR_SYND] == 0:
                T[qe + Q_ERR_SYND] = mlx5.SYNDROME_LOCAL_QP_OP_ERR
            _cq_push(base, scq, mlx5.CQE_REQ_ERR, q, ci & 0xFFFF, 0, 0,
                     mlx5.SYNDROME_LOCAL_QP_OP_ERR, 0, scratch)
            T[qe + Q_TARGET] = ci & 0xFFFF
            done += 1
            break
        off = (ci & mask) * mlx5.WQEBB
        opcode = np.int64(mlx5.ctrl_opcode(ring, off))
        ds = np.int64(mlx5.ctrl_ds(ring, off))
        fm = np.int64(mlx5.ctrl_fm_ce_se(ring, off))
        imm = np.int64(mlx5.ctrl_imm_raw(ring, off))
        nbb = mlx5.wqebb_count(ds)
        counter = ci & 0xFFFF
        synd = 0
        advance = nbb
        if ds == 0 or ds > mlx5.MAX_DS or nbb > pending:
            synd = mlx5.SYNDROME_LOCAL_QP_OP_ERR          # ds running past what was posted
            advance = pending
        if T[qe + Q_STATE] == QPS_ERR:
            # flush: every WQE up to the DBR completes in error, signalled or not
            if synd != 0:
                advance = 1 if nbb == 0 or nbb > pending else nbb
            _cq_push(base, scq, mlx5.CQE_REQ_ERR, q, counter, 0, 0,
                     mlx5.SYNDROME_WR_FLUSH_ERR, opcode, scratch)
            ci += advance
            done += 1
            continue
        total = np.int64(0)
        busy_at = np.int64(0)                          # the responder MR's M_BUSY word, held
        ldev = False                                   # a local segment is device memory
        rdev = False                                   # the remote range is device memory
        nseg = 0
        inline_len = -1
        raddr = np.int64(0)
        rkey = np.int64(0)
        is_rdma = opcode == mlx5.OPCODE_RDMA_WRITE or opcode == mlx5.OPCODE_RDMA_WRITE_IMM \
            or opcode == mlx5.OPCODE_RDMA_READ
        is_atomic = opcode == mlx5.OPCODE_ATOMIC_CS or opcode == mlx5.OPCODE_ATOMIC_FA
        p0 = off                                       # byte offset of the WQE in the ring
        pb = peer_bases[0]
        # ---- local checks (no peer needed) ---------------------------------------------------
        if synd == 0:
            if opcode == mlx5.OPCODE_NOP:
                pass
            elif is_rdma or is_atomic:
                if (is_rdma and ds < 3) or (is_atomic and ds != mlx5.DS_ATOMIC):
                    synd = mlx5.SYNDROME_LOCAL_QP_OP_ERR
                else:
                    rs = _seg(rbytes, p0 + mlx5.CTRL_SEG_SIZE)
                    raddr = np.int64(mlx5.raddr_seg_raddr(ring, rs))
                    rkey = np.int64(mlx5.raddr_seg_rkey(ring, rs))
                    first = 2 if is_rdma else 3            # segments before the data segments
                    bc0 = np.int64(mlx5.data_seg_byte_count(ring, _seg(rbytes, p0 + first * 16)))
                    if is_rdma and (bc0 & mlx5.INLINE_SEG) != 0:
                        inline_len = bc0 & 0x7FFFFFFF
                        if opcode == mlx5.OPCODE_RDMA_READ:
                            synd = mlx5.SYNDROME_LOCAL_QP_OP_ERR
                        elif inline_len > max_inline:
                            synd = mlx5.SYNDROME_LOCAL_LENGTH_ERR
                        elif mlx5.INLINE_HDR_SIZE + inline_len > (ds - 2) * mlx5.DS_UNIT:
                            synd = mlx5.SYNDROME_LOCAL_QP_OP_ERR
                        total = inline_len
                    else:
                        lw = 1 if (opcode == mlx5.OPCODE_RDMA_READ or is_atomic) else 0
                        for s in range(ds - first):
                            sp = _seg(rbytes, p0 + (first + s) * mlx5.DS_UNIT)
                            bc = np.int64(mlx5.data_seg_byte_count(ring, sp))
                            if (bc & mlx5.INLINE_SEG) != 0:
                                synd = mlx5.SYNDROME_LOCAL_QP_OP_ERR
                                break
                            if is_atomic and bc != 8:
                                synd = mlx5.SYNDROME_LOCAL_LENGTH_ERR
                                break
                            lkey = np.int64(mlx5.data_seg_lkey(ring, sp))
                            laddr = np.int64(mlx5.data_seg_addr(ring, sp))
                            me = _mr_lookup(T, lkey, pd, laddr, bc, lw)
                            if me < 0:
                                synd = mlx5.SYNDROME_LOCAL_PROT_ERR
                                break
                            na = _mr_nic_addr(T, base, me, laddr, True)
                            if T[me + M_DMA] != 0:
                                ldev = True                # local device memory: copy engine
                            if T[me + M_HBM_OFF] >= 0 and T[H_STRICT] != 0 and bc > 0:
                                _record_violation(base, q, opcode, lkey, laddr, bc, lw, own_pid)
                            segs[2 * s] = na
                            segs[2 * s + 1] = bc
                            total += bc
                            nseg += 1
                    if synd == 0 and is_atomic and (raddr & 7) != 0:
                        synd = mlx5.SYNDROME_REMOTE_INVAL_REQ_ERR
            else:
                synd = mlx5.SYNDROME_LOCAL_QP_OP_ERR       # SEND, masked atomics, unknown
        # ---- the peer: liveness, then the responder's checks, then the bytes -----------------
        if synd == 0 and opcode != mlx5.OPCODE_NOP:
            slot = T[qe + Q_PEER_SLOT]
            pb = peer_bases[slot]
            if slot != 0 and _peer_dead(pb, now, retry_ns, own_pid):
                ds0 = T[qe + Q_DEAD_SINCE]
                if ds0 == 0:
                    T[qe + Q_DEAD_SINCE] = now
                    break                                  # stall: in order, nothing behind runs
                if now - ds0 < retry_ns:
                    break
                synd = mlx5.SYNDROME_TRANSPORT_RETRY_EXC_ERR
            T[qe + Q_DEAD_SINCE] = 0
        if synd == 0 and opcode != mlx5.OPCODE_NOP:
            P = i64_at(pb, TABLE_WORDS)
            pq = T[qe + Q_PEER_QPN]
            pqe = QP_BASE + pq * QP_WORDS
            same_proc = P[H_PID] == own_pid
            if opcode == mlx5.OPCODE_RDMA_READ:
                rneed = 4
            elif is_atomic:
                rneed = 8
            else:
                rneed = 2
            rlen = 8 if is_atomic else total
            rme = _mr_lookup(P, rkey, P[pqe + Q_PD], raddr, rlen, rneed)
            rna = -1
            if rme >= 0:
                # held while the bytes move; the key read again after the hold is taken, so a
                # dereg_mr that cleared it meanwhile (and then waits for the holds to end) wins
                busy_at = pb + 8 * (rme + M_BUSY)
                atomic_fetch_add_u64(busy_at, 1)
                if np.int64(load_acquire_u64(pb + 8 * (rme + M_KEY))) != rkey:
                    atomic_fetch_add_u64(busy_at, np.uint64(0xFFFFFFFFFFFFFFFF))
                    busy_at = 0
                    rme = -1
            if rme >= 0:
                if P[rme + M_DMA] != 0:
                    # the peer's device memory: its own address in its process, else where this
                    # process mapped it (add_peer_memory); bytes move through the copy engine
                    rdev = True
                    rna = raddr if same_proc else _devmap(T, T[qe + Q_PEER_SLOT], raddr, rlen)
                else:
                    rna = _mr_nic_addr(P, pb, rme, raddr, same_proc)
            if rna < 0:
                synd = mlx5.SYNDROME_REMOTE_ACCESS_ERR
            else:
                moved = True
                if P[rme + M_HBM_OFF] >= 0 and P[H_STRICT] != 0 and rlen > 0:
                    _record_violation(pb, q, opcode, rkey, raddr, 8 if is_atomic else total,
                                      0 if opcode == mlx5.OPCODE_RDMA_READ else 1, own_pid)
                dev = ldev or rdev
                if opcode == mlx5.OPCODE_RDMA_READ:
                    acc = np.int64(0)
                    for s in range(nseg):
                        moved = moved and _move(T, dev, segs[2 * s], rna + acc, segs[2 * s + 1])
                        acc += segs[2 * s + 1]
                elif is_atomic:
                    old = np.uint64(0)
                    asg = _seg(rbytes, p0 + mlx5.CTRL_SEG_SIZE + mlx5.RADDR_SEG_SIZE)
                    sa = mlx5.atomic_seg_swap_add(ring, asg)
                    rbe = P[H_ATOMIC_BE] != 0              # the word, in its owner's order
                    if rdev:
                        old, moved = _dma_atomic(T, pb, rna, opcode, rbe, sa,
                                                 mlx5.atomic_seg_compare(ring, asg), scratch)
                    elif opcode == mlx5.OPCODE_ATOMIC_CS:
                        cmp = mlx5.atomic_seg_compare(ring, asg)
                        old = atomic_cas_u64(rna, _atomic_order(rbe, cmp), _atomic_order(rbe, sa))
                    else:
                        while True:
                            old = load_acquire_u64(rna)
                            new = _atomic_order(rbe, _atomic_order(rbe, old) + sa)
                            if atomic_cas_u64(rna, old, new) == old:
                                break
                    # the old value, in the requester's order, as the native word's bytes
                    res = _atomic_order(T[H_ATOMIC_BE] != 0, _atomic_order(rbe, old))
                    if ldev:
                        tmp = scratch.ctypes.data
                        store_release_u64(tmp, res)
                        moved = moved and _dma_move(T, segs[0], tmp, 8)
                    else:
                        dst = u8_at(segs[0], 8)
                        for i in range(8):
                            dst[i] = np.uint8((res >> np.uint64(8 * i)) & np.uint64(0xFF))
                elif inline_len >= 0:
                    src = p0 + mlx5.CTRL_SEG_SIZE + mlx5.RADDR_SEG_SIZE + mlx5.INLINE_HDR_SIZE
                    src = src % rbytes
                    first_part = min(inline_len, rbytes - src)
                    moved = _move(T, rdev, rna, ring.ctypes.data + src, first_part) and \
                        _move(T, rdev, rna + first_part, ring.ctypes.data, inline_len - first_part)
                else:
                    acc = np.int64(0)
                    for s in range(nseg):
                        moved = moved and _move(T, dev, rna + acc, segs[2 * s], segs[2 * s + 1])
                        acc += segs[2 * s + 1]
                if not moved:                              # the copy engine failed (H_DMA_ERR)
                    synd = mlx5.SYNDROME_REMOTE_ACCESS_ERR if rdev else \
                        mlx5.SYNDROME_LOCAL_PROT_ERR
                if opcode == mlx5.OPCODE_RDMA_WRITE_IMM and moved:   # data that did not land: no CQE
                    rcq = P[pqe + Q_RCQ]
                    cnt = P[pqe + Q_RQ_COUNTER]
                    P[pqe + Q_RQ_COUNTER] = cnt + 1
                    if not _cq_push(pb, rcq, mlx5.CQE_RESP_WR_IMM, pq, cnt & 0xFFFF, total, imm,
                                    0, 0, scratch):
                        P[pqe + Q_STATE] = QPS_ERR         # the responder's CQ overran
                        if P[pqe + Q_ERR_SYND] == 0:
                            P[pqe + Q_ERR_SYND] = -1
        if busy_at != 0:
            atomic_fetch_add_u64(busy_at, np.uint64(0xFFFFFFFFFFFFFFFF))   # the bytes moved
            busy_at = 0
        # ---- completion ----------------------------------------------------------------------
        if synd != 0:
            T[qe + Q_STATE] = QPS_ERR
            if T[qe + Q_ERR_SYND] == 0:
                T[qe + Q_ERR_SYND] = synd
            _cq_push(base, scq, mlx5.CQE_REQ_ERR, q, counter, 0, 0, synd, opcode, scratch)
        elif (fm & mlx5.WQE_CTRL_CQ_UPDATE) != 0:
            if not _cq_push(base, scq, mlx5.CQE_REQ, q, counter, total, 0, 0, opcode, scratch):
                T[qe + Q_STATE] = QPS_ERR                  # CQ overrun / CQ in error
                if T[qe + Q_ERR_SYND] == 0:
                    T[qe + Q_ERR_SYND] = -1
        ci += advance
        done += 1
    T[qe + Q_SQ_CI] = ci & 0xFFFF
    T[qe + Q_NDONE] += done
    return done


@njit(cache=True, nogil=True)
def engine_step(base, peer_bases, now, budget, scratch, segs):
    """One pass over every QP: latch changed doorbells, execute what was posted. Returns WQEs done."""
    T = i64_at(base, TABLE_WORDS)
    nqp = T[H_NQP]
    did = 0
    for q in range(1, nqp):
        qe = QP_BASE + q * QP_WORDS
        st = T[qe + Q_STATE]
        if st != QPS_RTS and st != QPS_ERR:
            continue
        db = np.int64(load_acquire_u64(base + T[qe + Q_DB_OFF]))
        if db != T[qe + Q_LAST_DB]:
            T[qe + Q_LAST_DB] = db
            dbr = mlx5.bswap32(load_acquire_u32(base + T[qe + Q_DBREC_OFF] + 4 * mlx5.DBREC_SND))
            T[qe + Q_TARGET] = np.int64(dbr) & 0xFFFF
        if T[qe + Q_TARGET] != T[qe + Q_SQ_CI]:
            did += _exec_qp(base, T, q, peer_bases, now, budget, scratch, segs)
    T[H_WQES] += did
    return did


@njit(cache=True, nogil=True)
def engine_run(base, peer_bases, scratch, segs, max_iters):
    """The engine thread's whole life: runs until the header's stop word is set (or max_iters)."""
    T = i64_at(base, TABLE_WORDS)
    it = 0
    last_work = clock_ns()
    last_beat = 0
    while load_acquire_u64(base + H_STOP * 8) == 0:
        now = clock_ns()
        if now - last_beat >= HEARTBEAT_NS:
            store_release_u64(base + H_HEARTBEAT * 8, now)
            last_beat = now
        did = 0
        if load_acquire_u64(base + H_DOWN * 8) == 0 and atomic_cas_u64(base + H_EXEC * 8, 0, 1) == 0:
            did = engine_step(base, peer_bases, now, ENGINE_BUDGET, scratch, segs)
            store_release_u64(base + H_EXEC * 8, 0)
        it += 1
        T[H_ITERS] = it
        if max_iters > 0 and it >= max_iters:
            break
        if did > 0:
            last_work = now
            continue
        # rawmem.idle_pause: spin for H_SPIN_NS (idle_spin_us: a pure spin, for machines with a core
        # to spare: on the H200 host even one sched_yield every 64 passes took the proxy round trip
        # from 4.7 to 8.0 us, bench/RESULTS.md), then yield, then sleep with a bounded back-off
        idle_pause(now - last_work, T[H_SPIN_NS], T[H_SLEEP_MAX_US])


@njit(cache=True, nogil=True)
def _exec_barrier(base):
    """Take the executor lock (H_EXEC) if it is free and release it at once; True when done: every
    engine pass that began before the call has ended. Take and release are one compiled call
    because a try/finally cannot close the gap: an asynchronous exception (a KeyboardInterrupt, a
    signal handler's timeout) lands on the bytecode boundary right after a take that returned to
    Python, before any try, and would leave the lock held and this NIC's executor wedged for good
    (tests/test_softnic.py checks the lock at every Python line of reset_qp and dereg_mr)."""
    if atomic_cas_u64(base + H_EXEC * 8, 0, 1) != 0:
        return False
    store_release_u64(base + H_EXEC * 8, 0)
    return True


# The progress hook's argument: int64 words [arena base, peer_bases, scratch, segs] (addresses).
PROGRESS_ARG_WORDS = 4


def progress_hook_address():
    """The C address of progress_hook, compiled (numba cfunc, disk-cached) at the first call:
    gpunet/host/progress.py asks only once a library runs hooks, so importing this module compiles
    nothing."""
    global _progress_cfunc
    if _progress_cfunc is None:
        _progress_cfunc = cfunc(types.int64(types.uint64), nopython=True, cache=True)(progress_hook)
    return _progress_cfunc.address


_progress_cfunc = None


def progress_hook(arg):
    """One engine pass on the calling thread, if no other thread is executing (the H_EXEC
    try-lock) and the NIC is up: what a HOST-arm device thread runs while it spins (gpunet/host/progress.py;
    SoftNic registers it for its whole life). Returns the WQEs done."""
    a = i64_at(arg, PROGRESS_ARG_WORDS)
    base = a[0]
    if load_acquire_u64(base + H_DOWN * 8) != 0 or load_acquire_u64(base + H_STOP * 8) != 0:
        return 0
    lock = base + H_EXEC * 8
    if load_acquire_u64(lock) != 0 or atomic_cas_u64(lock, 0, 1) != 0:
        return 0
    did = engine_step(base, i64_at(a[1], MAX_PEERS), clock_ns(), ENGINE_BUDGET,
                      u8_at(a[2], mlx5.CQE_SIZE), i64_at(a[3], 2 * (mlx5.MAX_DS + 1)))
    store_release_u64(lock, 0)
    return did


@njit(cache=True)
def _evict(live, hbm, fetched, start, end):
    """L2 eviction of bytes [start, end): SM-dirty bytes go to HBM, then the lines are refilled."""
    for i in range(start, end):
        if live[i] != fetched[i]:
            hbm[i] = live[i]
        live[i] = hbm[i]
        fetched[i] = hbm[i]


# --- Python side -------------------------------------------------------------------------------
_instance_counter = itertools.count()
_open_nics = weakref.WeakSet()


def remove_stale_arenas(min_age_s=STALE_MIN_AGE_S):
    """Unlink the /dev/shm/gpunet-<pid>-* arenas whose owner process is gone (a crashed or killed
    rank); returns their names. SoftNic calls it when it starts and when it closes, so the next
    NIC on the machine, or a survivor closing, reclaims what a crash left.

    Never removes a live NIC's arena. An arena is stale only when all of these hold:
    - no process <pid> exists (the name's pid; a live pid keeps its arenas, also older ones);
    - nobody holds the arena's lock: every SoftNic holds a shared flock on its arena file from
      creation until close, and the kernel drops it when the process dies, so the lock is the
      owner's liveness even where the pid cannot be seen (another pid namespace sharing /dev/shm);
    - the header is complete (magic written: the owner took its lock before writing it), or,
      for a file still without one, it is older than ``min_age_s`` (a creator between its
      O_CREAT and its flock looks the same for that instant).
    tests/test_softnic.py::test_stale_arena_of_a_killed_process_is_reclaimed_and_live_ones_kept.
    """
    removed = []
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return removed
    for n in names:
        if not n.startswith("gpunet-"):
            continue
        try:
            pid = int(n.split("-")[1])
        except (IndexError, ValueError):
            continue
        if pid_alive(pid):
            continue
        path = os.path.join("/dev/shm", n)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue                            # locked: its owner is alive somewhere
            head = os.pread(fd, 8, H_MAGIC * 8)
            complete = len(head) == 8 and int.from_bytes(head, "little") == ARENA_MAGIC
            if not complete and time.time() - os.fstat(fd).st_ctime < min_age_s:
                continue
            try:
                os.unlink(path)
                removed.append(n)
            except OSError:                         # gone already, or not ours to remove
                pass
        finally:
            os.close(fd)
    return removed


class _Arena:
    """One mapped arena file: ``mm`` (mmap), ``base`` (address), ``T`` (int64 table view)."""

    def __init__(self, name, size=None, create=False):
        path = os.path.join("/dev/shm", name)
        self.name = name
        self._lock_fd = None
        if create:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                # held until close (or death): remove_stale_arenas never takes a locked arena
                fcntl.flock(fd, fcntl.LOCK_SH)
                os.ftruncate(fd, size)          # sparse: pages appear when touched
                self.mm = mmap.mmap(fd, size)
            except BaseException:
                os.close(fd)
                os.unlink(path)
                raise
            self._lock_fd = fd
        else:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                raise ConfigError("peer arena %s not found: is the peer NIC still open?" % name)
            size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, size)
            os.close(fd)
        self.size = size
        self.u8 = np.frombuffer(self.mm, dtype=np.uint8)
        self.base = address_of(self.u8)
        self.T = self.u8[:TABLE_WORDS * 8].view(np.int64)

    def close(self):
        self.T = None
        self.u8 = None
        try:
            self.mm.close()
        except BufferError:
            pass                                # user views still alive: the mapping dies with them
        if self._lock_fd is not None:
            os.close(self._lock_fd)             # drops the liveness lock
            self._lock_fd = None


class PD:
    """A protection domain."""

    def __init__(self, nic, pdn):
        self.nic = nic
        self.pdn = pdn

    def __repr__(self):
        return "PD(%d)" % self.pdn


class MR:
    """A registered memory region: addr, length, lkey, rkey, access, kind, pd."""

    def __init__(self, nic, idx, key, addr, length, access, kind, pd, keepalive, hbm, fetched):
        self.nic, self.index, self.lkey, self.rkey = nic, idx, key, key
        self.addr, self.length, self.access, self.kind, self.pd = addr, length, access, kind, pd
        self._keepalive = keepalive
        self.hbm = hbm              # c500 `device`: the HBM image (np.uint8 view) or None
        self.fetched = fetched      # c500 `device`: what the L2 held when last filled, or None

    def __repr__(self):
        return "MR(lkey=0x%x, addr=0x%x, length=%d, kind=%s)" % (self.lkey, self.addr,
                                                                self.length, self.kind)


class CQ:
    """A completion queue: ``buf`` (cqe_cnt * 64 bytes), ``dbrec`` (8 bytes), ``collapsed``."""

    def __init__(self, nic, cqn, buf, dbrec, cqe_cnt, collapsed):
        self.nic, self.cqn, self.buf, self.dbrec = nic, cqn, buf, dbrec
        self.buf_addr, self.dbrec_addr = address_of(buf), address_of(dbrec)
        self.cqe_cnt, self.collapsed = cqe_cnt, collapsed

    def __repr__(self):
        return "CQ(cqn=%d, cqe_cnt=%d%s)" % (self.cqn, self.cqe_cnt,
                                             ", collapsed" if self.collapsed else "")


class QP:
    """An RC queue pair: ``sq`` ring of ``sq_wqebbs`` WQEBBs, ``dbrec``, ``db`` (the UAR word)."""

    def __init__(self, nic, qpn, sq, sq_wqebbs, dbrec, db, send_cq, recv_cq, max_inline, pd):
        self.nic, self.qpn, self.sq, self.sq_wqebbs = nic, qpn, sq, sq_wqebbs
        self.dbrec, self.db = dbrec, db
        self.sq_addr, self.dbrec_addr, self.db_addr = address_of(sq), address_of(dbrec), address_of(db)
        self.send_cq, self.recv_cq, self.max_inline, self.pd = send_cq, recv_cq, max_inline, pd

    def info(self):
        """Picklable description for ``connect()`` in any process."""
        return {"arena": self.nic.arena_name, "qpn": self.qpn, "pid": self.nic.pid}

    def __repr__(self):
        return "QP(qpn=%d, sq_wqebbs=%d)" % (self.qpn, self.sq_wqebbs)


class SoftNic(Nic):
    """A software mlx5 NIC with its own engine thread and shared-memory arena (gpunet/host/nic.py's Nic:
    open it with ``open_nic("soft", ...)`` above host/).

    profile: "nvidia" (every memory kind coherent with the NIC) or "c500" (`device` memory seen
        through an HBM image that syncs with SM memory only at ``evict()``).
    strict: record the first NIC access to non-coherent memory; ``check()`` raises it.
    arena_bytes: size of the (sparse) arena: tables + rings + CQs + ``alloc()`` buffers.
    retry_timeout_s: how long a WQE waits on a dead peer before completing with 0x15; also the
        heartbeat age after which a peer counts as dead.
    name: optional tag in the arena's file name (gpunet-<pid>-<name>).
    idle_spin_us: after its last work the engine keeps polling (a pure spin, no syscall) this long
        before it yields (for rawmem.IDLE_YIELD_NS more) and then sleeps (rawmem.idle_pause). 0
        (the default) suits shared CPUs; a latency benchmark on a machine with cores to spare
        passes ~1000 (a yielding engine adds a sched_yield syscall to a doorbell, a sleeping one
        up to its back-off).
    cpus: None, or the CPU numbers the engine thread pins itself to (rawmem.engine_thread_start;
        ``placement`` then records its thread id and CPUs).
    atomic_endianness: "host" (default: 8-byte atomics on native-order words, the mlx5 HCA's
        host-endian atomic mode) or "big" (the IB wire order); ``nic.atomic_endianness``.
    """

    def __init__(self, profile="nvidia", strict=False, arena_bytes=64 << 20, retry_timeout_s=1.0,
                 name=None, idle_spin_us=0.0, cpus=None, atomic_endianness="host"):
        if profile not in PROFILES:
            raise ConfigError("profile must be one of %s, not %r" % (sorted(PROFILES), profile))
        if atomic_endianness not in ("host", "big"):
            raise ConfigError("atomic_endianness must be 'host' or 'big', not %r"
                              % (atomic_endianness,))
        self.atomic_endianness = atomic_endianness
        if arena_bytes < HEAP_START + (1 << 16):
            raise ConfigError("arena_bytes must be at least %d" % (HEAP_START + (1 << 16)))
        if not retry_timeout_s > 0:
            raise ConfigError("retry_timeout_s must be > 0")
        self._thread = None
        self.profile, self.strict = profile, bool(strict)
        self.retry_timeout_s = float(retry_timeout_s)
        self.pid = os.getpid()
        # The counter keeps names unique when one process makes several NICs of the same name.
        tag = "%s-%d" % (name, next(_instance_counter)) if name is not None else \
            "%d-%s" % (next(_instance_counter), os.urandom(3).hex())
        self.arena_name = "gpunet-%d-%s" % (self.pid, tag)
        if "/" in self.arena_name or len(self.arena_name) > 200:
            raise ConfigError("bad NIC name %r" % (name,))
        arena_bytes = (int(arena_bytes) + 4095) & ~4095
        remove_stale_arenas()            # what crashed NICs on this machine left in /dev/shm
        self._arena = _Arena(self.arena_name, arena_bytes, create=True)
        self._finalizer = weakref.finalize(self, _unlink_quiet, self.arena_name)
        try:
            self._lock = threading.Lock()
            T = self._arena.T
            T[H_PID] = self.pid
            T[H_PROFILE] = PROFILES[profile]
            T[H_ATOMIC_BE] = int(atomic_endianness == "big")
            T[H_STRICT] = int(self.strict)
            T[H_HEAP_TOP] = HEAP_START
            T[H_SIZE] = arena_bytes
            T[H_NQP] = 1
            T[H_NCQ] = 1
            T[H_NMR] = 1
            T[H_RETRY_NS] = int(self.retry_timeout_s * 1e9)
            T[H_SPIN_NS] = int(max(0.0, float(idle_spin_us)) * 1e3)
            T[H_SLEEP_MAX_US] = IDLE_SLEEP_MAX_US
            T[H_HEARTBEAT] = time.monotonic_ns()
            nb = self.arena_name.encode()
            self._arena.u8[H_NAME_BYTE:H_NAME_BYTE + len(nb)] = np.frombuffer(nb, np.uint8)
            T[H_MAGIC] = ARENA_MAGIC
            self._pd_count = itertools.count(1)
            self.default_pd = self.alloc_pd()
            self._mr_free = []
            self._peer_bases = np.zeros(MAX_PEERS, dtype=np.int64)
            self._peer_bases[0] = self._arena.base
            self._peers = {self.arena_name: 0}
            self._peer_arenas = [None]
            self._scratch = np.zeros(mlx5.CQE_SIZE, dtype=np.uint8)
            self._segs = np.zeros(2 * (mlx5.MAX_DS + 1), dtype=np.int64)
            # compile (or load from cache) before the thread starts, then run GIL-free
            engine_run(self._arena.base, self._peer_bases, self._scratch, self._segs, 1)
            self._progress_arg = np.array([self._arena.base, self._peer_bases.ctypes.data,
                                           self._scratch.ctypes.data, self._segs.ctypes.data],
                                          dtype=np.int64)
            # waiting HOST-arm device threads run this NIC's engine pass (gpunet/host/progress.py)
            self._progress = progress.register(progress_hook_address,
                                               self._progress_arg.ctypes.data)
            self._cpus = None if cpus is None else sorted(int(c) for c in cpus)
            self.placement = None          # {"tid", "cpus"} of the engine thread once it runs
            self._thread = threading.Thread(target=self._engine_thread, name="softnic-engine-%s" % tag,
                                            daemon=True)
            self._thread.start()
            _open_nics.add(self)
        except BaseException as e:
            self._close_noting(e)
            raise

    @property
    def idle_sleep_max_addr(self):
        """The address of the idle sleep cap word (us), for engine threads that follow this NIC's
        (gpunet/host/proxy.py proxy_run)."""
        self._check_open()
        return self._arena.base + 8 * H_SLEEP_MAX_US

    def set_idle_sleep_max(self, us):
        """Let the idle engine thread sleep up to ``us`` microseconds (default
        rawmem.IDLE_SLEEP_MAX_US): for a NIC whose waiters run its passes themselves (the
        Context's Launcher on the CPU sets rawmem.HOOKED_IDLE_SLEEP_MAX_US)."""
        self._check_open()
        us = int(us)
        if not IDLE_SLEEP_MAX_US <= us <= 100_000:
            raise ConfigError("idle sleep cap must be %d..100000 us, not %d" % (IDLE_SLEEP_MAX_US, us))
        self._arena.T[H_SLEEP_MAX_US] = us

    def _engine_thread(self):
        self.placement = engine_thread_start(self._cpus)
        engine_run(self._arena.base, self._peer_bases, self._scratch, self._segs, -1)

    # --- lifecycle (gpunet.resource.Resource: close() is idempotent and runs this once) ---
    def _release(self):
        """Stop the engine, tell peers this NIC is gone, unlink the arena."""
        if getattr(self, "_progress", None) is not None:
            progress.unregister(self._progress)   # no caller's thread executes for it from here
        T = self._arena.T
        T[H_DOWN] = 1
        T[H_STOP] = 1
        if self._thread is not None:
            self._thread.join()
        ce = getattr(self, "_copy_engine", None)
        if ce is not None and hasattr(ce, "close"):
            self._copy_engine = None
            ce.close()                  # after the engine stopped: no copy is in flight
        _unlink_quiet(self.arena_name)
        self._finalizer.detach()
        for a in getattr(self, "_peer_arenas", [])[1:]:
            if a is not None:
                a.close()
        self._arena.close()
        remove_stale_arenas()            # a survivor reclaims the arenas of peers that crashed

    def _check_open(self):
        if self.closed:
            raise ClosedError("SoftNic %s is closed; create a new one" % self.arena_name)

    def map_doorbell(self, platform):
        """The doorbell word lives in the arena: ordinary memory the HOST arm's device threads
        store to, and on a GPU host memory mapped with the rest of the arena (NicMapping)."""
        return "the soft NIC's doorbell word is %s" % (
            "memory the HOST arm's device threads store to" if platform.name == "cpu" else
            "host memory registered with the GPU (cudaHostRegister)")

    def mapped_ranges(self):
        """The whole arena: every ring, CQ, doorbell record and word and every ``alloc`` buffer is
        inside it, so the GPU maps it once (gpunet/device/descriptors.py NicMapping)."""
        self._check_open()
        return [(self._arena.base, self._arena.size)]

    # --- peer heaps (Nic.export_heap / map_peer_heap: the p2p transport) ---
    def export_heap(self, addr, nbytes):
        """``[addr, addr + nbytes)`` inside the arena, named by the arena file and an offset (a
        peer maps the same file: /dev/shm is per machine).

        The coherence model covers peers (DESIGN.md): when the range lies in a c500 ``device``
        region, the export names that region's HBM image, not the SMs' view, so a peer's stores
        become visible to this rank's loads only at ``evict()`` events, as NIC writes do (the
        seed measured a flag barrier over MetaXLink hanging on plain device memory and passing on
        Finegrained). tests/test_peer_coherence.py."""
        self._check_open()
        off = int(addr) - self._arena.base
        if not (0 <= off and 0 <= int(nbytes) <= self._arena.size - off):
            raise ConfigError("export_heap: [0x%x, +%d) is not inside arena %s"
                              % (int(addr), int(nbytes), self.arena_name))
        hbm = self._hbm_image_offset(int(addr), int(nbytes))
        return {"arena": self.arena_name, "pid": self.pid, "offset": off if hbm is None else hbm,
                "nbytes": int(nbytes), "image": "live" if hbm is None else "hbm"}

    def _hbm_image_offset(self, addr, nbytes):
        """The arena offset of ``addr`` in the HBM image of the c500 ``device`` region holding
        [addr, addr + nbytes), or None when no such region overlaps it. A range that only partly
        lies in one cannot be modelled (its bytes would need two images): ConfigError."""
        T = self._arena.T
        for idx in range(1, int(T[H_NMR])):
            me = MR_BASE + idx * MR_WORDS
            if int(T[me + M_KEY]) == 0 or int(T[me + M_HBM_OFF]) < 0:
                continue
            a, n = int(T[me + M_ADDR]), int(T[me + M_LEN])
            if addr >= a + n or addr + nbytes <= a:
                continue
            if not (a <= addr and addr + nbytes <= a + n):
                raise ConfigError("export_heap: [0x%x, +%d) lies partly in a c500 device region "
                                  "[0x%x, +%d): export ranges inside it or outside it"
                                  % (addr, nbytes, a, n))
            return int(T[me + M_HBM_OFF]) + (addr - a)
        return None

    def map_peer_heap(self, exported):
        """Map the peer arena range ``exported`` describes (its own mapping, apart from the one
        ``connect`` makes for the engine): a PeerHeap whose ``close()`` unmaps it."""
        self._check_open()
        try:
            name, pid = str(exported["arena"]), int(exported["pid"])
            off, nbytes = int(exported["offset"]), int(exported["nbytes"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError("map_peer_heap needs an export_heap() dict, not %r" % (exported,))
        return PeerHeap(name, pid, off, nbytes)

    # --- memory ---
    def _heap_alloc(self, nbytes, align=64):
        nbytes = int(nbytes)
        if nbytes < 0 or align <= 0 or align & (align - 1):
            raise ConfigError("alloc: nbytes must be >= 0 and align a power of two")
        with self._lock:
            T = self._arena.T
            off = (int(T[H_HEAP_TOP]) + align - 1) & ~(align - 1)
            if off + nbytes > self._arena.size:
                raise ConfigError("arena %s is full (%d bytes): pass a larger arena_bytes to "
                                  "SoftNic" % (self.arena_name, self._arena.size))
            T[H_HEAP_TOP] = off + nbytes
        return off

    def alloc(self, nbytes, align=64):
        """A zeroed np.uint8 view of ``nbytes`` in the arena (shared with peers, never freed)."""
        self._check_open()
        off = self._heap_alloc(nbytes, align)
        return self._arena.u8[off:off + int(nbytes)]

    def alloc_pd(self):
        self._check_open()
        return PD(self, next(self._pd_count))

    def reg_mr(self, buf_or_addr, length=None, access=Access.ALL, kind="host", pd=None,
               device_memory=False):
        """Register memory: a numpy array / buffer (any dtype) or an integer address + length.

        Memory inside this NIC's arena is reachable by peers in any process; other memory only by
        peers in this process (a peer elsewhere gets a remote access error). On profile c500 a
        ``device`` region also gets its HBM and L2-fill images in the arena (initialised to the
        current contents). Returns an MR with lkey == rkey = index << 8 | variant.

        ``device_memory=True``: the range is GPU device memory the CPU cannot load or store (an
        address + length, e.g. a cudaMalloc heap). Every engine moves its bytes through its copy
        engine (``attach_copy_engine``): this NIC's for its own, a peer NIC's for this one once
        the peer process mapped it (``add_peer_memory``), as a NIC reads and writes GPU memory by
        DMA over GPUDirect. Atomics on it are a read-modify-write under this NIC's lock.
        """
        self._check_open()
        if kind not in _KINDS:
            raise ConfigError("kind must be one of %s, not %r" % (sorted(_KINDS), kind))
        if device_memory and (self.profile == "c500" or not isinstance(buf_or_addr, (int, np.integer))):
            raise ConfigError("reg_mr(device_memory=True) takes an address + length (memory the "
                              "CPU cannot touch), on the nvidia profile (the c500 model keeps "
                              "CPU images of device memory instead)")
        pd = self.default_pd if pd is None else pd
        if not isinstance(pd, PD) or pd.nic is not self:
            raise ConfigError("pd must be a PD of this NIC")
        access = Access(int(access) & 15)
        addr, length, keep = mr_region(buf_or_addr, length)
        live_off = addr - self._arena.base
        if device_memory or not (HEAP_START <= live_off and live_off + length <= self._arena.size):
            live_off = -1
        hbm = fetched = None
        hbm_off = fetch_off = -1
        if self.profile == "c500" and kind == "device":
            hbm_off = self._heap_alloc(length, LINE_BYTES)
            fetch_off = self._heap_alloc(length, LINE_BYTES)
            hbm = self._arena.u8[hbm_off:hbm_off + length]
            fetched = self._arena.u8[fetch_off:fetch_off + length]
            live = u8_view(addr, length)
            hbm[:] = live
            fetched[:] = live
        with self._lock:
            if self._mr_free:
                idx = self._mr_free.pop()
            else:
                idx = int(self._arena.T[H_NMR])
                if idx >= MAX_MR:
                    raise ConfigError("MR table full (%d regions)" % MAX_MR)
                self._arena.T[H_NMR] = idx + 1
            T = self._arena.T
            me = MR_BASE + idx * MR_WORDS
            variant = (int(T[me + M_VARIANT]) + 1) & 0xFF
            T[me + M_VARIANT] = variant
            key = idx << 8 | variant
            T[me + M_PD] = pd.pdn
            T[me + M_ADDR] = addr
            T[me + M_LEN] = length
            T[me + M_ACCESS] = int(access)
            T[me + M_KIND] = _KINDS[kind]
            T[me + M_LIVE_OFF] = live_off
            T[me + M_HBM_OFF] = hbm_off
            T[me + M_FETCH_OFF] = fetch_off
            T[me + M_DMA] = int(bool(device_memory))
            T[me + M_KEY] = key                 # last: the entry becomes valid
        return MR(self, idx, key, addr, length, access, kind, pd, keep, hbm, fetched)

    # --- device memory (the copy engine: the one hook to memory the CPU cannot touch) ---
    def attach_copy_engine(self, engine):
        """Let this NIC's engine reach device memory (``reg_mr(device_memory=True)`` ranges, its
        own and mapped peers'): ``engine`` is a gpunet/host/platform.py CopyEngine (``copy_fn``,
        ``sync_fn``, ``kind``, ``stream``, ``set_device_fn``, ``device``; Platform.copy_engine)
        or a stand-in with the same attributes (the C functions' addresses). The NIC keeps it and
        closes it after its engine thread stopped. Without one, a WQE touching device memory
        completes in error (local protection / remote access)."""
        self._check_open()
        T = self._arena.T
        T[H_DMA_SYNC] = int(engine.sync_fn)
        T[H_DMA_KIND] = int(engine.kind)
        T[H_DMA_STREAM] = int(engine.stream or 0)
        T[H_DMA_SETDEV] = int(getattr(engine, "set_device_fn", 0) or 0)
        T[H_DMA_DEVICE] = int(getattr(engine, "device", 0) or 0)
        T[H_DMA_COPY] = int(engine.copy_fn)         # last: the hook becomes usable
        self._copy_engine = engine

    def add_peer_memory(self, remote_qp_info, remote_addr, nbytes, local_addr):
        """The device memory ``[remote_addr, remote_addr + nbytes)`` that the peer NIC behind
        ``remote_qp_info`` (a QP ``info()`` already passed to ``connect``) registered with
        ``device_memory=True`` is reachable in this process at ``local_addr`` (a CUDA IPC
        mapping of it): this NIC's engine reads and writes it there, through the copy engine.
        One range per peer NIC (its symmetric heap); a later call replaces it."""
        self._check_open()
        try:
            arena = str(remote_qp_info["arena"])
        except (KeyError, TypeError):
            raise ConfigError("add_peer_memory needs a QP.info() dict")
        slot = self._peers.get(arena)
        if slot is None:
            raise ConfigError("add_peer_memory: no QP of this NIC is connected to %s yet" % arena)
        e = DEVMAP_BASE + DEVMAP_WORDS * slot
        T = self._arena.T
        T[e + 2] = 0                                # unusable while it changes
        T[e], T[e + 1] = int(remote_addr), int(nbytes)
        T[e + 2] = int(local_addr)

    def dereg_mr(self, mr, timeout_s=10.0):
        """Invalidate ``mr``'s keys; return once no WQE moves bytes of it any more (as an HCA's
        deregistration: the caller may free the memory then). A WQE that reaches it later
        completes with a protection error. Local segments are this NIC's: its executor lock is
        taken once, so a pass that checked the lkey before has ended; a WQE of any NIC that
        writes or reads it as the responder holds its M_BUSY word while the bytes move."""
        self._check_open()
        with self._lock:
            T = self._arena.T
            me = MR_BASE + mr.index * MR_WORDS
            if int(T[me + M_KEY]) != mr.lkey:
                return
            T[me + M_KEY] = 0
            base = self._arena.base
            deadline = time.monotonic() + timeout_s
            while int(T[me + M_BUSY]) != 0 or not _exec_barrier(base):
                if time.monotonic() > deadline:
                    raise GpunetError("dereg_mr: region 0x%x of %s still in use by a WQE after %g s"
                                      % (mr.addr, self.arena_name, timeout_s))
                time.sleep(20e-6)
            self._mr_free.append(mr.index)

    def evict(self, mr, offset=0, length=None):
        """An L2 eviction event for the 128-byte lines covering [offset, offset+length) of ``mr``.

        Only c500 ``device`` regions have anything to do: bytes the SM changed since the line was
        filled reach the HBM image (what the NIC sees); then the line is refilled from HBM, so the
        SM sees what the NIC wrote. Elsewhere it is a no-op.
        """
        self._check_open()
        if mr.hbm is None:
            return
        length = mr.length - offset if length is None else int(length)
        if offset < 0 or length < 0 or offset + length > mr.length:
            raise ConfigError("evict range [%d, %d) outside the MR (%d bytes)"
                              % (offset, offset + length, mr.length))
        if length == 0:
            return
        a0 = (mr.addr + offset) & ~(LINE_BYTES - 1)
        a1 = (mr.addr + offset + length + LINE_BYTES - 1) & ~(LINE_BYTES - 1)
        start, end = max(a0 - mr.addr, 0), min(a1 - mr.addr, mr.length)
        _evict(u8_view(mr.addr, mr.length), mr.hbm, mr.fetched, start, end)

    # --- queues ---
    def create_cq(self, cqe_cnt=256, collapsed=False):
        """A CQ: owner-bit ring of ``cqe_cnt`` (power of two) CQEs, or one collapsed slot."""
        self._check_open()
        cqe_cnt = 1 if collapsed else int(cqe_cnt)
        if cqe_cnt < 1 or cqe_cnt & (cqe_cnt - 1) or cqe_cnt > (1 << 22):
            raise ConfigError("cqe_cnt must be a power of two in [1, 2**22], not %r" % cqe_cnt)
        buf = self.alloc(cqe_cnt * mlx5.CQE_SIZE, 64)
        dbrec = self.alloc(mlx5.DBREC_SIZE, 64)
        mlx5.init_cq(buf, cqe_cnt)
        with self._lock:
            T = self._arena.T
            cqn = int(T[H_NCQ])
            if cqn >= MAX_CQ:
                raise ConfigError("CQ table full (%d CQs)" % MAX_CQ)
            T[H_NCQ] = cqn + 1
            ce = CQ_BASE + cqn * CQ_WORDS
            T[ce + C_BUF_OFF] = address_of(buf) - self._arena.base
            T[ce + C_CNT] = cqe_cnt
            T[ce + C_DBREC_OFF] = address_of(dbrec) - self._arena.base
            T[ce + C_COLLAPSED] = int(bool(collapsed))
            T[ce + C_VALID] = 1
        return CQ(self, cqn, buf, dbrec, cqe_cnt, bool(collapsed))

    def cq_state(self, cq):
        """"OK", or "ERR" after an overrun (no CQE is written into it any more)."""
        self._check_open()
        return "ERR" if self._arena.T[CQ_BASE + cq.cqn * CQ_WORDS + C_STATE] else "OK"

    def create_qp(self, send_cq, recv_cq=None, sq_wqebbs=256, max_inline=256, pd=None):
        """An RC QP (state INIT until ``connect``). recv_cq (responder CQEs) defaults to send_cq."""
        self._check_open()
        recv_cq = send_cq if recv_cq is None else recv_cq
        for c in (send_cq, recv_cq):
            if not isinstance(c, CQ) or c.nic is not self:
                raise ConfigError("create_qp needs CQs of this NIC")
        sq_wqebbs = int(sq_wqebbs)
        if sq_wqebbs < MIN_SQ_WQEBBS or sq_wqebbs > MAX_SQ_WQEBBS or sq_wqebbs & (sq_wqebbs - 1):
            raise ConfigError("sq_wqebbs must be a power of two in [%d, %d], not %d"
                              % (MIN_SQ_WQEBBS, MAX_SQ_WQEBBS, sq_wqebbs))
        max_inline = int(max_inline)
        if not 0 <= max_inline <= MAX_INLINE_LIMIT:
            raise ConfigError("max_inline must be in [0, %d]" % MAX_INLINE_LIMIT)
        pd = self.default_pd if pd is None else pd
        if not isinstance(pd, PD) or pd.nic is not self:
            raise ConfigError("pd must be a PD of this NIC")
        sq = self.alloc(sq_wqebbs * mlx5.WQEBB, 4096)
        dbrec = self.alloc(mlx5.DBREC_SIZE, 64)
        db = self.alloc(8, 64)
        with self._lock:
            T = self._arena.T
            qpn = int(T[H_NQP])
            if qpn >= MAX_QP:
                raise ConfigError("QP table full (%d QPs)" % MAX_QP)
            qe = QP_BASE + qpn * QP_WORDS
            b = self._arena.base
            T[qe + Q_PD] = pd.pdn
            T[qe + Q_SQ_OFF] = address_of(sq) - b
            T[qe + Q_SQ_WQEBBS] = sq_wqebbs
            T[qe + Q_DBREC_OFF] = address_of(dbrec) - b
            T[qe + Q_DB_OFF] = address_of(db) - b
            T[qe + Q_SCQ] = send_cq.cqn
            T[qe + Q_RCQ] = recv_cq.cqn
            T[qe + Q_MAX_INLINE] = max_inline
            T[qe + Q_STATE] = QPS_INIT
            T[H_NQP] = qpn + 1
        return QP(self, qpn, sq, sq_wqebbs, dbrec, db, send_cq, recv_cq, max_inline, pd)

    def connect(self, qp, remote_qp_info):
        """Connect ``qp`` to the QP ``remote_qp_info`` (another QP's ``info()``, any process).

        Both sides call it (like RTR with the peer's QPN); the QP then executes what is posted.
        """
        self._check_open()
        if not isinstance(qp, QP) or qp.nic is not self:
            raise ConfigError("connect needs a QP of this NIC")
        try:
            arena, rqpn = str(remote_qp_info["arena"]), int(remote_qp_info["qpn"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError("remote_qp_info must be a QP.info() dict")
        with self._lock:
            slot = self._peers.get(arena)
            if slot is None:
                if len(self._peer_arenas) >= MAX_PEERS:
                    raise ConfigError("too many peer NICs (%d)" % MAX_PEERS)
                a = _Arena(arena)
                if int(a.T[H_MAGIC]) != ARENA_MAGIC:
                    a.close()
                    raise ConfigError("%s is not a soft NIC arena" % arena)
                slot = len(self._peer_arenas)
                self._peer_arenas.append(a)
                self._peers[arena] = slot
                self._peer_bases[slot] = a.base
            P = self._arena.T if slot == 0 else self._peer_arenas[slot].T
            if not (1 <= rqpn < int(P[H_NQP])) or int(P[QP_BASE + rqpn * QP_WORDS + Q_STATE]) == 0:
                raise ConfigError("remote QP %d does not exist in %s" % (rqpn, arena))
            T = self._arena.T
            qe = QP_BASE + qp.qpn * QP_WORDS
            T[qe + Q_PEER_SLOT] = slot
            T[qe + Q_PEER_QPN] = rqpn
            if int(T[qe + Q_STATE]) == QPS_INIT:
                T[qe + Q_STATE] = QPS_RTS

    def qp_state(self, qp):
        self._check_open()
        return _QP_STATE_NAMES.get(int(self._arena.T[QP_BASE + qp.qpn * QP_WORDS + Q_STATE]), "?")

    def qp_sq_ci(self, qp):
        """The engine's position in the SQ (16 bits): the next WQEBB it will execute."""
        self._check_open()
        return int(self._arena.T[QP_BASE + qp.qpn * QP_WORDS + Q_SQ_CI])

    def qp_error_syndrome(self, qp):
        """The syndrome that moved ``qp`` to ERR (mlx5 SYNDROME_*; -1: its CQ overran), or 0."""
        self._check_open()
        return int(self._arena.T[QP_BASE + qp.qpn * QP_WORDS + Q_ERR_SYND])

    def reset_qp(self, qp, timeout_s=5.0):
        """Bring ``qp`` back to RTS with the same connection, as a consumer does to reuse a QP
        after an error (ibv_modify_qp ERR -> RESET -> INIT -> RTR -> RTS).

        1. The engine first finishes every WQE rung so far (a QP in error flushes them with
           WR_FLUSH_ERR CQEs), so no work posted before the reset is left half-done.
        2. The QP is parked in RESET, which the engine skips, until the engine has finished a whole
           pass: from then on nothing of the QP's old life executes or completes.
        3. Its send queue restarts empty at WQE counter 0 (consumer index, latched doorbell,
           doorbell record and doorbell word cleared; error syndrome forgotten), then it is RTS.

        The CQs are not touched. Returns the send CQ's producer index (CQEs written so far): a
        consumer that owns that CQ alone skips to it, since every CQE before it is of the old life
        (gpunet/device/descriptors.py QpDescriptor.reset). Raises GpunetError if the engine does not drain or
        pass within ``timeout_s`` (a NIC marked down never does). A reset_qp that raised in
        step 2 leaves the QP in RESET; calling reset_qp again is the retry (it starts at step 2).
        tests/test_softnic.py::test_reset_qp_after_a_protection_error_returns_to_rts_and_works,
        ::test_reset_qp_that_failed_after_parking_the_qp_in_reset_can_be_retried.
        """
        self._check_open()
        if not isinstance(qp, QP) or qp.nic is not self:
            raise ConfigError("reset_qp needs a QP of this NIC")
        T = self._arena.T
        qe = QP_BASE + qp.qpn * QP_WORDS
        state = int(T[qe + Q_STATE])
        if state not in (QPS_RTS, QPS_ERR, QPS_RESET):
            raise ConfigError("reset_qp: QP %d is %s, not RTS or ERR (or RESET: the retry of a "
                              "reset_qp that failed)" % (qp.qpn, self.qp_state(qp)))
        db = self._arena.u8[int(T[qe + Q_DB_OFF]):int(T[qe + Q_DB_OFF]) + 8].view(np.int64)
        deadline = time.monotonic() + timeout_s

        def wait(cond, what):
            while not cond():
                if time.monotonic() > deadline:
                    raise GpunetError("reset_qp: QP %d of %s: %s within %.1f s (is the engine "
                                      "running, the NIC not marked down?)"
                                      % (qp.qpn, self.arena_name, what, timeout_s))
                time.sleep(50e-6)

        if state != QPS_RESET:
            # in RESET (only an earlier reset_qp parks a QP there) the engine executes nothing:
            # that call drained what was rung before it, and a doorbell rung since is dropped
            # with the rest, as a NIC ignores what is posted to a QP in RESET
            wait(lambda: int(db[0]) == int(T[qe + Q_LAST_DB])
                 and int(T[qe + Q_SQ_CI]) == int(T[qe + Q_TARGET]),
                 "the engine did not finish the WQEs rung before the reset")
        base = self._arena.base
        for _ in range(3):               # an engine pass in flight may still store ERR over RESET
            T[qe + Q_STATE] = QPS_RESET
            it = int(T[H_ITERS])
            wait(lambda: int(T[H_ITERS]) >= it + 2, "the engine did not complete a pass")
            # a pass of a progress hook (a waiting caller's thread) may be in flight too: once
            # the executor lock has been ours, every pass that began before the RESET store has ended
            wait(lambda: _exec_barrier(base), "the executor lock was not released")
            if int(T[qe + Q_STATE]) == QPS_RESET:
                break
        else:
            raise GpunetError("reset_qp: QP %d of %s did not stay in RESET" % (qp.qpn, self.arena_name))
        for w in (Q_SQ_CI, Q_TARGET, Q_LAST_DB, Q_ERR_SYND, Q_DEAD_SINCE):
            T[qe + w] = 0
        db[0] = 0                        # no doorbell word is 0 (ds >= 1): the next ring is a change
        dbr = int(T[qe + Q_DBREC_OFF]) + 4 * mlx5.DBREC_SND
        self._arena.u8[dbr:dbr + 4] = 0
        ci = int(T[CQ_BASE + qp.send_cq.cqn * CQ_WORDS + C_PI])
        T[qe + Q_STATE] = QPS_RTS if int(T[qe + Q_PEER_QPN]) != 0 else QPS_INIT
        return ci

    def stats(self):
        """Counters: wqes executed, engine passes, heartbeat age."""
        self._check_open()
        T = self._arena.T
        return {"wqes": int(T[H_WQES]), "engine_passes": int(T[H_ITERS]),
                "heartbeat_age_s": (time.monotonic_ns() - int(T[H_HEARTBEAT])) / 1e9,
                "dma_copies": int(T[H_DMA_COPIES]), "dma_error": int(T[H_DMA_ERR]),
                "dma_stalls": int(T[H_DMA_STALLS]), "dma_stall_max_s": int(T[H_DMA_STALL_MAX_NS]) / 1e9}

    def timeout_hint(self):
        """Nic.timeout_hint: the copy-engine calls that stalled (took longer than DMA_STALL_NS)
        since this NIC started, if any."""
        st = self.stats()
        if st["dma_stalls"] == 0:
            return ""
        return ("this rank's soft NIC copy engine stalled %d time(s), up to %.3f s a copy: on CUDA "
                "its copies of device-heap bytes wait while another thread of this process is in a "
                "synchronous CUDA copy (e.g. a .cpu() queued behind the waiting kernel); wait with "
                "torch.cuda.synchronize() or an event first (bench/copy_engine_stall.py)"
                % (st["dma_stalls"], st["dma_stall_max_s"]))

    # --- coherence, liveness ---
    def check(self):
        """Strict mode: raise CoherenceViolation describing the first recorded violation."""
        self._check_open()
        T = self._arena.T
        if int(T[H_VIO_VALID]) == 0:
            return
        raise abi.coherence_error(T[H_VIO_QPN], T[H_VIO_OPCODE], T[H_VIO_KEY], T[H_VIO_ADDR],
                                  T[H_VIO_LEN], T[H_VIO_WRITE], T[H_VIO_PID], self.arena_name)

    def mark_down(self):
        """Make this NIC dead: its engine stops executing, peers time out with retry exceeded."""
        self._check_open()
        self._arena.T[H_DOWN] = 1

    def __repr__(self):
        return "SoftNic(%s, profile=%s%s)" % (self.arena_name, self.profile,
                                             ", closed" if self.closed else "")


class PeerHeap(Resource):
    """A range of a peer soft NIC's arena mapped into this process (SoftNic.map_peer_heap):
    ``base`` (address here), ``nbytes``, ``arena``, ``pid`` (the exporter). ``close()`` unmaps it
    (the mapping must not outlive the Context that uses it: tests/test_p2p.py checks
    /proc/self/maps)."""

    def __init__(self, name, pid, off, nbytes):
        self.arena = name
        self._a = _Arena(name)           # ConfigError when the file is gone (peer closed)
        try:
            if int(self._a.T[H_MAGIC]) != ARENA_MAGIC or int(self._a.T[H_PID]) != pid:
                raise ConfigError("%s is not the soft NIC arena of pid %d" % (name, pid))
            if not (0 <= off and 0 <= nbytes <= self._a.size - off):
                raise ConfigError("peer heap [%d, +%d) is outside arena %s (%d bytes)"
                                  % (off, nbytes, name, self._a.size))
        except BaseException:
            self._a.close()
            raise
        self.base, self.nbytes, self.pid = self._a.base + off, nbytes, pid

    def owner_alive(self):
        """False once the exporting rank is gone: its process exited (a killed rank leaves its
        arena file, and this mapping, behind) or its NIC was closed / marked down."""
        return not self.closed and pid_alive(self.pid) and int(self._a.T[H_DOWN]) == 0

    def _release(self):
        self._a.close()

    def __repr__(self):
        return "PeerHeap(%s, 0x%x, %d)" % (self.arena, self.base, self.nbytes)


def u8_view(addr, n):
    """A np.uint8 view of ``n`` bytes at virtual address ``addr`` of this process."""
    import ctypes
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))


def _unlink_quiet(name):
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        pass


@atexit.register
def _close_all():
    for nic in list(_open_nics):
        try:
            nic.close()
        except Exception:
            pass
