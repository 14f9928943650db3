"""The CPU proxy transport: device code pushes 16-byte commands into host-mapped FIFOs; CPU threads
drain them, build mlx5 WQEs into the peer QP's send queue, ring its doorbell, poll its CQ and
report completions back through counters the device polls.

This module is the CPU side of ``gpunet/device/include/gpunet/proxy.cuh``: the command format, the
channel's memory layout and the completion protocol are defined there, the format and the layout
are mirrored in gpunet/device/abi.py (``PROXY_*``, imported here under their short names) and
tests/test_proxy.py checks the mirror against the compiled header. Read the header's top comment
for the protocol; in short:

Command (two little-endian 64-bit words, 16 bytes, 16-byte aligned in the ring)::

    w0  bit 63      VALID      lap parity: a command for sequence s carries ((s / depth) & 1) ^ 1,
                               so lap 0 writes 1 into the zeroed ring and nobody ever clears a slot
        bits 58..62 OP         OP_* below
        bits 46..57 PEER       destination rank (12 bits: 4096 peers)
        bits 39..45 LOCAL_HI   local heap offset bits 32..38
        bits 32..38 REMOTE_HI  remote heap offset bits 32..38
        bits  0..31 ARG        PUT/GET: bytes; SIGNAL_ADD/SIGNAL_SET: low 32 bits of the 64-bit
                               value; ATOMIC_FA, OPERAND: 0
    w1  bits  0..31 LOCAL_LO   local heap offset bits 0..31 (SIGNAL_*: the value's high 32 bits)
        bits 32..63 REMOTE_LO  remote heap offset bits 0..31
                               (OPERAND: w1 is a whole 64-bit value)

ATOMIC_FA is two commands in one reservation: the header (result offset in LOCAL, word offset in
REMOTE) in slot s, then OPERAND carrying the 64-bit addend in w1 in slot s + 1. The drain takes the
pair only once both slots are valid and completes the operand with its header
(:func:`atomic_fa_commands` builds the pair).

Offsets are 39 bits (512 GiB heaps); sizes are 32 bits because an mlx5 data segment's byte_count
is 32 bits anyway (the proxy splits a PUT/GET above ``MAX_WQE_BYTES`` into several WQEs).

Host-mapped control block of a channel (``HostCtrl``, 64 bytes, written only by its proxy thread):
``tail`` (slots consumed), ``completed`` (every command with sequence < completed has completed at
the NIC; its top bit, COMPLETED_ERROR, is set in every value published once ``error`` holds a
failure, so a device quiet reads one word per poll), ``error`` (0, or the first failure, packed:
see ``pack_error``), ``err_seq`` (the sequence of the command that failed). Device control block (``DevCtrl``, device memory, written only by
producers): ``head`` (slots reserved) at byte 0, ``cached_tail`` at byte 64.

Threads: ``ProxyEngine(threads=n)`` runs n threads, each running one numba loop without the GIL
(``proxy_run``) over the channels and QPs it owns (channel i -> thread i % n; each thread owns its
own QPs of every peer, so no QP is shared between threads and nothing is locked).
"""
import threading
import weakref

import numpy as np
from numba import cfunc, types

from gpunet import mlx5
from gpunet.device import abi
# The command format and the channel's control blocks (proxy.cuh), as gpunet/device/abi.py mirrors them
# (PROXY_*), under the names the drain uses; tests and benchmarks read them here too (P.OP_PUT).
from gpunet.device.abi import (  # noqa: F401
    PROXY_CMD_BYTES as CMD_BYTES, PROXY_OP_NOP as OP_NOP, PROXY_OP_PUT as OP_PUT,
    PROXY_OP_GET as OP_GET, PROXY_OP_SIGNAL_ADD as OP_SIGNAL_ADD,
    PROXY_OP_ATOMIC_FA as OP_ATOMIC_FA, PROXY_OP_SIGNAL_SET as OP_SIGNAL_SET,
    PROXY_OP_OPERAND as OP_OPERAND, PROXY_OP_MAX as OP_MAX, PROXY_OP_NAMES as OP_NAMES,
    PROXY_VALID_SHIFT as VALID_SHIFT, PROXY_OP_SHIFT as OP_SHIFT, PROXY_OP_MASK as OP_MASK,
    PROXY_PEER_SHIFT as PEER_SHIFT, PROXY_PEER_MASK as PEER_MASK,
    PROXY_LOCAL_HI_SHIFT as LOCAL_HI_SHIFT, PROXY_REMOTE_HI_SHIFT as REMOTE_HI_SHIFT,
    PROXY_HI_MASK as HI_MASK, PROXY_ARG_MASK as ARG_MASK, PROXY_OFFSET_BITS as OFFSET_BITS,
    PROXY_MAX_OFFSET as MAX_OFFSET, PROXY_MAX_PEERS as MAX_PEERS, PROXY_MAX_SIZE as MAX_SIZE,
    PROXY_HOST_CTRL_BYTES as HOST_CTRL_BYTES, PROXY_HC_TAIL as HC_TAIL,
    PROXY_HC_COMPLETED as HC_COMPLETED, PROXY_HC_ERROR as HC_ERROR, PROXY_HC_ERR_SEQ as HC_ERR_SEQ,
    PROXY_HC_ERR_PEER as HC_ERR_PEER, PROXY_COMPLETED_ERROR as COMPLETED_ERROR,
    PROXY_DEV_CTRL_BYTES as DEV_CTRL_BYTES,
    PROXY_DC_HEAD as DC_HEAD, PROXY_DC_CACHED_TAIL as DC_CACHED_TAIL, PROXY_ERR_NONE as ERR_NONE,
    PROXY_ERR_CQE as ERR_CQE, PROXY_ERR_BAD_COMMAND as ERR_BAD_COMMAND)
from gpunet.errors import CloseError, ClosedError, ConfigError, GpunetError
from gpunet.errors import TimeoutError as GpunetTimeoutError
from gpunet.host import progress, wq
from gpunet.host.rawmem import (IDLE_SLEEP_MAX_US, aligned_zeros, atomic_cas_u64,
                                atomic_fetch_add_u64, clock_ns, engine_thread_start, i32_ptr,
                                i64_ptr, idle_pause, load_acquire_u64, store_release_u64, u64_at,
                                u8_at, u8_ptr, wire_njit)
from gpunet.resource import Resource

# ---- engine tuning (named, with the reason) --------------------------------------------------
# ConnectX-5/6/7 report max_msg_sz = 1 GiB: a larger PUT/GET is split into WQEs of this size.
MAX_WQE_BYTES = 1 << 30
# Request a CQE every SIGNAL_EVERY WQEs per QP (and on the last WQE of each drained batch, so a
# lone command completes without waiting for 31 more). 32 keeps CQ polling off the per-command
# path while reclaiming SQ space well before a 256-WQEBB ring fills.
SIGNAL_EVERY = 32
# Publish the tail at least every TAIL_PUBLISH_EVERY commands inside a long drain (and at the end
# of every drain pass). Producers read the published tail over PCIe only when their cached tail
# says the ring is full, so a coarse publish costs them nothing while the ring has room.
TAIL_PUBLISH_EVERY = 64
# CQEs copied out of a CQ per wq.poll_cq call.
CQE_POLL_BATCH = 64
# Commands one thread takes from one channel before moving to the next (fairness, doorbell batch).
DRAIN_BATCH = 256
# After its last work a proxy thread spins SPIN_US (polling FIFOs and CQs, no syscall), then
# follows rawmem's idle policy (yield, then a bounded sleep) without leaving numba. The default is
# no spin: on a machine with fewer cores than polling threads, a spinning proxy holds the core the
# soft NIC's engine and the device threads need (2-core CI machine, 64-byte put + quiet through
# the proxy: 211 us with 50 us of spin, 62 us without); a benchmark on a machine with cores to
# spare passes spin_us (bench/proxy.py: 10 ms) to keep the round trip near the FIFO's floor
# (FACTS: 2.85 us GPU<->CPU). The thread never returns to Python while it runs, so a main thread
# holding the GIL cannot delay it (a return to Python waits for the GIL: up to the 5 ms switch
# interval).
SPIN_US = 0
# How long close() waits for each proxy thread after setting its stop word. A thread polls the
# word between passes and sleeps at most IDLE_SLEEP_MAX_US (or its NIC's cap, ~1 ms) when idle, so
# a healthy one is gone within milliseconds; one still running after this is stuck inside a pass
# (a NIC hook or a wait that never ends), and close() names it instead of hanging on it.
THREAD_JOIN_S = 5.0

# ---- engine state layout (numba arrays) ------------------------------------------------------
# per channel, int64
CH_FIFO, CH_DEPTH, CH_HCTRL, CH_TAIL, CH_COMPLETED, CH_PUB_TAIL, CH_PUB_COMPLETED, CH_ERR, \
    CH_QPSLOT, CH_NFIELDS = range(10)
