"""The CPU-proxy transport: command format, FIFO protocol, completion protocol, failures.

Producers are numba threads running ``proxy.cpu_push`` (the same steps as proxy.cuh's proxy_push)
and, where g++ is available, real device code (gpunet/device/testing/kernels/proxy.cu on the HOST arm,
warps of 32 and 64). Commands go through ``ProxyEngine`` into soft-NIC QPs between two soft NICs
(``a``: ours, ``b``: the peers'), and the tests check what arrives in the peers' memory.
"""
import ctypes
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

import gpunet
from gpunet import mlx5
from gpunet.host import proxy as P
from gpunet.host.rawmem import clock_ns, load_acquire_u64

softnic = pytest.importorskip("gpunet.host.softnic")

HEAP = 1 << 20
STATUS_TIMEOUT, STATUS_COMPLETION_ERROR = 1, 2      # qp.cuh
SITE_CQE = 5


def _max_examples(n):
    return max(3, min(n, settings().max_examples // 5))


@pytest.fixture(scope="module")
def nics():
    a = softnic.SoftNic(retry_timeout_s=0.3, name="proxy-a")
    b = softnic.SoftNic(retry_timeout_s=0.3, name="proxy-b")
    yield a, b
    a.close()
    b.close()


@pytest.fixture(scope="module")
def heaps(nics):
    a, b = nics
    lh, rh = a.alloc(HEAP), b.alloc(HEAP)
    return lh, a.reg_mr(lh), rh, b.reg_mr(rh)


def make_qps(a, b, n, sq_wqebbs=64):
    """n RC QPs of `a` connected to n QPs of `b`; each with its own send CQ (cqe_cnt = SQ size)."""
    out = []
    for _ in range(n):
        qa = a.create_qp(a.create_cq(sq_wqebbs), sq_wqebbs=sq_wqebbs)
        qb = b.create_qp(b.create_cq(sq_wqebbs), sq_wqebbs=sq_wqebbs)
        a.connect(qa, qb.info())
        b.connect(qb, qa.info())
        out.append(qa)
    return out


@njit(nogil=True, cache=True)
def produce(fifo, depth, hctrl, dctrl, w0, w1, group, timeout_ns):
    """Push w0/w1 in reservations of `group` commands (a warp's worth); returns the last issue
    count, or -1 on a FIFO timeout."""
    last = 0
    i = 0
    n = w0.shape[0]
    while i < n:
        k = min(group, n - i)
        r = P.cpu_push(fifo, depth, hctrl, dctrl, w0[i:i + k], w1[i:i + k], k, timeout_ns)
        if r < 0:
            return -1
        last = r
        i += k
    return last


def run_producers(ch, cmd_lists, group=1, timeout_s=5.0):
    """One numba thread per list of (w0, w1); returns the largest issue count."""
    res = [0] * len(cmd_lists)

    def body(j, cmds):
        w = np.array(cmds, dtype=np.uint64).reshape(-1, 2)
        res[j] = produce(ch.fifo_addr, ch.depth, ch.hctrl_addr, ch.dctrl_addr,
                         np.ascontiguousarray(w[:, 0]), np.ascontiguousarray(w[:, 1]), group,
                         int(timeout_s * 1e9))
    ths = [threading.Thread(target=body, args=(j, c)) for j, c in enumerate(cmd_lists)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert min(res) >= 0, "a producer timed out on a full FIFO"
    return max(res)


# ---- the command format ---------------------------------------------------------------------
ops = st.sampled_from([P.OP_NOP, P.OP_PUT, P.OP_GET, P.OP_ATOMIC_FA])
offs = st.integers(0, P.MAX_OFFSET)


@given(op=ops, peer=st.integers(0, P.MAX_PEERS - 1), arg=st.integers(0, P.MAX_SIZE),
       loff=offs, roff=offs)
def test_encode_decode_round_trip(op, peer, arg, loff, roff):
    """Any op / peer (12 bits) / 32-bit arg / 39-bit offsets encode into two words with the valid
    bit clear, and decode back to the same fields."""
    w0, w1 = P.encode(op, peer, arg, loff, roff)
    assert int(w0) >> 63 == 0
    d = P.decode(w0, w1)
    assert (d["op"], d["peer"], d["arg"], d["local_off"], d["remote_off"]) == (op, peer, arg, loff,
                                                                              roff)


@given(op=st.sampled_from([P.OP_SIGNAL_ADD, P.OP_SIGNAL_SET]), peer=st.integers(0, 4095),
       value=st.integers(0, 2**64 - 1), roff=offs)
def test_signal_value_round_trip(op, peer, value, roff):
    """SIGNAL_ADD / SIGNAL_SET carry a full 64-bit value (ARG + LOCAL_LO) next to a 39-bit offset."""
    w0, w1 = P.encode_signal(op, peer, np.uint64(value), roff)   # np.uint64: values >= 2**63
    d = P.decode(w0, w1)
    assert (d["op"], d["peer"], d["value"], d["remote_off"]) == (op, peer, value, roff)
    assert int(P.cmd_signal_value(np.uint64(w0), np.uint64(w1))) == value


@given(addend=st.integers(-2**63, 2**64 - 1), peer=st.integers(0, 4095), loff=offs, roff=offs)
def test_atomic_fa_is_a_header_and_a_64bit_operand(addend, peer, loff, roff):
    """Generates any 64-bit addend (negative: two's complement), peer and offsets. Invariant:
    ATOMIC_FA is two commands, the header (op, peer, result and word offsets) and an OPERAND whose
    w1 is the addend modulo 2**64; both have the valid bit clear."""
    (h0, h1), (o0, o1) = P.atomic_fa_commands(peer, addend, loff, roff)
    assert h0 >> 63 == 0 and o0 >> 63 == 0
    h, o = P.decode(h0, h1), P.decode(o0, o1)
    assert (h["op"], h["peer"], h["local_off"], h["remote_off"]) == (P.OP_ATOMIC_FA, peer, loff, roff)
    assert (o["op"], o["peer"], o["value"]) == (P.OP_OPERAND, peer, addend % 2**64)


def test_valid_bit_is_inverted_lap_parity():
    """Lap 0 writes 1 into the zeroed ring, lap 1 writes 0, lap 2 writes 1 again."""
    assert [int(P.valid_bit(s, 3)) for s in (0, 7, 8, 15, 16)] == [1, 1, 0, 0, 1]


@pytest.fixture(scope="module")
def kernels():
    loader = pytest.importorskip("gpunet.device.loader")
    from gpunet.device import testing
    try:
        return loader.build([testing.kernels_dir() / "proxy.cu"], arch="host")
    except gpunet.ToolchainError as e:
        pytest.skip(f"no HOST-arm toolchain: {e}")


def test_header_layout_matches_python(kernels):
    """proxy.cuh's struct layout and limits are gpunet/device/abi.py's PROXY_* mirror, and gpunet/host/proxy.py
    drains with exactly those values."""
    from gpunet.device import abi
    out = np.zeros(16, dtype=np.uint64)
    kernels.proxy_layout(out.ctypes.data_as(__import__("ctypes").c_void_p))
    assert list(map(int, out)) == [
        abi.PROXY_CMD_BYTES, abi.PROXY_HOST_CTRL_BYTES, 8 * abi.PROXY_HC_TAIL,
        8 * abi.PROXY_HC_COMPLETED, 8 * abi.PROXY_HC_ERROR, 8 * abi.PROXY_HC_ERR_SEQ,
        abi.PROXY_DEV_CTRL_BYTES, 8 * abi.PROXY_DC_HEAD, 8 * abi.PROXY_DC_CACHED_TAIL, 32, 24,
        abi.PROXY_OP_MAX, abi.PROXY_MAX_OFFSET, abi.PROXY_MAX_PEERS, 16, 17]
    mirrored = [n for n in dir(abi) if n.startswith("PROXY_")]
    assert len(mirrored) >= 30
    for n in mirrored:
        assert getattr(P, n[len("PROXY_"):]) == getattr(abi, n), n


@settings(max_examples=_max_examples(20))
@given(op=ops, peer=st.integers(0, 4095), arg=st.integers(0, P.MAX_SIZE), loff=offs, roff=offs,
       value=st.integers(0, 2**64 - 1))
def test_header_encoding_matches_python(kernels, op, peer, arg, loff, roff, value):
    """proxy.cuh's encode / encode_signal produce the same words as gpunet/host/proxy.py's."""
    import ctypes
    kernels.proxy_encode.argtypes = [ctypes.c_uint32, ctypes.c_uint32] + [ctypes.c_uint64] * 3 + [
        ctypes.c_void_p]
    kernels.proxy_encode_signal.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint64,
                                            ctypes.c_uint64, ctypes.c_void_p]
    out = np.zeros(2, dtype=np.uint64)
    kernels.proxy_encode(op, peer, arg, loff, roff, out.ctypes.data)
    assert tuple(map(int, out)) == tuple(map(int, P.encode(op, peer, arg, loff, roff)))
    kernels.proxy_encode_signal(P.OP_SIGNAL_ADD, peer, value, roff, out.ctypes.data)
    assert tuple(map(int, out)) == tuple(map(int, P.encode_signal(P.OP_SIGNAL_ADD, peer, value,
                                                                  roff)))
    kernels.proxy_encode_operand.argtypes = [ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p]
    kernels.proxy_encode_operand(peer, value, out.ctypes.data)
    assert tuple(map(int, out)) == P.atomic_fa_commands(peer, value, loff, roff)[1]


# ---- data path ---------------------------------------------------------------------------------
SLOT = 4096


@settings(max_examples=_max_examples(8))
@given(data=st.data(), nprod=st.integers(1, 3), group=st.sampled_from([1, 4, 16]))
def test_cpu_producers_puts_arrive(nics, heaps, data, nprod, group):
    """nprod numba producer threads push PUTs (sizes 0..SLOT, random offsets inside disjoint slots,
    reservations of `group` <= depth) into one 16-slot FIFO; after the host quiet every byte of every PUT
    is at the peer and nothing else was written."""
    a, b = nics
    lh, lmr, rh, rmr = heaps
    ncmd = data.draw(st.integers(1, 60))
    sizes = data.draw(st.lists(st.integers(0, SLOT), min_size=ncmd, max_size=ncmd))
    deltas = [data.draw(st.integers(0, SLOT - s)) for s in sizes]
    lh[:] = np.random.default_rng(ncmd).integers(0, 256, HEAP, dtype=np.uint8)
    rh[:] = 0
    cmds = [P.encode(P.OP_PUT, 0, s, i * SLOT + d, i * SLOT + d)
            for i, (s, d) in enumerate(zip(sizes, deltas))]
    ch = P.ProxyChannel(16)
    with P.ProxyEngine(a, [ch], [make_qps(a, b, 1)], lmr, [rmr]) as eng:
        issued = run_producers(ch, [cmds[j::nprod] for j in range(nprod)], group)
        eng.quiet(ch, ch.head)
        assert issued <= ch.head == ncmd == ch.completed == ch.tail
    expect = np.zeros(HEAP, dtype=np.uint8)
    for i, (s, d) in enumerate(zip(sizes, deltas)):
        o = i * SLOT + d
        expect[o:o + s] = lh[o:o + s]
    assert np.array_equal(rh, expect)


def test_multi_peer_multi_qp_threads(nics, heaps):
    """3 channels, 2 proxy threads, 2 peers with 2 QPs each: commands to different QPs complete
    out of order, every channel's `completed` reaches its head, all data arrives."""
    a, b = nics
    lh, lmr, rh, rmr = heaps
    r2 = b.alloc(HEAP)
    r2mr = b.reg_mr(r2)
    lh[:] = np.arange(HEAP) % 253
    rh[:] = 0
    r2[:] = 0
    chans = [P.ProxyChannel(32) for _ in range(3)]
    qps = [make_qps(a, b, 2), make_qps(a, b, 2)]
    with P.ProxyEngine(a, chans, qps, lmr, [rmr, r2mr], threads=2) as eng:
        for c, ch in enumerate(chans):
            cmds = [P.encode(P.OP_PUT, i % 2, 256, (c * 200 + i) * 512, (c * 200 + i) * 512)
                    for i in range(200)]
            run_producers(ch, [cmds[0::2], cmds[1::2]], group=4)
        for ch in chans:
            eng.quiet(ch, ch.head)
            assert ch.completed == ch.tail == 200
        assert eng.stats_dict()["commands"] == 600
    for c in range(3):
        for i in range(200):
            o = (c * 200 + i) * 512
            dst = rh if i % 2 == 0 else r2
            assert np.array_equal(dst[o:o + 256], lh[o:o + 256]), (c, i)


def test_atomics_signals_and_get(nics, heaps):
    """SIGNAL_ADD adds a 64-bit value, SIGNAL_SET stores one, ATOMIC_FA adds a negative addend and
    returns the old value (in the NIC's atomic order: native by default), GET reads peer memory
    (both orders: tests/test_signal_endian.py)."""
    a, b = nics
    lh, lmr, rh, rmr = heaps
    rh[:] = 0
    lh[:] = 0
    rh[1000:1032] = np.arange(32, dtype=np.uint8)
    ch = P.ProxyChannel(16)
    with P.ProxyEngine(a, [ch], [make_qps(a, b, 1)], lmr, [rmr]) as eng:
        big = (1 << 40) + 7
        ch.push([P.encode_signal(P.OP_SIGNAL_ADD, 0, big, 64),
                 P.encode_signal(P.OP_SIGNAL_ADD, 0, 5, 64),
                 P.encode_signal(P.OP_SIGNAL_SET, 0, 0x1122334455667788, 72)])
        issued = ch.push(P.atomic_fa_commands(0, -3, 128, 64) +
                         [P.encode(P.OP_GET, 0, 32, 2000, 1000), P.encode(P.OP_NOP, 0, 0, 0, 0)])
        eng.quiet(ch, issued)
    assert int.from_bytes(rh[64:72].tobytes(), sys.byteorder) == big + 5 - 3
    assert int.from_bytes(rh[72:80].tobytes(), sys.byteorder) == 0x1122334455667788
    assert int.from_bytes(lh[128:136].tobytes(), sys.byteorder) == big + 5
    assert np.array_equal(lh[2000:2032], np.arange(32, dtype=np.uint8))


@njit(nogil=True, cache=True)
def _observe(sig_addr, region_base, region, n, timeout_ns):
    """Poll a signal counter (native: the soft NIC's default atomic order); each time it reads c,
    regions 0..c-1 must carry their markers (first and last 8 bytes == index + 1). Returns
    violations, or -1 on timeout."""
    bad = 0
    t0 = clock_ns()
    seen = 0
    while seen < n:
        c = np.int64(load_acquire_u64(sig_addr))
        if c > seen:
            for i in range(c):
                p = region_base + i * region
                if load_acquire_u64(p) != i + 1 or load_acquire_u64(p + region - 8) != i + 1:
                    bad += 1
            seen = c
        if clock_ns() - t0 > timeout_ns:
            return -1
    return bad


def test_put_signal_ordering(nics, heaps):
    """put_signal = PUT then SIGNAL_ADD(+1) in one reservation: a receiver that reads the signal
    count c sees the payload of every one of the first c puts (checked continuously)."""
    a, b = nics
    lh, lmr, rh, rmr = heaps
    n, region = 150, 2048
    lh[:] = 0
    rh[:] = 0
    for i in range(n):
        lh[i * region:(i + 1) * region].view(np.uint64)[:] = i + 1
    sig = HEAP - 64
    cmds = []
    for i in range(n):
        cmds += [P.encode(P.OP_PUT, 0, region, i * region, i * region),
                 P.encode_signal(P.OP_SIGNAL_ADD, 0, 1, sig)]
    ch = P.ProxyChannel(64)
    result = []
    obs = threading.Thread(target=lambda: result.append(
        _observe(rh.ctypes.data + sig, rh.ctypes.data, region, n, int(10e9))))
    obs.start()
    with P.ProxyEngine(a, [ch], [make_qps(a, b, 1)], lmr, [rmr]) as eng:
        for i in range(n):
            ch.push(cmds[2 * i:2 * i + 2])
        eng.quiet(ch, 2 * n)
    obs.join()
    assert result == [0]


# ---- FIFO back-pressure ------------------------------------------------------------------------
def test_full_fifo_times_out_without_proxy_and_poisons():
    """With no proxy, a depth-8 FIFO takes 8 commands; the 9th push waits its bound and fails
    (gpunet.TimeoutError), leaving its slot reserved and unwritten: a proxy started afterwards
    drains the 8, then stops at the hole (completed stays 8; the channel is poisoned)."""
    ch = P.ProxyChannel(8)
    heap = np.zeros(4096, np.uint8)
    nop = P.encode(P.OP_NOP, 0, 0, 0, 0)
    for _ in range(8):
        ch.push([nop])
    t0 = time.monotonic()
    with pytest.raises(gpunet.TimeoutError):
        ch.push([nop], timeout_s=0.05)
    assert 0.05 <= time.monotonic() - t0 < 2
    with P.ProxyEngine(None, [ch], None, (heap.ctypes.data, 1), [(0, 2)], drain_only=True) as eng:
        eng.quiet(ch, 8)
        with pytest.raises(gpunet.TimeoutError):
            eng.quiet(ch, 9, timeout_s=0.1)
    assert ch.completed == ch.tail == 8 and ch.head == 9


def test_close_names_a_proxy_thread_that_never_stops_instead_of_hanging(monkeypatch):
    """A proxy thread stuck inside a pass (here: its drain loop replaced by a wait on an Event it
    is released from only at the end) never sees the stop word: close() gives up after
    THREAD_JOIN_S, raises a CloseError naming the thread, and keeps the channel bound to the
    closed engine (a new engine on it is refused while the old thread may still drain it)."""
    from gpunet.errors import CloseError
    release = threading.Event()
    real_run = P.proxy_run

    def stuck_run(*args):
        if threading.current_thread().name.startswith("gpunet-proxy"):
            release.wait(60)                 # the test's own bound: it never leaves one running
        else:
            real_run(*args)                  # the constructor's warm-up call on this thread

    monkeypatch.setattr(P, "proxy_run", stuck_run)
    monkeypatch.setattr(P, "THREAD_JOIN_S", 0.3)
    ch = P.ProxyChannel(8)
    heap = np.zeros(4096, np.uint8)
    eng = P.ProxyEngine(None, [ch], None, (heap.ctypes.data, 1), [(0, 2)], drain_only=True)
    stuck = eng.alive_threads()
    try:
        t0 = time.monotonic()
        with pytest.raises(CloseError, match=r"proxy thread\(s\) gpunet-proxy-0: TimeoutError: "
                                             r"still running") as e:
            eng.close()
        assert time.monotonic() - t0 < 3
        assert [what for what, _ in e.value.errors] == ["proxy thread(s) gpunet-proxy-0"]
        assert eng.closed and ch.engine is eng
        with pytest.raises(gpunet.ConfigError, match="already belongs to an engine"):
            P.ProxyEngine(None, [ch], None, (heap.ctypes.data, 1), [(0, 2)], drain_only=True)
    finally:
        release.set()
        for th in stuck:
            th.join(10)
    assert not any(th.is_alive() for th in stuck)


def test_small_fifo_back_pressure_many_producers(nics, heaps):
    """A depth-4 FIFO under 3 producers x 150 PUTs in reservations of 1..4: producers wait on the
    proxy's tail (cached-tail protocol), no command is lost or overwritten, the data arrives and
    the shared cached tail never runs ahead of the published tail."""
    a, b = nics
    lh, lmr, rh, rmr = heaps
    lh[:] = np.arange(HEAP) % 249
    rh[:] = 0
    ch = P.ProxyChannel(4)
    cmds = [P.encode(P.OP_PUT, 0, 100, i * 128, i * 128) for i in range(450)]
    with P.ProxyEngine(a, [ch], [make_qps(a, b, 1, sq_wqebbs=8)], lmr, [rmr]) as eng:
        run_producers(ch, [cmds[0::3], cmds[1::3], cmds[2::3]], group=1)
        run_producers(ch, [[P.encode(P.OP_NOP, 0, 0, 0, 0)] * 40] * 2, group=4)
        eng.quiet(ch, ch.head)
        cached = int(ch._dctrl.view(np.uint64)[P.DC_CACHED_TAIL])
        assert cached <= ch.tail == ch.completed == ch.head == 530
    for i in range(450):
        assert np.array_equal(rh[i * 128:i * 128 + 100], lh[i * 128:i * 128 + 100]), i


# ---- completion semantics and failures -----------------------------------------------------------
def test_completed_is_in_order_and_dead_peer_fails(nics, heaps):
    """Command 0 goes to a dead peer, command 1 to a live one. Command 1's data lands at once, but
    `completed` stays 0 (it only advances over a completed prefix) until command 0 fails with
    'retry exceeded' (0x15) after the NIC's retry timeout; then completed = 2, the error names
    command 0, the host quiet raises CompletionError, and nothing hangs."""
    a, b = nics
    lh, lmr, rh, rmr = heaps
    c = softnic.SoftNic(retry_timeout_s=0.3, name="proxy-dead")
    try:
        rc = c.alloc(4096)
        rcmr = c.reg_mr(rc)
        qa = a.create_qp(a.create_cq(64), sq_wqebbs=64)
        qc = c.create_qp(c.create_cq(64), sq_wqebbs=64)
        a.connect(qa, qc.info())
        c.connect(qc, qa.info())
        c.mark_down()
        lh[:64] = 7
        rh[:64] = 0
        ch = P.ProxyChannel(16)
        with P.ProxyEngine(a, [ch], [[qa], make_qps(a, b, 1)], lmr, [rcmr, rmr]) as eng:
            ch.push([P.encode(P.OP_PUT, 0, 64, 0, 0), P.encode(P.OP_PUT, 1, 64, 0, 0)])
            deadline = time.monotonic() + 5
            while rh[63] != 7 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert rh[63] == 7 and ch.completed == 0 and ch.error() is None
            with pytest.raises(gpunet.CompletionError) as ei:
                eng.quiet(ch, 2, timeout_s=5)
            assert ei.value.syndrome == mlx5.SYNDROME_TRANSPORT_RETRY_EXC_ERR
            assert ch.completed == 2 and ch.error()["seq"] == 0
    finally:
        c.close()


def test_bad_rkey_error_recorded_and_raised(nics, heaps):
    """A PUT with a wrong rkey completes with 'remote access error' (0x13): recorded in the
    channel (first failure wins over the flushes behind it), raised by quiet/check, no hang."""
    a, b = nics
    lh, lmr, rh, rmr = heaps
    ch = P.ProxyChannel(16)
    with P.ProxyEngine(a, [ch], [make_qps(a, b, 1)], lmr, [(rmr.addr, rmr.rkey ^ 0x100)]) as eng:
        issued = ch.push([P.encode(P.OP_PUT, 0, 64, 0, 0)] * 5)
        with pytest.raises(gpunet.CompletionError) as ei:
            eng.quiet(ch, issued, timeout_s=5)
        assert ei.value.syndrome == mlx5.SYNDROME_REMOTE_ACCESS_ERR
        assert ch.completed == 5 and ch.error()["seq"] == 0
        with pytest.raises(gpunet.CompletionError):
            eng.check()


def test_error_is_flagged_in_the_completed_word():
    """The one word a device quiet polls: HostCtrl.completed carries COMPLETED_ERROR once the
    channel recorded a failure (and keeps it as completed advances), so a quiet that reads only it
    fails (cpu_wait_completed reads it the same way: the packed error comes back even for a count
    already reached); ch.completed is the count without the bit; clear_error removes it. A clean
    channel never shows the bit."""
    ch = P.ProxyChannel(8)
    heap = np.zeros(64, np.uint8)
    with P.ProxyEngine(None, [ch], None, (heap.ctypes.data, 1), [(0, 2)], drain_only=True) as eng:
        eng.quiet(ch, ch.push([P.encode(P.OP_NOP, 0, 0, 0, 0)] * 3))
        raw = lambda: int(ch._hctrl.view(np.uint64)[P.HC_COMPLETED])      # noqa: E731
        assert raw() == 3 == ch.completed                                 # no failure: no bit
        ch.push([P.encode(P.OP_PUT, 7, 8, 0, 0)])                         # peer 7: no such QP
        with pytest.raises(gpunet.GpunetError, match="rejected"):
            eng.quiet(ch, 4)
        assert raw() == P.COMPLETED_ERROR | 4 and ch.completed == 4
        assert P.cpu_wait_completed(ch.hctrl_addr, 1, int(1e9)) == ch.error()["word"]
        ch.push([P.encode(P.OP_NOP, 0, 0, 0, 0)])
        deadline = time.monotonic() + 10
        while ch.completed < 5 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert raw() == P.COMPLETED_ERROR | 5                             # kept as it advances
    ch.clear_error()
    assert raw() == 5 and ch.error() is None
    assert P.cpu_wait_completed(ch.hctrl_addr, 5, int(1e9)) == 0


def test_malformed_command_recorded():
    """An op the proxy does not know (or a peer it has no QP for) is recorded as a bad command and
    completes, so quiet raises instead of hanging."""
    ch = P.ProxyChannel(8)
    heap = np.zeros(64, np.uint8)
    with P.ProxyEngine(None, [ch], None, (heap.ctypes.data, 1), [(0, 2)], drain_only=True) as eng:
        ch.push([P.encode(P.OP_NOP, 0, 0, 0, 0), P.encode(31, 0, 0, 0, 0),
                 P.encode(P.OP_PUT, 3, 8, 0, 0)])
        with pytest.raises(gpunet.ConfigError, match="rejected command #1"):
            eng.quiet(ch, 3)
        assert ch.error()["seq"] == 1 and ch.completed == 3


def test_close_is_idempotent_and_stops_threads(nics):
    """close() joins every proxy thread, twice is fine, and a closed engine refuses quiet."""
    ch = P.ProxyChannel(8)
    heap = np.zeros(64, np.uint8)
    eng = P.ProxyEngine(None, [ch], None, (heap.ctypes.data, 1), [(0, 2)], threads=2,
                        drain_only=True)
    assert len(eng.alive_threads()) == 2
    eng.close()
    eng.close()
    assert eng.alive_threads() == []
    assert not [t for t in threading.enumerate() if t.name.startswith("gpunet-proxy")]
    with pytest.raises(gpunet.ClosedError):
        eng.quiet(ch, 0)


def test_idle_engines_answer_a_doorbell_in_time(nics, heaps):
    """rawmem's idle policy, end to end: after an idle spell longer than the yield window, the
    proxy thread and both soft-NIC engines SLEEP (a 60 ms idle spell costs each of them at most a
    few hundred passes, where a spinning or yielding thread makes tens of thousands), yet a
    command pushed then completes within a few sleep periods (median of 15 samples < 20 ms, the
    idle sleep being capped at IDLE_SLEEP_MAX_US), and close() stops a sleeping proxy at once."""
    from gpunet.host.rawmem import IDLE_SLEEP_MAX_US, IDLE_YIELD_NS
    a, b = nics
    lh, lmr, rh, rmr = heaps
    (qa,) = make_qps(a, b, 1)
    ch = P.ProxyChannel(64)
    eng = P.ProxyEngine(a, [ch], [[qa]], lmr, [rmr], spin_us=0)
    try:
        ch.push([P.encode(P.OP_PUT, 0, 64, 0, 0)])
        eng.quiet(ch, ch.head)
        idle = IDLE_YIELD_NS / 1e9 + 0.01            # past the yield window: sleeping now
        time.sleep(idle)
        p0, na0, nb0 = eng.stats_dict()["passes"], a.stats()["engine_passes"], \
            b.stats()["engine_passes"]
        time.sleep(0.06)
        p1, na1, nb1 = eng.stats_dict()["passes"], a.stats()["engine_passes"], \
            b.stats()["engine_passes"]
        most = int(0.06 / (IDLE_SLEEP_MAX_US * 1e-6) * 4) + 50      # 4x slack for timer jitter
        assert p1 - p0 < most and na1 - na0 < most and nb1 - nb0 < most, (p1 - p0, na1 - na0,
                                                                           nb1 - nb0, most)
        lat = []
        for _ in range(15):
            time.sleep(idle)
            t0 = time.perf_counter()
            eng.quiet(ch, ch.push([P.encode(P.OP_PUT, 0, 64, 0, 0)]), timeout_s=5.0)
            lat.append(time.perf_counter() - t0)
        # 200 us sleeps: a command waits ~0.5 ms (two sleepers in a row) on an idle machine; the
        # bound leaves room for a loaded 2-core CI machine, and still fails an engine that sleeps
        # 10x longer than IDLE_SLEEP_MAX_US or misses doorbells
        assert sorted(lat)[len(lat) // 2] < 0.02, lat
        time.sleep(idle)
        t0 = time.perf_counter()
        eng.close()
        assert time.perf_counter() - t0 < 0.5 and eng.alive_threads() == []
    finally:
        eng.close()
        ch.close()


def test_engine_threads_pin_to_the_cpus_asked():
    """SoftNic(cpus=) and ProxyEngine(cpus=) pin their threads (and only them: the caller's
    affinity is unchanged) and record what each got; the kernel agrees (/proc Cpus_allowed_list).
    An impossible CPU set is a ConfigError from the thread, reported by check()."""
    import os
    allowed = sorted(os.sched_getaffinity(0))
    one, other = allowed[-1], allowed[0]
    nic = softnic.SoftNic(cpus=[one], name="pin")
    ch = P.ProxyChannel(8)
    heap = np.zeros(64, np.uint8)
    eng = P.ProxyEngine(None, [ch], None, (heap.ctypes.data, 1), [(0, 2)], drain_only=True,
                        cpus=[[other]])
    try:
        deadline = time.monotonic() + 10
        while (nic.placement is None or eng.placement[0] is None) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert nic.placement["cpus"] == [one] and eng.placement[0]["cpus"] == [other]
        for rec, cpu in ((nic.placement, one), (eng.placement[0], other)):
            with open("/proc/self/task/%d/status" % rec["tid"]) as f:
                line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
            assert line.split(":")[1].strip() == str(cpu)
        assert sorted(os.sched_getaffinity(0)) == allowed
        ch.push([P.encode(P.OP_NOP, 0, 0, 0, 0)])
        eng.quiet(ch, 1)
    finally:
        eng.close()
        ch.close()
        nic.close()
    bad = P.ProxyEngine(None, [P.ProxyChannel(8)], None, (heap.ctypes.data, 1), [(0, 2)],
                        drain_only=True, cpus=[[100000]])
    bad.close()
    with pytest.raises(gpunet.GpunetError, match="cannot pin"):
        bad.check()


# ---- device code on the HOST arm ----------------------------------------------------------------
def _descs(chans):
    """The channels' device descriptors, as one array (device/descriptors.proxy_channel_desc)."""
    from gpunet.device.abi import ProxyChannelDesc
    from gpunet.device.descriptors import proxy_channel_desc

    return (ProxyChannelDesc * len(chans))(*[proxy_channel_desc(c) for c in chans])


def _launch_produce(kernels, chans, status, mode, warp, grid, block, per_thread, size, stride,
                    sig_base=0, active_mod=0, timeout_s=5.0, npeers=1):
    import ctypes
    f = kernels.proxy_produce
    f.argtypes = [ctypes.c_uint32] * 3 + [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p,
                                          ctypes.c_uint64] + [ctypes.c_uint32] * 5 + [
        ctypes.c_uint64, ctypes.c_uint32]
    d = _descs(chans)
    rc = f(grid, block, warp, ctypes.addressof(d), len(chans), status.ctypes.data, int(timeout_s * 1e9),
           mode, npeers, per_thread, size, stride, sig_base, active_mod)
    assert rc == 0


@pytest.mark.parametrize("warp", [32, 64])
@pytest.mark.parametrize("mode", [0, 1, 2], ids=["push", "push_warp", "put_signal"])
def test_host_arm_kernel_through_proxy(kernels, nics, heaps, warp, mode):
    """proxy.cuh run as device code (HOST arm, 2 blocks x 64 threads, warps of 32 / 64): every
    thread pushes 3 PUTs of 48 bytes (push: per thread; push_warp: one reservation per warp with
    every 5th command's lane inactive; put_signal: each PUT followed by SIGNAL_ADD(+1) on the
    thread's own signal word) on 2 channels and quiets; the data and signals arrive and the
    Status block stays clean."""
    a, b = nics
    lh, lmr, rh, rmr = heaps
    lh[:] = np.arange(HEAP) % 251
    rh[:] = 0
    grid, block, per, size, stride = 2, 64, 3, 48, 64
    sig_base = HEAP - 8 * grid * block
    status = np.zeros(128, np.uint8)
    chans = [P.ProxyChannel(64), P.ProxyChannel(64)]
    active_mod = 5 if mode == 1 else 0
    with P.ProxyEngine(a, chans, [make_qps(a, b, 2)], lmr, [rmr], threads=1) as eng:
        _launch_produce(kernels, chans, status, mode, warp, grid, block, per, size, stride,
                        sig_base, active_mod)
        assert int(status.view(np.uint64)[0]) == 0, status.view(np.uint32)[:8]
        for ch in chans:
            eng.quiet(ch, ch.head)
    n = grid * block * per
    active = [active_mod < 2 or i % active_mod != active_mod - 1 for i in range(n)]
    for i in range(n):
        o = i * stride
        want = lh[o:o + size] if active[i] else np.zeros(size, np.uint8)
        assert np.array_equal(rh[o:o + size], want), i
    assert sum(c.head for c in chans) == sum(active) * (2 if mode == 2 else 1)
    if mode == 2:
        sig = rh[sig_base:sig_base + 8 * grid * block].view("=u8")
        assert (sig == per).all()


def test_host_arm_full_fifo_records_timeout(kernels):
    """No proxy running, depth 8, 64 device threads pushing: the pushes past the 8th wait their
    bound, STATUS_TIMEOUT / SITE_PROXY_FIFO is recorded (first failure wins), the kernel returns."""
    status = np.zeros(128, np.uint8)
    ch = P.ProxyChannel(8)
    t0 = time.monotonic()
    _launch_produce(kernels, [ch], status, 0, 32, 1, 64, 1, 8, 8, timeout_s=0.1)
    assert time.monotonic() - t0 < 20
    s32 = status.view(np.uint32)
    # code, site: the FIFO wait of a thread that got no slot, or (they race, both bounded by
    # 0.1 s) the quiet of one of the 8 that did
    assert int(status.view(np.uint64)[0]) == STATUS_TIMEOUT and s32[4] in (16, 17)
    assert ch.head == 64


def test_recovery_cycles_reuse_the_landing_slots():
    """A proxy Context recovers from a protection error (a put injected past the heap) by
    starting a new proxy engine on the same channel and QPs; the new engine takes over the old
    one's landing slots (ProxyEngine's scratch), so after a first cycle, 4 more leave the NIC's
    next allocation exactly where it was (each used to take 64 B per QP of never-freed NIC
    memory), and put_signal ADDs (whose fetched value lands in those slots) and atomics still
    count right after every cycle."""
    import torch
    from gpunet.errors import CompletionError
    from mp_jobs import inject_bad_put

    ctx = gpunet.init(transport="proxy", nic="soft", heap_bytes=4 << 20, timeout_s=10.0)
    try:
        src = ctx.alloc((256,), torch.uint8)
        dst = ctx.alloc((256,), torch.uint8)
        sig = ctx.alloc((2,), torch.int64)

        def cycle(n):
            with pytest.raises(CompletionError, match="reset to RTS"):
                inject_bad_put(ctx, 0, src)
                ctx.quiet()
            src[:] = (torch.arange(256) + n).to(torch.uint8)
            ctx.put_signal(ctx.remote(0, dst), src, ctx.remote(0, sig), 3)
            ctx.wait_until(sig, 3 * (n + 1))
            assert torch.equal(dst, src)
            assert ctx.atomic_add(ctx.remote(0, sig, 1), 1) == n

        def used():                                  # the soft NIC arena's allocation top
            return int(ctx.nic._arena.T[softnic.H_HEAP_TOP])

        cycle(0)
        before, engine = used(), ctx._transports.engine
        for n in range(1, 5):
            cycle(n)
        assert ctx._transports.engine is not engine  # every cycle started a new engine
        assert used() == before
    finally:
        ctx.close()


def _roundtrip_setup(kernels, depth):
    """kernels/proxy.cu's one-thread ``proxy_roundtrip`` bound, a CPU-memory channel of ``depth``
    with its descriptor, a heap, the output words and a zeroed Status."""
    f = kernels.proxy_roundtrip
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32,
                  ctypes.c_uint32, ctypes.c_void_p]
    ch = P.ProxyChannel(depth)
    return (f, ch, np.zeros(1 << 16, np.uint8), _descs([ch]), np.zeros(4, np.uint64),
            np.zeros(128, np.uint8))


def test_host_arm_push_after_a_failure_fills_its_slots_with_nops(kernels):
    """A failure already recorded in the Status when a device thread pushes (proxy_push reads the
    Status with its reservation in flight): the push returns false, the reserved slots hold NOPs
    (valid, op NOP), which a drain-only proxy completes, so the channel stays whole: a push after
    the Status is cleared goes through and completes."""
    f, ch, heap, desc, out, status = _roundtrip_setup(kernels, 16)
    status.view(np.uint64)[0] = STATUS_TIMEOUT               # as a kernel records it (code)
    with P.ProxyEngine(None, [ch], None, (heap.ctypes.data, 1), [(0, 2)], drain_only=True) as eng:
        assert f(ctypes.addressof(desc), status.ctypes.data, int(5e9), 1, 64, out.ctypes.data) == 0
        assert ch.head == 1 and out[0] == 0                 # reserved, not timed: push failed
        w0 = int(np.frombuffer((ctypes.c_uint8 * 16).from_address(ch.fifo_addr), np.uint64)[0])
        assert P.cmd_op(w0) == P.OP_NOP and (w0 >> P.VALID_SHIFT) == 1
        eng.quiet(ch, 1, timeout_s=10)                      # the NOP completes
        status[:] = 0
        assert f(ctypes.addressof(desc), status.ctypes.data, int(5e9), 2, 64, out.ctypes.data) == 0
        assert int(status.view(np.uint64)[0]) == 0 and ch.head == 3 and ch.completed == 3
        assert out[0] > 0 and out[1] > 0


def test_host_arm_push_that_gives_up_on_a_full_fifo_leaves_a_hole_the_host_fills(kernels):
    """A failure already recorded while the FIFO is full (depth 4, 4 commands not yet taken): the
    push returns false at once and its slot stays empty (the previous lap's parity), so the proxy
    stops there (completed sticks at 4 of 5). ProxyChannel.fill_holes (what gpunet.context's
    recovery calls, no kernel running) writes a NOP there once the slot is free; the channel then
    drains to its head and a push after the Status is cleared goes through. Without the fill the
    channel would be lost for good (proxy.cuh "A push that gives up")."""
    f, ch, heap, desc, out, status = _roundtrip_setup(kernels, 4)
    ch.push([P.encode(P.OP_NOP, 0, 0, 0, 0)] * 4)          # no proxy yet: full
    assert ch.head == 4 and ch.tail == 0
    status.view(np.uint64)[0] = STATUS_TIMEOUT               # a failure recorded elsewhere
    assert f(ctypes.addressof(desc), status.ctypes.data, int(5e9), 1, 64, out.ctypes.data) == 0
    assert ch.head == 5 and out[0] == 0                     # reserved, gave up at once
    assert ch.fill_holes(5) == 0                            # slot 4 is not free yet (tail 0)
    with P.ProxyEngine(None, [ch], None, (heap.ctypes.data, 1), [(0, 2)], drain_only=True) as eng:
        eng.quiet(ch, 4, timeout_s=10)
        time.sleep(0.05)
        assert ch.completed == 4 and ch.tail == 4          # stopped at the hole
        w0 = int(np.frombuffer((ctypes.c_uint8 * 16).from_address(ch.fifo_addr), np.uint64)[0])
        assert (w0 >> P.VALID_SHIFT) == 1                   # lap 0's parity: not seq 4's
        assert ch.fill_holes(5) == 1 and ch.fill_holes(5) == 0
        eng.quiet(ch, 5, timeout_s=10)
        status[:] = 0
        assert f(ctypes.addressof(desc), status.ctypes.data, int(5e9), 2, 64, out.ctypes.data) == 0
        assert int(status.view(np.uint64)[0]) == 0 and ch.head == 7 and ch.completed == 7


def _nrt_calls(fn, sig):
    """Calls to numba's reference-count functions in the LLVM IR of ``fn`` compiled for ``sig``
    (a fresh, uncached compile: numba does not keep the IR of cached code)."""
    import re

    import numba
    probe = numba.njit(cache=False)(fn)
    probe.compile(sig)
    return len(re.findall(r"call [^\n]*@\"?NRT_(?:incref|decref)", probe.inspect_llvm(sig)))


def test_drain_helpers_make_no_reference_count_calls():
    """gpunet/host/proxy.py's drain rule: the per-command helpers get the engine state as the pointer
    tuple (_state) and scalars, so building a WQE (_post), completing a command (_mark_done) and
    publishing the counters (_advance_completed, _publish_tail) compile to code with no NRT
    incref / decref call (each an out-of-line call with a locked add when an array is passed,
    ~20 per command before the rule). Control: the same check counts the calls of a helper that
    takes an array, so it can see them. (_issue, which only calls these with S, is left out: its
    five inlined _post sites take ~45 s of CPU to compile afresh.)"""
    from numba import types as T
    p64, p32, p8, i64 = (T.CPointer(T.int64), T.CPointer(T.int32), T.CPointer(T.uint8), T.int64)
    state = T.Tuple((p64, p8, i64, p64, p32, p64, i64, p64, i64, i64, i64, i64))
    mark, post, adv, pub = P._mark_done, P._post, P._advance_completed, P._publish_tail

    def per_command(S, c, q, seq):
        post(S, q, c, seq, True, mlx5.OPCODE_RDMA_WRITE, 1, 2, 3, 4, 64, 0, False)
        mark(S, c, seq)
        adv(S, c)
        pub(S[0], c)
        return 0
    assert _nrt_calls(per_command, (state, i64, i64, i64)) == 0

    @njit(inline="always")
    def bump(a, i):
        a[i] += 1

    def with_an_array(a, i):
        bump(a, i)
        bump(a, i + 1)
        return a[i]
    assert _nrt_calls(with_an_array, (T.int64[::1], i64)) > 0