# per QP, int64
(QP_SQ, QP_WQEBBS, QP_QPN, QP_DBREC, QP_DB, QP_CQ, QP_CQE_CNT, QP_CQ_DBREC, QP_PI, QP_SQ_CI,
 QP_CQ_CI, QP_UNSIG, QP_LAST_UNSIG, QP_DIRTY, QP_RBASE, QP_RKEY, QP_SCRATCH, QP_SCRATCH_LKEY,
 QP_NULL, QP_PEER, QP_SIGNAL_BE, QP_NFIELDS) = range(22)
# heap, int64
HP_LBASE, HP_LKEY, HP_NFIELDS = range(3)
# stats, int64 per thread
ST_COMMANDS, ST_WQES, ST_DOORBELLS, ST_CQES, ST_PASSES, ST_NFIELDS = range(6)


# ---- encoding ---------------------------------------------------------------------------------
@wire_njit(cache=True, inline="always")
def encode(op, peer, arg, local_off, remote_off):
    """The two command words, valid bit clear: (w0, w1). ``arg`` is taken modulo 2**32."""
    loff = np.uint64(local_off)
    roff = np.uint64(remote_off)
    w0 = ((np.uint64(op) & np.uint64(OP_MASK)) << np.uint64(OP_SHIFT)) \
        | ((np.uint64(peer) & np.uint64(PEER_MASK)) << np.uint64(PEER_SHIFT)) \
        | (((loff >> np.uint64(32)) & np.uint64(HI_MASK)) << np.uint64(LOCAL_HI_SHIFT)) \
        | (((roff >> np.uint64(32)) & np.uint64(HI_MASK)) << np.uint64(REMOTE_HI_SHIFT)) \
        | (np.uint64(arg) & np.uint64(ARG_MASK))
    w1 = (loff & np.uint64(ARG_MASK)) | ((roff & np.uint64(ARG_MASK)) << np.uint64(32))
    return w0, w1


@wire_njit(cache=True, inline="always")
def encode_signal(op, peer, value, remote_off):
    """SIGNAL_ADD / SIGNAL_SET: the 64-bit value rides in ARG (low half) and LOCAL_LO (high half).

    ``value``: any int in 0 .. 2**64 - 1 from Python (rawmem.wire_njit), a 64-bit word in numba."""
    v = np.uint64(value)
    return encode(op, peer, v & np.uint64(ARG_MASK), v >> np.uint64(32), remote_off)


@wire_njit(cache=True, inline="always")
def cmd_op(w0):
    return np.int64((np.uint64(w0) >> np.uint64(OP_SHIFT)) & np.uint64(OP_MASK))


@wire_njit(cache=True, inline="always")
def cmd_peer(w0):
    return np.int64((np.uint64(w0) >> np.uint64(PEER_SHIFT)) & np.uint64(PEER_MASK))


@wire_njit(cache=True, inline="always")
def cmd_arg(w0):
    return np.int64(np.uint64(w0) & np.uint64(ARG_MASK))


@wire_njit(cache=True, inline="always")
def cmd_local_off(w0, w1):
    return np.int64((np.uint64(w1) & np.uint64(ARG_MASK))
                    | (((np.uint64(w0) >> np.uint64(LOCAL_HI_SHIFT)) & np.uint64(HI_MASK)) << np.uint64(32)))


@wire_njit(cache=True, inline="always")
def cmd_remote_off(w0, w1):
    return np.int64((np.uint64(w1) >> np.uint64(32))
                    | (((np.uint64(w0) >> np.uint64(REMOTE_HI_SHIFT)) & np.uint64(HI_MASK)) << np.uint64(32)))


@wire_njit(cache=True, inline="always")
def cmd_signal_value(w0, w1):
    return (np.uint64(w1) << np.uint64(32)) | (np.uint64(w0) & np.uint64(ARG_MASK))


def atomic_fa_commands(peer, addend, local_off, remote_off):
    """The two commands of an ATOMIC_FA (one reservation): [(w0, w1) header, (w0, w1) OPERAND].
    ``addend`` is any integer, taken modulo 2**64 (two's complement: -1 decrements)."""
    hw0, hw1 = encode(OP_ATOMIC_FA, peer, 0, local_off, remote_off)
    ow0, _ = encode(OP_OPERAND, peer, 0, 0, 0)
    return [(int(hw0), int(hw1)), (int(ow0), int(addend) & 0xFFFFFFFFFFFFFFFF)]


@wire_njit(cache=True, inline="always")
def valid_bit(seq, log2_depth):
    """The VALID bit a command of sequence ``seq`` carries: not the parity of its lap."""
    return np.uint64(((np.int64(seq) >> log2_depth) & 1) ^ 1)


def decode(w0, w1):
    """A dict of a command's fields (Python; for tests, logs and error messages)."""
    w0, w1 = int(w0), int(w1)
    op = (w0 >> OP_SHIFT) & OP_MASK
    d = {"valid": w0 >> VALID_SHIFT, "op": op, "peer": (w0 >> PEER_SHIFT) & PEER_MASK,
         "arg": w0 & ARG_MASK,
         "local_off": (w1 & ARG_MASK) | (((w0 >> LOCAL_HI_SHIFT) & HI_MASK) << 32),
         "remote_off": (w1 >> 32) | (((w0 >> REMOTE_HI_SHIFT) & HI_MASK) << 32)}
    if op in (OP_SIGNAL_ADD, OP_SIGNAL_SET):
        d["value"] = ((w1 & ARG_MASK) << 32) | (w0 & ARG_MASK)
    if op == OP_OPERAND:
        d["value"] = w1
    return d


@wire_njit(cache=True, inline="always")
def pack_error(code, syndrome, vendor_syndrome, wqe_counter, qpn):
    return ((np.uint64(code) & np.uint64(0xFF)) << np.uint64(56)) \
        | ((np.uint64(syndrome) & np.uint64(0xFF)) << np.uint64(48)) \
        | ((np.uint64(vendor_syndrome) & np.uint64(0xFF)) << np.uint64(40)) \
        | ((np.uint64(wqe_counter) & np.uint64(0xFFFF)) << np.uint64(24)) \
        | (np.uint64(qpn) & np.uint64(0xFFFFFF))


def unpack_error(word):
    """(code, syndrome, vendor_syndrome, wqe_counter, qpn) of a packed HostCtrl.error word."""
    w = int(word)
    return (w >> 56) & 0xFF, (w >> 48) & 0xFF, (w >> 40) & 0xFF, (w >> 24) & 0xFFFF, w & 0xFFFFFF


# ---- a CPU producer: exactly what proxy.cuh's proxy_push does, in numba ----------------------


@wire_njit(cache=True, inline="always")
def _log2(n):
    k = 0
    while (1 << k) < n:
        k += 1
    return k


@wire_njit(cache=True, nogil=True)
def cpu_push(fifo, depth, hctrl, dctrl, w0, w1, n, timeout_ns):
    """Push ``n`` commands (arrays ``w0[:n]``, ``w1[:n]``, valid bits clear) with ONE reservation,
    as a warp does in proxy_push_warp. Returns the channel's issue count after them (``seq + n``;
    pass it to a quiet), or -1 if no space appeared within ``timeout_ns`` (the reserved slots are
    then never written: the channel is poisoned, exactly as on the device; see proxy.cuh).

    Space check: reads the shared cached tail (DevCtrl, cheap); only when that says full does it
    read the host-published tail, with a doubling backoff, and raise the cached tail with a CAS.
    """
    if n < 1 or n > depth:
        return -2                                # can never fit (proxy_push_n: BAD_ARGUMENT)
    seq = np.int64(atomic_fetch_add_u64(dctrl + 8 * DC_HEAD, n))
    need = seq + n - depth
    ct = np.int64(load_acquire_u64(dctrl + 8 * DC_CACHED_TAIL))
    if ct < need:
        t0 = clock_ns()
        backoff = 1
        while True:
            t = np.int64(load_acquire_u64(hctrl + 8 * HC_TAIL))
            # raise the cached tail to t (monotonic max)
            cur = np.int64(load_acquire_u64(dctrl + 8 * DC_CACHED_TAIL))
            while cur < t:
                old = np.int64(atomic_cas_u64(dctrl + 8 * DC_CACHED_TAIL, cur, t))
                if old == cur:
                    break
                cur = old
            if t >= need:
                break
            if clock_ns() - t0 > timeout_ns:
                return -1
            for _ in range(backoff):
                pass
            if backoff < 1024:
                backoff *= 2
    lg = _log2(depth)
    for i in range(n):
        s = seq + i
        slot = fifo + (s & (depth - 1)) * CMD_BYTES
        store_release_u64(slot + 8, w1[i])
        store_release_u64(slot, np.uint64(w0[i]) | (valid_bit(s, lg) << np.uint64(VALID_SHIFT)))
    return seq + n


@wire_njit(cache=True, nogil=True)
def fill_holes(fifo, depth, tail, head, nop_w0):
    """Write a NOP (``nop_w0``, valid for its lap) into every slot of [tail, min(head, tail +
    depth)) that does not hold a command of its own lap: slots a producer reserved and never wrote
    (proxy.cuh: a push that gave up). Slots from ``tail + depth`` on still hold the previous lap's
    commands and are left alone. No producer may be running. Returns how many were written."""
    lg = _log2(depth)
    end = min(head, tail + depth)
    n = 0
    for s in range(tail, end):
        slot = fifo + (s & (depth - 1)) * CMD_BYTES
        vb = valid_bit(s, lg)
        if (load_acquire_u64(slot) >> np.uint64(VALID_SHIFT)) != vb:
            store_release_u64(slot + 8, np.uint64(0))
            store_release_u64(slot, np.uint64(nop_w0) | (vb << np.uint64(VALID_SHIFT)))
            n += 1
    return n


@wire_njit(cache=True, nogil=True)
def cpu_wait_completed(hctrl, issued, timeout_ns):
    """Bounded wait until HostCtrl.completed >= issued; returns 0, or the packed error word, or
    -1 on timeout (proxy_quiet's CPU twin)."""
    t0 = clock_ns()
    while True:
        done = load_acquire_u64(hctrl + 8 * HC_COMPLETED)     # one word, as proxy_quiet reads it
        if (done & np.uint64(COMPLETED_ERROR)) != 0:
            err = load_acquire_u64(hctrl + 8 * HC_ERROR)
            return np.int64(err & np.uint64(0x7FFFFFFFFFFFFFFF))
        if np.int64(done) >= issued:
            return 0
        if clock_ns() - t0 > timeout_ns:
            return -1


# ---- the drain step ----------------------------------------------------------------------------
# Rule: the per-command path reaches the engine's state through typed pointers (rawmem.i64_ptr,
# i32_ptr, u8_ptr), never through numpy arrays. Why: numba increments and decrements the
# reference count of every array handed to a helper, inlined or not, each an out-of-line call
# with an atomic on the array's meminfo, and with the state arrays passed down three helper
# levels that was ~20 such calls and the register spills around them per command: most of the
# drain's cost (H200 host: ~113 ns a command, a locked add costing more on its CPU than on the CI
# machine's). The arrays become pointers once per engine thread (_state) and every helper below
# takes the state tuple ``S`` and scalars. The per-command helpers are inline="always" (numba's
# IR inlining), and so are the mlx5 builders they call; _drain and _poll_cq, the two a pass calls
# once per channel / QP, are not: numba's IR inlining grows superlinearly, and with them inlined
# into _pass a cold compile of _pass took 101 s on the 2-core CI VM (two rank processes compiling
# at once then outran the tests' 120 s init; CI stop 15), 24 s without, at the same drain rate
# (bench/proxy.py drain-only prefilled, one thread: 62 M cmd/s before, 65 / 68 after; without
# _issue inlined too: 13 s, 52 M). tests/test_proxy.py::test_drain_helpers_make_no_reference_count_calls
# guards the rule; bench/proxy.py's drain-only rows measure it.
#
# The state tuple S (_state): (ch, done, done_stride, qp, side_ch, side_seq, side_stride,
# peer_qp, npeer, qps_per_peer, lbase, lkey), the arrays as pointers to their first element; a
# row r of a 2-D array starts at r * its row length (CH_NFIELDS, QP_NFIELDS, the strides).
@wire_njit(cache=True, inline="always")
def _state(ch, done, qp, side_ch, side_seq, peer_qp, heap):
    return _state_at(ch.ctypes.data, done.ctypes.data, done.shape[1], qp.ctypes.data,
                     side_ch.ctypes.data, side_seq.ctypes.data, side_ch.shape[1],
                     peer_qp.ctypes.data, peer_qp.shape[0], peer_qp.shape[1], heap[HP_LBASE],
                     heap[HP_LKEY])


@wire_njit(cache=True, inline="always")
def _state_at(ch, done, done_stride, qp, side_ch, side_seq, side_stride, peer_qp, npeer, k, lbase,
              lkey):
    """S from the arrays' addresses and sizes (_state; the progress hook's packed words)."""
    return (i64_ptr(ch), u8_ptr(done), done_stride, i64_ptr(qp), i32_ptr(side_ch),
            i64_ptr(side_seq), side_stride, i64_ptr(peer_qp), npeer, k, lbase, lkey)


@wire_njit(cache=True, inline="always")
def _published(chp, cb, comp):
    """The HostCtrl.completed word for ``comp`` completed commands: with COMPLETED_ERROR once the
    channel recorded a failure (proxy.cuh: quiet reads this one word per poll)."""
    v = np.uint64(comp)
    if chp[cb + CH_ERR] != 0:
        v |= np.uint64(COMPLETED_ERROR)
    return v


@wire_njit(cache=True, inline="always")
def _record_error(chp, c, word, seq, peer):
    """The channel's first failure: err_seq, err_peer, error, then COMPLETED_ERROR in the published
    completed (this one and every later one: _published), which is what proxy_quiet polls."""
    cb = c * CH_NFIELDS
    if chp[cb + CH_ERR] == 0:                    # first failure wins
        chp[cb + CH_ERR] = 1
        h = chp[cb + CH_HCTRL]
        store_release_u64(h + 8 * HC_ERR_SEQ, np.uint64(seq))
        store_release_u64(h + 8 * HC_ERR_PEER, np.uint64(peer))
        store_release_u64(h + 8 * HC_ERROR, word)
        store_release_u64(h + 8 * HC_COMPLETED, _published(chp, cb, chp[cb + CH_PUB_COMPLETED]))


@wire_njit(cache=True, inline="always")
def _mark_done(S, c, seq):
    """Command ``seq`` of channel ``c`` completed. The next one in order (the common case: one QP
    completes in order, drain-only at once) advances CH_COMPLETED directly; any other waits in
    ``done`` for _advance_completed."""
    chp, donep, dstride = S[0], S[1], S[2]
    cb = c * CH_NFIELDS
    if seq == chp[cb + CH_COMPLETED]:
        chp[cb + CH_COMPLETED] = seq + 1
    else:
        donep[c * dstride + (seq & (chp[cb + CH_DEPTH] - 1))] = 1


@wire_njit(cache=True, inline="always")
def _post(S, q, c, seq, last, opcode, raddr, rkey, laddr, lkey, nbytes, value, inline_set):
    """Build one WQE at the QP's producer index through gpunet/host/wq.py (gpunet.mlx5's builders).

    Signalling: every SIGNAL_EVERY-th WQE asks for a CQE; the last WQE of a drained batch gets
    CQ_UPDATE set in ``_ring`` before the doorbell (the ring is not rung yet, so editing the ctrl
    byte is safe), so nothing posted is ever left without a CQE behind it.
    """
    qpp, side_ch, side_seq, sstride = S[3], S[4], S[5], S[6]
    qb = q * QP_NFIELDS
    nbb = qpp[qb + QP_WQEBBS]
    pi = qpp[qb + QP_PI]
    sq = qpp[qb + QP_SQ]
    qpn = qpp[qb + QP_QPN]
    fm = 0
    unsig = qpp[qb + QP_UNSIG] + 1
    if unsig >= SIGNAL_EVERY:
        fm = mlx5.WQE_CTRL_CQ_UPDATE
        qpp[qb + QP_UNSIG] = 0
        qpp[qb + QP_LAST_UNSIG] = -1
    else:
        qpp[qb + QP_UNSIG] = unsig
        qpp[qb + QP_LAST_UNSIG] = (pi & (nbb - 1)) * mlx5.WQEBB
    if opcode == mlx5.OPCODE_ATOMIC_FA:
        wq.post_atomic(sq, nbb, pi, qpn, opcode, fm, raddr, rkey, laddr, lkey, value, 0)
    elif inline_set:
        # SIGNAL_SET: the value's 8 bytes in the order of the NIC's atomics (native, or
        # big-endian with QP_SIGNAL_BE: Nic.atomic_endianness "big"), so an ADD and a SET on one
        # word agree; carried inline from the QP's scratch line. tests/test_signal_endian.py
        src = qpp[qb + QP_SCRATCH] + 8
        if qpp[qb + QP_SIGNAL_BE] != 0:
            mlx5.put_be64(u8_at(src, 8), 0, value)
        else:
            u64_at(src, 1)[0] = np.uint64(value)
        wq.post_write_inline(sq, nbb, pi, qpn, mlx5.OPCODE_RDMA_WRITE, fm, raddr, rkey, src, 8, 0)
    else:
        wq.post_rdma(sq, nbb, pi, qpn, opcode, fm, raddr, rkey, laddr, lkey, nbytes, 0)
    i = q * sstride + (pi & (nbb - 1))
    side_ch[i] = c
    side_seq[i] = seq if last else -1 - seq        # < 0: a non-final chunk of command seq
    qpp[qb + QP_PI] = pi + 1                       # every proxy WQE is one WQEBB (ds <= 4)
    qpp[qb + QP_DIRTY] = 1


@wire_njit(cache=True, inline="always")
def _issue(S, c, seq, w0, w1, operand, width):
    """Turn one command into WQE(s). Returns 1 if consumed, 0 if the QP's SQ is full (retry).
    ``width`` 2: an ATOMIC_FA whose OPERAND (``operand``) was in the next slot."""
    chp, qpp, peer_qp, npeer, kq, lbase, lkey = S[0], S[3], S[7], S[8], S[9], S[10], S[11]
    op = cmd_op(w0)
    peer = cmd_peer(w0)
    if op == OP_NOP:
        _mark_done(S, c, seq)
        return 1
    if op > OP_MAX or peer >= npeer or op == OP_OPERAND or (op == OP_ATOMIC_FA and width != 2):
        _record_error(chp, c, pack_error(ERR_BAD_COMMAND, op, 0, 0, peer), seq, peer)
        _mark_done(S, c, seq)
        return 1
    q = peer_qp[peer * kq + chp[c * CH_NFIELDS + CH_QPSLOT]]
    qb = q * QP_NFIELDS
    size = cmd_arg(w0)
    nwqe = 1
    if op == OP_PUT or op == OP_GET:
        nwqe = max(1, (size + MAX_WQE_BYTES - 1) // MAX_WQE_BYTES)
    if qpp[qb + QP_PI] + nwqe - qpp[qb + QP_SQ_CI] > qpp[qb + QP_WQEBBS]:
        return 0
    raddr = qpp[qb + QP_RBASE] + cmd_remote_off(w0, w1)
    rkey = qpp[qb + QP_RKEY]
    if op == OP_PUT or op == OP_GET:
        opcode = mlx5.OPCODE_RDMA_WRITE if op == OP_PUT else mlx5.OPCODE_RDMA_READ
        laddr = lbase + cmd_local_off(w0, w1)
        if nwqe == 1:
            _post(S, q, c, seq, True, opcode, raddr, rkey, laddr, lkey, size, 0, False)
        else:
            for k in range(nwqe):
                n = min(MAX_WQE_BYTES, size - k * MAX_WQE_BYTES)
                _post(S, q, c, seq, k == nwqe - 1, opcode, raddr + k * MAX_WQE_BYTES, rkey,
                      laddr + k * MAX_WQE_BYTES, lkey, max(n, 0), 0, False)
    elif op == OP_ATOMIC_FA:
        _post(S, q, c, seq, True, mlx5.OPCODE_ATOMIC_FA, raddr, rkey,
              lbase + cmd_local_off(w0, w1), lkey, 8, np.uint64(operand), False)
    elif op == OP_SIGNAL_ADD:
        _post(S, q, c, seq, True, mlx5.OPCODE_ATOMIC_FA, raddr, rkey, qpp[qb + QP_SCRATCH],
              qpp[qb + QP_SCRATCH_LKEY], 8, cmd_signal_value(w0, w1), False)
    else:  # OP_SIGNAL_SET
        _post(S, q, c, seq, True, mlx5.OPCODE_RDMA_WRITE, raddr, rkey, 0, 0, 8,
              cmd_signal_value(w0, w1), True)
    if qpp[qb + QP_NULL] != 0:
        # drain-only mode: no NIC behind this QP; the WQE is built and counts as completed now
        qpp[qb + QP_SQ_CI] = qpp[qb + QP_PI]
        qpp[qb + QP_DIRTY] = 0
        _mark_done(S, c, seq)
    return 1


@wire_njit(cache=True, inline="always")
def _ring(qpp, q):
    """One doorbell for everything posted on the QP in this pass (wq.ring_doorbell: release; DBR;
    release; 64-bit doorbell word), after asking for a CQE on the last WQE if it had none."""
    qb = q * QP_NFIELDS
    nbb = qpp[qb + QP_WQEBBS]
    last = qpp[qb + QP_LAST_UNSIG]
    if last >= 0:
        ring = u8_ptr(qpp[qb + QP_SQ])
        ring[last + mlx5.CTRL_FM_CE_SE] |= mlx5.WQE_CTRL_CQ_UPDATE
        qpp[qb + QP_LAST_UNSIG] = -1
        qpp[qb + QP_UNSIG] = 0
    pi = qpp[qb + QP_PI]
    wq.ring_doorbell(qpp[qb + QP_SQ], nbb, qpp[qb + QP_DBREC], qpp[qb + QP_DB], pi, pi - 1)
    qpp[qb + QP_DIRTY] = 0


@wire_njit(cache=True)
def _poll_cq(S, q, out_addr, out_n):
    """Consume the QP's new CQEs (wq.poll_cq, into the CQE_POLL_BATCH * 64-byte buffer at
    ``out_addr``); every WQE up to a CQE's wqe_counter has completed, in order (one RC QP
    completes in posting order)."""
    chp, qpp, side_ch, side_seq, sstride = S[0], S[3], S[4], S[5], S[6]
    out = u8_at(out_addr, out_n * mlx5.CQE_SIZE)
    qb = q * QP_NFIELDS
    nbb = qpp[qb + QP_WQEBBS]
    total = 0
    while True:
        n = wq.poll_cq(qpp[qb + QP_CQ], qpp[qb + QP_CQE_CNT], qpp[qb + QP_CQ_DBREC],
                       qpp[qb + QP_CQ_CI], out, out_n)
        for k in range(n):
            off = k * mlx5.CQE_SIZE
            opcode = mlx5.cqe_opcode(out, off)
            wc = np.int64(mlx5.cqe_wqe_counter(out, off))
            sq_ci = qpp[qb + QP_SQ_CI]
            upto = sq_ci + ((wc - sq_ci) & 0xFFFF)    # the WQE's full producer index
            if upto >= qpp[qb + QP_PI]:
                continue                              # not a WQE we have outstanding: ignore
            is_err = opcode == mlx5.CQE_REQ_ERR or opcode == mlx5.CQE_RESP_ERR
            p = sq_ci
            while p <= upto:
                i = q * sstride + (p & (nbb - 1))
                c = side_ch[i]
                s = side_seq[i]
                if s >= 0:
                    _mark_done(S, c, s)
                if is_err and p == upto:
                    word = pack_error(ERR_CQE, mlx5.cqe_syndrome(out, off),
                                      mlx5.cqe_vendor_syndrome(out, off), wc, mlx5.cqe_qpn(out, off))
                    _record_error(chp, c, word, s if s >= 0 else -1 - s, qpp[qb + QP_PEER])
                p += 1
            qpp[qb + QP_SQ_CI] = upto + 1
        qpp[qb + QP_CQ_CI] += n
        total += n
        if n < out_n:
            return total


@wire_njit(cache=True, inline="always")
def _advance_completed(S, c):
    """Completed over every command ``done`` holds in order behind it; publish it if it moved."""
    chp, donep, dstride = S[0], S[1], S[2]
    cb = c * CH_NFIELDS
    mask = chp[cb + CH_DEPTH] - 1
    comp = chp[cb + CH_COMPLETED]
    tail = chp[cb + CH_TAIL]
    row = c * dstride
    while comp < tail and donep[row + (comp & mask)] != 0:
        donep[row + (comp & mask)] = 0
        comp += 1
    chp[cb + CH_COMPLETED] = comp
    if comp != chp[cb + CH_PUB_COMPLETED]:
        store_release_u64(chp[cb + CH_HCTRL] + 8 * HC_COMPLETED, _published(chp, cb, comp))
        chp[cb + CH_PUB_COMPLETED] = comp


@wire_njit(cache=True, inline="always")
def _publish_tail(chp, c):
    cb = c * CH_NFIELDS
    t = chp[cb + CH_TAIL]
    if t != chp[cb + CH_PUB_TAIL]:
        store_release_u64(chp[cb + CH_HCTRL] + 8 * HC_TAIL, t)
        chp[cb + CH_PUB_TAIL] = t


@wire_njit(cache=True)
def _drain(S, c):
    """Take up to DRAIN_BATCH commands of channel ``c`` from its FIFO into WQEs; returns how
    many. Stops at the first slot not yet written, when the in-order window is full, or when a
    QP's SQ is full (the doorbell, the CQ poll and a later pass make room)."""
    chp = S[0]
    cb = c * CH_NFIELDS
    fifo = chp[cb + CH_FIFO]
    depth = chp[cb + CH_DEPTH]
    mask = depth - 1
    lg = _log2(depth)
    tail = chp[cb + CH_TAIL]
    n = 0
    while n < DRAIN_BATCH:
        if tail - chp[cb + CH_COMPLETED] >= depth:
            break                                  # in-order window full: wait for completions
        slot = fifo + (tail & mask) * CMD_BYTES
        w0 = load_acquire_u64(slot)
        if (w0 >> np.uint64(VALID_SHIFT)) != valid_bit(tail, lg):
            break                                  # not written yet (or the ring is empty)
        w1 = load_acquire_u64(slot + 8)
        operand = np.uint64(0)
        width = 1
        if cmd_op(w0) == OP_ATOMIC_FA:
            # its OPERAND is the next slot of the same reservation: take the pair or wait
            if tail + 1 - chp[cb + CH_COMPLETED] >= depth:
                break
            slot2 = fifo + ((tail + 1) & mask) * CMD_BYTES
            x0 = load_acquire_u64(slot2)
            if (x0 >> np.uint64(VALID_SHIFT)) != valid_bit(tail + 1, lg):
                break                              # not written yet
            if cmd_op(x0) == OP_OPERAND:
                operand = load_acquire_u64(slot2 + 8)
                width = 2
        if _issue(S, c, tail, w0, w1, operand, width) == 0:
            break                                  # SQ full: ring, poll, retry next pass
        if width == 2:
            _mark_done(S, c, tail + 1)             # the operand completes with its header
        tail += width
        n += 1
        chp[cb + CH_TAIL] = tail
        if tail - chp[cb + CH_PUB_TAIL] >= TAIL_PUBLISH_EVERY:
            _publish_tail(chp, c)
    return n


@wire_njit(cache=True)
def _pass(S, my_ch, nch, my_qp, nqp, stats, out_addr, out_n):
    """One pass over this thread's ``nch`` channels and ``nqp`` QPs (``my_ch``, ``my_qp``,
    ``stats``: i64 pointers). Returns the work done (commands + CQEs)."""
    chp, qpp = S[0], S[3]
    work = 0
    for i in range(nch):
        work += _drain(S, my_ch[i])
    ndb = 0
    for j in range(nqp):
        q = my_qp[j]
        if qpp[q * QP_NFIELDS + QP_DIRTY] != 0:
            _ring(qpp, q)
            ndb += 1
    ncqe = 0
    for j in range(nqp):
        qb = my_qp[j] * QP_NFIELDS
        if qpp[qb + QP_NULL] == 0 and qpp[qb + QP_PI] != qpp[qb + QP_SQ_CI]:
            ncqe += _poll_cq(S, my_qp[j], out_addr, out_n)
    # completed before tail: both live in the HostCtrl line a device quiet polls over PCIe, and
    # the first store to it waits for the line (x86 stores leave in order); a quiet waits for
    # completed, a producer reads tail only when its cached tail says the ring is full.
    for i in range(nch):
        _advance_completed(S, my_ch[i])
    for i in range(nch):
        _publish_tail(chp, my_ch[i])
    stats[ST_COMMANDS] += work
    stats[ST_DOORBELLS] += ndb
    stats[ST_CQES] += ncqe
    stats[ST_PASSES] += 1
    return work + ncqe


@wire_njit(cache=True, nogil=True)
def proxy_run(ch, done, qp, side_ch, side_seq, peer_qp, heap, my_ch, my_qp, stats, out, spin_ns,
              stop_addr, lock_addr, cap_addr):
    """A proxy thread's whole life, without the GIL: drain passes until the word at ``stop_addr``
    is non-zero. A pass that found no work is followed by rawmem.idle_pause (spin ``spin_ns``
    after the last work, then yield, then sleep with a back-off of at most the word at
    ``cap_addr`` in us: its NIC's idle sleep cap, SoftNic.idle_sleep_max_addr).
    Each pass holds the thread's pass lock (``lock_addr``), which the progress hook takes too."""
    S = _state(ch, done, qp, side_ch, side_seq, peer_qp, heap)
    mc, nch = i64_ptr(my_ch.ctypes.data), my_ch.shape[0]
    mq, nqp = i64_ptr(my_qp.ctypes.data), my_qp.shape[0]
    sp, oa, on = i64_ptr(stats.ctypes.data), out.ctypes.data, out.shape[0] // mlx5.CQE_SIZE
    busy = True
    last_work = 0
    while load_acquire_u64(stop_addr) == 0:
        w = 0
        if atomic_cas_u64(lock_addr, 0, 1) == 0:
            w = _pass(S, mc, nch, mq, nqp, sp, oa, on)
            store_release_u64(lock_addr, 0)
        if w != 0:
            busy = True
            continue
        now = clock_ns()
        if busy:                       # the first idle pass: the work ended one pass ago
            last_work = now
            busy = False
        idle_pause(now - last_work, spin_ns, np.int64(load_acquire_u64(cap_addr)))


# The progress hook (gpunet/host/progress.py): a HOST-arm device thread that waits, on the CPU, runs one
# pass of a proxy thread's drain itself, so a put + quiet over the proxy is drained, executed (the
# soft NIC's hook) and completed on the caller's thread, with no hand-off to the proxy thread
# (bench/cpu_put.py: each hand-off cost a context switch on the 2-core CI machine). Rule: a pass
# of thread t runs under t's pass lock, whoever runs it (proxy_run or this hook); the hook only
# tries it. Its argument: HK_WORDS int64 words per thread (ProxyEngine._hook_args).
HK_STOP, HK_LOCK, HK_CH, HK_DONE, HK_DONE_STRIDE, HK_QP, HK_SIDE_CH, HK_SIDE_SEQ, \
    HK_SIDE_STRIDE, HK_PEER_QP, HK_NPEER, HK_K, HK_LBASE, HK_LKEY, HK_MY_CH, HK_NCH, HK_MY_QP, \
    HK_NQP, HK_STATS, HK_OUT, HK_OUT_N = range(21)
HK_WORDS = 24


def proxy_progress_hook_address():
    """The C address of proxy_progress_hook, compiled (numba cfunc, disk-cached) at the first
    call: gpunet/host/progress.py asks only once a library runs hooks (a cold compile took ~40 s on the
    CI VM, so importing this module must not)."""
    global _proxy_hook_cfunc
    if _proxy_hook_cfunc is None:
        _proxy_hook_cfunc = cfunc(types.int64(types.uint64), nopython=True,
                                  cache=True)(proxy_progress_hook)
    return _proxy_hook_cfunc.address


_proxy_hook_cfunc = None


def proxy_progress_hook(arg):
    """One drain pass of one proxy thread on the calling thread, if that thread's pass lock is
    free and the engine is not stopping; returns the work done."""
    a = i64_ptr(arg)
    if load_acquire_u64(a[HK_STOP]) != 0:
        return 0
    lock = a[HK_LOCK]
    if load_acquire_u64(lock) != 0 or atomic_cas_u64(lock, 0, 1) != 0:
        return 0
    S = _state_at(a[HK_CH], a[HK_DONE], a[HK_DONE_STRIDE], a[HK_QP], a[HK_SIDE_CH],
                  a[HK_SIDE_SEQ], a[HK_SIDE_STRIDE], a[HK_PEER_QP], a[HK_NPEER], a[HK_K],
                  a[HK_LBASE], a[HK_LKEY])
    w = _pass(S, i64_ptr(a[HK_MY_CH]), a[HK_NCH], i64_ptr(a[HK_MY_QP]), a[HK_NQP],
              i64_ptr(a[HK_STATS]), a[HK_OUT], a[HK_OUT_N])
    store_release_u64(lock, 0)
    return w


@wire_njit(cache=True, nogil=True)
def proxy_step(ch, done, qp, side_ch, side_seq, peer_qp, heap, my_ch, my_qp, stats, out, spin_ns,
               max_ns):
    """Drain passes until idle for ``spin_ns`` or busy for ``max_ns``; returns the work done.
    ``ProxyEngine.step`` drives an engine made with start=False through it (benchmarks, tests).
    """
    S = _state(ch, done, qp, side_ch, side_seq, peer_qp, heap)
    mc, nch = i64_ptr(my_ch.ctypes.data), my_ch.shape[0]
    mq, nqp = i64_ptr(my_qp.ctypes.data), my_qp.shape[0]
    sp, oa, on = i64_ptr(stats.ctypes.data), out.ctypes.data, out.shape[0] // mlx5.CQE_SIZE
    t0 = clock_ns()
    last_work = t0
    total = 0
    k = 0
    while True:
        w = _pass(S, mc, nch, mq, nqp, sp, oa, on)
        total += w
        k += 1
        if (k & 15) == 0 or w == 0:
            t = clock_ns()
            if w != 0:
                last_work = t
            if t - last_work >= spin_ns or t - t0 >= max_ns:
                return total
        # (when w != 0 and k & 15 != 0 we skip the clock read: it costs ~25 ns)


# ---- Python objects ---------------------------------------------------------------------------
class ProxyChannel(Resource):
    """One command FIFO with its control blocks (a gpunet.resource.Resource: close() frees the
    platform memory it allocated).

    ``depth``: commands the ring holds (a power of two, >= 4). Memory: by default CPU memory
    (numpy, 64-byte aligned) for CPU producers and the HOST arm; pass ``platform`` (a
    ``gpunet.host.platform.Platform`` on a GPU) to put the FIFO and HostCtrl in host-mapped memory
    (``policy("proxy_fifo")``) and DevCtrl in device memory.

    Attributes: ``fifo_addr``, ``hctrl_addr``, ``dctrl_addr`` (addresses the proxy/CPU use) and
    ``dev_fifo_addr``, ``dev_hctrl_addr``, ``dev_dctrl_addr`` (what device code uses; equal on the
    CPU). gpunet/device/descriptors.py's ``proxy_channel_desc(channel)`` makes the device's descriptor.
    """

    def __init__(self, depth=1024, platform=None):
        depth = int(depth)
        if depth < 4 or depth & (depth - 1):
            raise ConfigError(f"ProxyChannel depth must be a power of two >= 4, not {depth}")
        self.depth = depth
        if platform is None or platform.name == "cpu":
            self._fifo = aligned_zeros(depth * CMD_BYTES)
            self._hctrl = aligned_zeros(HOST_CTRL_BYTES)
            self._dctrl = aligned_zeros(DEV_CTRL_BYTES)
            self.fifo_addr = self.dev_fifo_addr = self._fifo.ctypes.data
            self.hctrl_addr = self.dev_hctrl_addr = self._hctrl.ctypes.data
            self.dctrl_addr = self.dev_dctrl_addr = self._dctrl.ctypes.data
        else:
            try:
                fifo = self._adopt(platform.alloc("host", depth * CMD_BYTES), "FIFO")
                hctrl = self._adopt(platform.alloc("host", HOST_CTRL_BYTES), "HostCtrl")
                dctrl = self._adopt(platform.alloc("device", DEV_CTRL_BYTES), "DevCtrl")
            except BaseException as e:
                self._close_noting(e)
                raise
            zeros = np.zeros(DEV_CTRL_BYTES, dtype=np.uint8)
            platform.memcpy(dctrl.ptr, zeros.ctypes.data, DEV_CTRL_BYTES)
            self._fifo, self._hctrl, self._dctrl = fifo.view(), hctrl.view(), None
            self.fifo_addr, self.dev_fifo_addr = fifo.host_ptr, fifo.ptr
            self.hctrl_addr, self.dev_hctrl_addr = hctrl.host_ptr, hctrl.ptr
            self.dctrl_addr = self.dev_dctrl_addr = dctrl.ptr    # device memory: not CPU-addressable
        self.index = None          # set by the engine
        self.engine = None

    # -- the host-visible counters ---------------------------------------------------------
    def _hword(self, i):
        return int(self._hctrl.view(np.uint64)[i])

    @property
    def tail(self):
        """Commands the proxy has taken from the FIFO (as last published)."""
        return self._hword(HC_TAIL)

    @property
    def completed(self):
        """Every command with a sequence below this has completed at the NIC (HostCtrl.completed
        without its COMPLETED_ERROR bit)."""
        return self._hword(HC_COMPLETED) & ~COMPLETED_ERROR

    @property
    def head(self):
        """Slots reserved by producers (DevCtrl.head; CPU memory only)."""
        if self._dctrl is None:
            raise ConfigError("DevCtrl is in device memory: read head on the device")
        return int(self._dctrl.view(np.uint64)[DC_HEAD])

    def error(self):
        """None, or a dict describing the first failure recorded for this channel."""
        w = self._hword(HC_ERROR)
        if w == 0:
            return None
        code, synd, vendor, wc, qpn = unpack_error(w)
        return {"code": code, "syndrome": synd, "vendor_syndrome": vendor, "wqe_counter": wc,
                "qpn": qpn, "seq": self._hword(HC_ERR_SEQ), "peer": self._hword(HC_ERR_PEER),
                "word": w}

    def raise_if_error(self, what="proxy"):
        """Raise the channel's first failure, if any, as device code would report it (the one
        decoder, gpunet.device.abi.failure_error): CompletionError for an error CQE, ConfigError
        for a command the proxy rejected."""
        e = self.error()
        if e is None:
            return
        raise abi.failure_error(abi.proxy_failure(
            e["code"] == ERR_CQE, e["syndrome"], e["vendor_syndrome"], e["wqe_counter"], e["qpn"],
            e["seq"], e["peer"], self.index), what)

    def clear_error(self):
        """Forget the channel's recorded failure, once the QPs it came from were reset and while no
        engine runs on the channel (gpunet.context recovers this way): later quiets succeed again
        unless a new failure is recorded."""
        h = self._hctrl.view(np.uint64)
        h[HC_ERR_SEQ] = 0
        h[HC_ERR_PEER] = 0
        h[HC_ERROR] = 0
        h[HC_COMPLETED] = int(h[HC_COMPLETED]) & ~COMPLETED_ERROR

    def fill_holes(self, head):
        """Fill with NOPs the slots below ``head`` (the producers' reservations, DevCtrl.head)
        that a push reserved and never wrote (proxy.cuh ``wait_space``: a push that saw a failure
        or timed out while the FIFO was full gives up), as far as the proxy has freed their
        slots: the proxy then completes them and the channel drains to ``head`` again. Call it
        again as the tail moves. No producer may be running (gpunet.context recovers this way).
        Returns how many slots were filled."""
        return int(fill_holes(self.fifo_addr, self.depth, self.tail, int(head),
                              encode(OP_NOP, 0, 0, 0, 0)[0]))

    def push(self, commands, timeout_s=1.0):
        """CPU producer (tests): push ``commands`` [(w0, w1), ...] with one reservation; returns
        the issue count after them. Raises TimeoutError when the FIFO stayed full."""
        if self._dctrl is None:
            raise ConfigError("DevCtrl is in device memory: push from the device")
        w = np.array(commands, dtype=np.uint64).reshape(-1, 2)
        r = cpu_push(self.fifo_addr, self.depth, self.hctrl_addr, self.dctrl_addr,
                     np.ascontiguousarray(w[:, 0]), np.ascontiguousarray(w[:, 1]), len(w),
                     int(timeout_s * 1e9))
        if r == -2:
            raise ConfigError(f"cannot push {len(w)} commands at once into a FIFO of {self.depth}")
        if r < 0:
            raise GpunetTimeoutError(f"proxy channel {self.index}: FIFO full for {timeout_s}s "
                                     f"(is the proxy engine running?)")
        return int(r)


# QP -> (sq producer index, sq completed index, cq consumer index) left by a closed engine, so
# that a later engine can post on the same QP (its rings and counters continue; the NIC's do).
_QP_RESUME = weakref.WeakKeyDictionary()


def resume_after_reset(qp, cq_ci):
    """The next engine takes up ``qp``, which the NIC reset (``SoftNic.reset_qp``: its send queue
    restarts at WQE counter 0), at producer and completion index 0 and CQ consumer index ``cq_ci``
    (what reset_qp returned: every CQE before it is of the old life); the CQ's doorbell record
    tells the NIC so. Call it between engines: none may be running on the QP."""
    _QP_RESUME[qp] = (0, 0, int(cq_ci))
    mlx5.set_cq_dbrec(_qp_send_cq(qp).dbrec, 0, int(cq_ci))


def _qp_send_cq(qp):
    for name in ("send_cq", "cq", "scq"):
        cq = getattr(qp, name, None)
        if cq is not None:
            return cq
    raise ConfigError(f"cannot find the send CQ of {qp!r}: pass (qp, cq) pairs in qps_per_peer")


def _key(obj, names):
    if isinstance(obj, (tuple, list)):
        return int(obj[0]), int(obj[1])
    addr = int(getattr(obj, "addr"))
    for n in names:
        if hasattr(obj, n):
            return addr, int(getattr(obj, n))
    raise ConfigError(f"{obj!r} has no {' / '.join(names)}")


class ProxyEngine(Resource):
    """CPU proxy threads draining ``channels`` into the peers' QPs (a gpunet.resource.Resource:
    close() stops the threads; the channels are not its children and outlive it).

    Arguments:
      nic: the NIC the QPs belong to (``gpunet.host.softnic.SoftNic``, later the verbs NIC); used
        to allocate and register the 8-byte landing slots of SIGNAL_ADD. ``None`` with
        ``drain_only=True``.
      channels: list of ``ProxyChannel``; channel i is served by thread ``i % threads``.
      qps_per_peer: list, one entry per peer rank, of that peer's connected RC QPs (each a QP
        object with ``qpn, sq_addr, sq_wqebbs, dbrec_addr, db_addr`` and a send CQ as
        ``send_cq``/``cq``, or a ``(qp, cq)`` pair). Every peer has the same count k >= threads;
        thread t uses QPs t, t + threads, ... of each peer; channel i uses QP
        ``t + threads * ((i // threads) % (k // threads))``-th of the peer, so all of one channel's
        commands to one peer stay on one QP, in order (put-then-signal relies on it).
      local_heap: the local symmetric heap's MR (``addr``, ``lkey``) or an ``(addr, lkey)`` pair.
      remote_heaps: per peer, the peer heap's MR (``addr``, ``rkey``) or an ``(addr, rkey)`` pair.
      threads: proxy threads.
      drain_only: build every WQE into a private ring and complete it at once: measures the proxy
        alone (FIFO reads, decode, WQE build, completion bookkeeping), no NIC.
      spin_us: how long an idle thread keeps polling (a pure spin) before it yields and sleeps.
      start: False starts no thread; drive it with ``step(t)`` (benchmarks, tests).
      cpus: None, or one set of CPU numbers per thread: thread t pins itself to ``cpus[t]``
        (rawmem.engine_thread_start); ``placement[t]`` then records what it got.
      scratch: None, or the ``scratch`` of an earlier, closed engine on the same NIC (its landing
        slots, 64 B per QP): reused, because ``nic.alloc`` memory is never freed, so each engine
        restarted after a recovery (gpunet/transports.py) took 64 B per QP of the NIC's memory
        anew. tests/test_proxy.py::test_recovery_cycles_reuse_the_landing_slots.
    """

    def __init__(self, nic, channels, qps_per_peer, local_heap, remote_heaps, threads=1,
                 drain_only=False, spin_us=SPIN_US, sq_wqebbs_null=1024, start=True, cpus=None,
                 scratch=None):
        threads = int(threads)
        if threads < 1:
            raise ConfigError(f"threads must be >= 1, not {threads}")
        if not channels:
            raise ConfigError("ProxyEngine needs at least one channel")
        self.nic = nic
        self.channels = list(channels)
        self.threads = threads
        self.drain_only = bool(drain_only)
        self._stop = False
        self._thread_errors = []
        self._scratch_mr = None
        npeer = len(remote_heaps)
        if npeer < 1 or npeer > MAX_PEERS:
            raise ConfigError(f"1..{MAX_PEERS} peers supported, got {npeer}")
        lbase, lkey = _key(local_heap, ("lkey",))
        self.heap = np.array([lbase, lkey], dtype=np.int64)

        # channels
        nch = len(self.channels)
        self.ch = np.zeros((nch, CH_NFIELDS), dtype=np.int64)
        maxdepth = max(c.depth for c in self.channels)
        self.done = np.zeros((nch, maxdepth), dtype=np.uint8)
        for i, c in enumerate(self.channels):
            if c.engine is not None:
                raise ConfigError(f"channel {i} already belongs to an engine")
            c.index, c.engine = i, self
            self.ch[i, CH_FIFO] = c.fifo_addr
            self.ch[i, CH_DEPTH] = c.depth
            self.ch[i, CH_HCTRL] = c.hctrl_addr
            # resume from what the channel says (a fresh channel: all zero)
            self.ch[i, CH_TAIL] = self.ch[i, CH_COMPLETED] = c.completed
            self.ch[i, CH_PUB_TAIL] = self.ch[i, CH_PUB_COMPLETED] = c.completed
            self.ch[i, CH_ERR] = 1 if c.error() else 0

        # QPs
        if drain_only:
            k = threads
            self._null_rings = [aligned_zeros(sq_wqebbs_null * mlx5.WQEBB)
                                for _ in range(npeer * k)]
            self._null_db = aligned_zeros(64)
            self._null_scratch = aligned_zeros(64 * npeer * k)
            qps = [[None] * k for _ in range(npeer)]
        else:
            qps = [list(x) for x in qps_per_peer]
            if len(qps) != npeer:
                raise ConfigError(f"qps_per_peer has {len(qps)} peers, remote_heaps {npeer}")
            k = len(qps[0])
            if any(len(x) != k for x in qps):
                raise ConfigError("every peer needs the same number of QPs")
            if k < threads:
                raise ConfigError(f"{k} QPs per peer cannot serve {threads} proxy threads without "
                                  f"sharing a QP: create >= {threads} QPs per peer or use fewer "
                                  f"threads")
            if nic is None:
                raise ConfigError("a NIC is needed unless drain_only=True")
        self.qps_per_peer = k
        nqp = npeer * k
        per_thread = k // threads              # QPs of one peer that one thread owns
        self.qp = np.zeros((nqp, QP_NFIELDS), dtype=np.int64)
        # peer_qp[p, j]: the engine's index of peer p's j-th QP; QP j belongs to thread j % threads
        self.peer_qp = np.arange(nqp, dtype=np.int64).reshape(npeer, k)
        maxbb = sq_wqebbs_null if drain_only else max(
            int((x[0] if isinstance(x, tuple) else x).sq_wqebbs) for row in qps for x in row)
        self.side_ch = np.zeros((nqp, maxbb), dtype=np.int32)
        self.side_seq = np.zeros((nqp, maxbb), dtype=np.int64)
        self.scratch = None
        if not drain_only:
            if scratch is None:
                scratch = nic.alloc(64 * nqp, align=64)
            elif scratch.nbytes < 64 * nqp or scratch.ctypes.data % 64:
                raise ConfigError(f"scratch: {scratch.nbytes} bytes at 0x{scratch.ctypes.data:x}; "
                                  f"{nqp} QPs need {64 * nqp}, 64-byte aligned (pass an earlier "
                                  f"engine's scratch, on the same QPs)")
            self.scratch = scratch
            self._scratch_mr = nic.reg_mr(scratch, kind="host")
            scratch_addr, scratch_lkey = int(self._scratch_mr.addr), int(self._scratch_mr.lkey)
        thread_qps = [[] for _ in range(threads)]
        self._qp_objs = []
        for p in range(npeer):
            rbase, rkey = _key(remote_heaps[p], ("rkey",))
            for j in range(k):
                q = p * k + j
                row = self.qp[q]
                row[QP_RBASE], row[QP_RKEY], row[QP_PEER] = rbase, rkey, p
                row[QP_LAST_UNSIG] = -1
                row[QP_SIGNAL_BE] = int(getattr(nic, "atomic_endianness", "big") == "big")
                if drain_only:
                    row[QP_SQ] = self._null_rings[q].ctypes.data
                    row[QP_WQEBBS] = sq_wqebbs_null
                    row[QP_QPN] = q
                    row[QP_DBREC] = row[QP_DB] = self._null_db.ctypes.data
                    row[QP_NULL] = 1
                    row[QP_SCRATCH] = self._null_scratch.ctypes.data + 64 * q
                else:
                    x = qps[p][j]
                    qpo, cq = (x if isinstance(x, tuple) else (x, _qp_send_cq(x)))
                    if getattr(cq, "collapsed", False):
                        raise ConfigError("the proxy polls owner-bit CQs; create the QP's send CQ "
                                          "with collapsed=False")
                    if int(cq.cqe_cnt) < int(qpo.sq_wqebbs):
                        raise ConfigError(f"CQ of QP 0x{qpo.qpn:x} has {cq.cqe_cnt} CQEs < "
                                          f"{qpo.sq_wqebbs} SQ WQEBBs: after an error every WQE "
                                          f"produces a CQE, so the CQ must hold one per WQEBB")
                    row[QP_SQ], row[QP_WQEBBS], row[QP_QPN] = qpo.sq_addr, qpo.sq_wqebbs, qpo.qpn
                    row[QP_DBREC], row[QP_DB] = qpo.dbrec_addr, qpo.db_addr
                    row[QP_CQ], row[QP_CQE_CNT], row[QP_CQ_DBREC] = (cq.buf_addr, cq.cqe_cnt,
                                                                     cq.dbrec_addr)
                    row[QP_SCRATCH], row[QP_SCRATCH_LKEY] = scratch_addr + 64 * q, scratch_lkey
                    # a QP an earlier engine posted on continues where that engine stopped
                    prev = _QP_RESUME.get(qpo)
                    if prev is not None:
                        row[QP_PI], row[QP_SQ_CI], row[QP_CQ_CI] = prev
                    self._qp_objs.append((q, qpo))
                thread_qps[j % threads].append(q)
        for i in range(nch):
            # channel i runs on thread t = i % threads and uses, for every peer, QP slot
            # t + threads * sub: one of t's own QPs, spread over the channels of t
            t = i % threads
            sub = (i // threads) % per_thread
            self.ch[i, CH_QPSLOT] = t + threads * sub
        self._thread_chs = [np.array([i for i in range(nch) if i % threads == t], dtype=np.int64)
                            for t in range(threads)]
        self._thread_qps = [np.array(sorted(x), dtype=np.int64) for x in thread_qps]
        self.stats = np.zeros((threads, ST_NFIELDS), dtype=np.int64)
        self._spin_ns = int(spin_us * 1000)
        self._stop_word = aligned_zeros(64).view(np.uint64)
        if cpus is not None and len(cpus) != threads:
            raise ConfigError(f"cpus: one CPU set per proxy thread ({threads}), got {len(cpus)}")
        self._cpus = [sorted(int(c) for c in x) for x in cpus] if cpus is not None else None
        # per thread: {"tid", "cpus"} once it runs (pin_current_thread), for benchmarks' records
        self.placement = [None] * threads
        self._threads = []
        for t in range(threads):
            th = threading.Thread(target=self._run, args=(t,), name=f"gpunet-proxy-{t}",
                                  daemon=True)
            self._threads.append(th)
        self._outs = [np.zeros(CQE_POLL_BATCH * mlx5.CQE_SIZE, dtype=np.uint8)
                      for _ in range(threads)]
        # compile (or load from numba's cache) before any thread starts: a first compile takes
        # seconds, longer than a device-side quiet may wait (seen on a fresh H200 host)
        proxy_step(self.ch, self.done, self.qp, self.side_ch, self.side_seq, self.peer_qp,
                   self.heap, self._thread_chs[0], self._thread_qps[0], self.stats[0],
                   self._outs[0], 0, 0)
        self._locks = aligned_zeros(64 * threads).view(np.uint64)   # thread t's pass lock: [8 t]
        # the idle sleep cap the threads follow: their NIC's (the soft NIC's engine and the proxy
        # threads serve the same waiters), else rawmem's default (word 1 of the stop line)
        self._stop_word[1] = IDLE_SLEEP_MAX_US
        self._cap_addr = getattr(nic, "idle_sleep_max_addr", None) or self._stop_word.ctypes.data + 8
        self._stop_word[0] = 1             # proxy_run returns at once: compiled, nothing drained
        proxy_run(self.ch, self.done, self.qp, self.side_ch, self.side_seq, self.peer_qp,
                  self.heap, self._thread_chs[0], self._thread_qps[0], self.stats[0],
                  self._outs[0], 0, self._stop_word.ctypes.data, self._locks.ctypes.data,
                  self._cap_addr)
        self._stop_word[0] = 0
        self._progress = []
        if start:
            for th in self._threads:
                th.start()
            # waiting HOST-arm device threads drain too (proxy_progress_hook; only with threads:
            # step() runs passes without the lock)
            self._hook_args = [self._hook_words(t) for t in range(threads)]
            self._progress = [progress.register(proxy_progress_hook_address, w.ctypes.data)
                              for w in self._hook_args]

    def _hook_words(self, t):
        """proxy_progress_hook's argument for thread t (HK_*): what _state and _pass take."""
        w = np.zeros(HK_WORDS, dtype=np.int64)
        w[HK_STOP], w[HK_LOCK] = self._stop_word.ctypes.data, self._locks.ctypes.data + 64 * t
        w[HK_CH], w[HK_DONE], w[HK_DONE_STRIDE] = (self.ch.ctypes.data, self.done.ctypes.data,
                                                   self.done.shape[1])
        w[HK_QP], w[HK_SIDE_CH], w[HK_SIDE_SEQ] = (self.qp.ctypes.data, self.side_ch.ctypes.data,
                                                   self.side_seq.ctypes.data)
        w[HK_SIDE_STRIDE], w[HK_PEER_QP] = self.side_ch.shape[1], self.peer_qp.ctypes.data
        w[HK_NPEER], w[HK_K] = self.peer_qp.shape[0], self.peer_qp.shape[1]
        w[HK_LBASE], w[HK_LKEY] = self.heap[HP_LBASE], self.heap[HP_LKEY]
        w[HK_MY_CH], w[HK_NCH] = self._thread_chs[t].ctypes.data, len(self._thread_chs[t])
        w[HK_MY_QP], w[HK_NQP] = self._thread_qps[t].ctypes.data, len(self._thread_qps[t])
        w[HK_STATS] = self.stats[t].ctypes.data
        w[HK_OUT], w[HK_OUT_N] = self._outs[t].ctypes.data, len(self._outs[t]) // mlx5.CQE_SIZE
        return w

    def step(self, t=0, spin_us=0.0, max_us=20_000.0):
        """Run thread t's drain loop once in the caller's thread (only with start=False): passes
        until idle for ``spin_us`` or busy for ``max_us``. Returns the work done."""
        if self._threads and self._threads[0].is_alive():
            raise ConfigError("step() is for an engine made with start=False")
        return proxy_step(self.ch, self.done, self.qp, self.side_ch, self.side_seq, self.peer_qp,
                          self.heap, self._thread_chs[t], self._thread_qps[t], self.stats[t],
                          self._outs[t], int(spin_us * 1000), int(max_us * 1000))

    def _run(self, t):
        my_ch, my_qp, st, out = (self._thread_chs[t], self._thread_qps[t], self.stats[t],
                                 self._outs[t])
        try:
            self.placement[t] = engine_thread_start(self._cpus[t] if self._cpus else None)
            proxy_run(self.ch, self.done, self.qp, self.side_ch, self.side_seq, self.peer_qp,
                      self.heap, my_ch, my_qp, st, out, self._spin_ns, self._stop_word.ctypes.data,
                      self._locks.ctypes.data + 64 * t, self._cap_addr)
        except BaseException as e:  # noqa: BLE001 - reported by check()/close()
            self._thread_errors.append(e)

    # -- host-side API ------------------------------------------------------------------------
    def check(self):
        """Raise the first failure: a proxy thread's exception, or a channel's CompletionError."""
        if self._thread_errors:
            raise GpunetError(f"proxy thread failed: {self._thread_errors[0]!r}") \
                from self._thread_errors[0]
        for c in self.channels:
            c.raise_if_error()

    def quiet(self, channel, issued, timeout_s=5.0):
        """Host-side quiet: wait until ``channel.completed >= issued``; raise CompletionError on a
        recorded failure and gpunet.TimeoutError after ``timeout_s``."""
        if self.closed:
            raise ClosedError("ProxyEngine is closed")
        r = cpu_wait_completed(channel.hctrl_addr, int(issued), int(timeout_s * 1e9))
        if r == -1:
            self.check()
            raise GpunetTimeoutError(
                f"proxy channel {channel.index}: completed={channel.completed} < issued={issued} "
                f"after {timeout_s}s (tail={channel.tail}; a stuck NIC or peer?)")
        if r != 0:
            channel.raise_if_error()
        self.check()

    def stats_dict(self):
        s = self.stats.sum(axis=0)
        return {"commands": int(s[ST_COMMANDS]), "doorbells": int(s[ST_DOORBELLS]),
                "cqes": int(s[ST_CQES]), "passes": int(s[ST_PASSES])}

    def alive_threads(self):
        return [th for th in self._threads if th.is_alive()]

    def _release(self):
        """Stop the proxy threads. Channels stay usable by a new engine."""
        for h in getattr(self, "_progress", ()):
            progress.unregister(h)             # no caller's thread drains for it from here
        self._stop = True
        self._stop_word[0] = 1                 # proxy_run polls it with an acquire load
        for th in self._threads:
            if th.is_alive():
                th.join(THREAD_JOIN_S)
        stuck = self.alive_threads()
        if stuck:
            # a running thread still reads the channels, posts on the QPs and lands in the scratch
            # MR: the channels stay bound to this engine (a new engine on them is refused) and the
            # MR stays registered, rather than let two drainers share a FIFO or the NIC write into
            # freed memory
            names = ", ".join(th.name for th in stuck)
            raise CloseError("proxy thread(s) %s still running" % names, [(
                "proxy thread(s) %s" % names,
                GpunetTimeoutError("still running %gs after the stop word was set (stuck in a "
                                   "pass); its channels stay bound to this closed engine"
                                   % THREAD_JOIN_S))])
        for c in self.channels:
            c.engine = None
        for q, qpo in self._qp_objs:
            try:
                _QP_RESUME[qpo] = (int(self.qp[q, QP_PI]), int(self.qp[q, QP_SQ_CI]),
                                   int(self.qp[q, QP_CQ_CI]))
            except TypeError:      # not weak-referenceable: a later engine cannot reuse it
                pass
        mr, self._scratch_mr = self._scratch_mr, None
        if mr is not None and not self.nic.closed:     # a closed NIC took its MRs with it
            self.nic.dereg_mr(mr)
