"""The Python hot path of put / quiet on the CPU arm (bench/cpu_put.py measures it): what it
launches, what it still raises, and that the OpDesc it builds by hand is op_list's.
"""
import ctypes
import time

import pytest
import torch

import gpunet
from gpunet import _launch
from gpunet.device import abi


@pytest.fixture(params=["ibgda", "proxy"])
def ctx(request):
    c = gpunet.init(transport=request.param, heap_bytes=4 << 20, timeout_s=20.0)
    yield c
    c.close()


def _count_launches(ctx):
    """Wrap the Context's launcher: returns the list every run() appends its OpDescs' bytes to."""
    seen, run = [], ctx._launcher.run

    def counting(ops, *a, **k):
        seen.append(bytes(ops))
        return run(ops, *a, **k)
    ctx._launcher.run = counting
    return seen


def test_cpu_quiet_launches_nothing_until_the_devctx_is_out(ctx):
    """On the CPU arm every launch of the Context runs to its end and its kernel quiets, so quiet()
    launches nothing while no user kernel can exist; once device_context() (or its image) is
    handed out, quiet() launches its kernel again. The data of the put is there either way."""
    x = ctx.alloc((64,), torch.uint8)
    y = ctx.alloc((64,), torch.uint8)
    x.copy_(torch.arange(64, dtype=torch.uint8))
    seen = _count_launches(ctx)
    gpunet.put(ctx.remote(0, y), x)
    gpunet.quiet()
    assert len(seen) == 1 and torch.equal(x, y)
    ctx.device_context()
    gpunet.quiet()
    assert len(seen) == 2
    quiet = abi.OpDesc.from_buffer_copy(seen[1][:ctypes.sizeof(abi.OpDesc)])
    assert quiet.kind == abi.OP_QUIET


def test_cpu_quiet_without_a_launch_still_raises_what_was_recorded(ctx):
    """A failure recorded in the Status block (as a kernel records it) is raised by quiet() on the
    path that launches nothing, then cleared: the next quiet() returns."""
    st = ctx._dev.status
    st.code, st.valid, st.site, st.peer, st.expected = abi.STATUS_TIMEOUT, 1, abi.SITE_QUIET, 0, 5
    with pytest.raises(gpunet.TimeoutError):
        gpunet.quiet()
    gpunet.quiet()


@pytest.mark.parametrize("nbytes", [0, 1, 64, 4096])
def test_put_opdesc_is_the_op_list_one(ctx, nbytes):
    """put() builds its OpDesc field by field: byte for byte the op_list OpDesc of the same put
    (kind, peer, heap addresses, size; the kernel's outputs zero)."""
    x = ctx.alloc((max(nbytes, 1),), torch.uint8)[:nbytes]
    y = ctx.alloc((8192,), torch.uint8)
    r = ctx.remote(0, y, 128)
    seen = _count_launches(ctx)
    ctx._launcher.run = lambda ops, *a, **k: seen.append(bytes(ops)) or (ops, None, True)
    gpunet.put(r, x)
    src = ctx.heap_base + ctx._heap.offset_of(x, "test")    # an empty view's data_ptr() is 0
    want = _launch.op_list(dict(kind=abi.OP_PUT, pe=0, dst=y.data_ptr() + 128, src=src, nbytes=nbytes))
    assert seen == [bytes(want)]


def _twenty_rounds(ctx, x, y, sig, word):
    """20 rounds of put + quiet, put_signal + wait_until and atomic_add to this rank itself
    (x, y: 256 uint8; sig: 2 int64; word: 1 int64, zero at the start), each result checked."""
    for i in range(20):
        x.copy_(torch.randint(0, 256, (256,), dtype=torch.uint8))
        gpunet.put(ctx.remote(0, y), x)
        gpunet.quiet()
        assert torch.equal(x, y)
        gpunet.put_signal(ctx.remote(0, y, 128), x[:64], ctx.remote(0, sig, 1))
        gpunet.wait_until(sig, i + 1, "ge", index=1)
        assert torch.equal(y[128:192], x[:64])
        assert gpunet.atomic_add(ctx.remote(0, word), 3) == 3 * i


def _stop_engine_thread(nic):
    """End the soft NIC's engine thread but leave the NIC up: from then on only a progress hook
    (a waiting HOST-arm device thread) executes its WQEs."""
    from gpunet.host import softnic

    T = nic._arena.T
    T[softnic.H_STOP] = 1
    nic._thread.join(timeout=10)
    assert not nic._thread.is_alive()
    T[softnic.H_STOP] = 0


def test_a_waiting_caller_executes_its_nics_work(ctx):
    """With the NIC's engine thread stopped, put + quiet, put_signal + wait_until and an atomic
    still complete with the right bytes: the caller's thread, spinning in the ops kernel,
    executes its NIC's WQEs through the progress hook (host_simt.h; gpunet/host/progress.py).
    Over the proxy the proxy thread posts them and the waiting caller executes them. Without the
    hook each of these waits times out."""
    x = ctx.alloc((256,), torch.uint8)
    y = ctx.alloc((256,), torch.uint8)
    sig = ctx.alloc((2,), torch.int64)
    word = ctx.alloc((1,), torch.int64)
    _stop_engine_thread(ctx.nic)
    wqes = ctx.nic.stats()["wqes"]
    _twenty_rounds(ctx, x, y, sig, word)
    assert ctx.nic.stats()["wqes"] >= wqes + 60


def test_closed_nics_hooks_are_gone(ctx):
    """close() removes the NIC's progress hook before its arena is unmapped: a later Context's
    waits run the hooks of the ops library again (a stale hook would touch the unmapped arena
    and crash the process) and complete."""
    from gpunet.host import progress

    lib = ctx._launcher.lib
    assert progress.registered(ctx.nic._progress) >= 1
    ctx.close()
    assert progress.registered(ctx.nic._progress) == 0
    c2 = gpunet.init(transport="ibgda", heap_bytes=4 << 20, timeout_s=20.0)
    try:
        assert c2._launcher.lib is lib
        x = c2.alloc((64,), torch.uint8)
        y = c2.alloc((64,), torch.uint8)
        x.fill_(7)
        gpunet.put(c2.remote(0, y), x)
        gpunet.quiet()
        assert torch.equal(x, y)
    finally:
        c2.close()


@pytest.mark.parametrize("op,value", [("add", 1), ("set", 2**64 - 1), ("add", -1), ("set", 2**63)])
def test_put_signal_opdesc_is_the_op_list_one(ctx, op, value):
    """put_signal() builds its OpDesc field by field: byte for byte the op_list OpDesc of the
    same put_signal (payload, signal address, the value as an unsigned word, ADD / SET)."""
    x = ctx.alloc((64,), torch.uint8)
    y = ctx.alloc((64,), torch.uint8)
    sig = ctx.alloc((4,), torch.int64)
    seen = []
    ctx._launcher.run = lambda ops, *a, **k: seen.append(bytes(ops)) or (ops, None, True)
    gpunet.put_signal(ctx.remote(0, y, 8), x[:16], ctx.remote(0, sig, 2), value, op=op)
    want = _launch.op_list(dict(
        kind=abi.OP_PUT_SIGNAL, pe=0, dst=y.data_ptr() + 8, src=x.data_ptr(), nbytes=16,
        sig=sig.data_ptr() + 16, value=value % 2**64,
        cmp=abi.SIGNAL_ADD if op == "add" else abi.SIGNAL_SET))
    assert seen == [bytes(want)]


@pytest.mark.parametrize("cmp,value,index", [("ge", 3, 1), ("eq", 2**64 - 1, 0), ("lt", -5, 2)])
def test_wait_until_opdesc_is_the_op_list_one(ctx, cmp, value, index):
    """wait_until() builds its OpDesc field by field: byte for byte the op_list OpDesc (own
    rank, the word's address, the comparison, the value as an unsigned word)."""
    sig = ctx.alloc((4,), torch.int64)
    seen = []
    ctx._launcher.run = lambda ops, *a, **k: seen.append(bytes(ops)) or (ops, None, True)
    gpunet.wait_until(sig, value, cmp, index=index)
    cmps = {"ge": abi.CMP_GE, "eq": abi.CMP_EQ, "lt": abi.CMP_LT}
    want = _launch.op_list(dict(kind=abi.OP_WAIT_UNTIL, pe=ctx.rank, dst=sig.data_ptr() + 8 * index,
                                cmp=cmps[cmp], value=value % 2**64))
    assert seen == [bytes(want)]


@pytest.mark.parametrize("bad", [True, 1.0, 2**64, -(2**63) - 1, "1"])
def test_fast_paths_still_refuse_bad_operands(ctx, bad):
    """The plain-int fast paths of remote / put_signal / wait_until leave every other operand to
    the full checks: a bool, a float, a string or an int outside [-2**63, 2**64) raises
    ConfigError (never a TypeError or a silent wrap)."""
    x = ctx.alloc((64,), torch.uint8)
    sig = ctx.alloc((2,), torch.int64)
    with pytest.raises(gpunet.ConfigError):
        gpunet.put_signal(ctx.remote(0, x), x[:8], ctx.remote(0, sig, 0), bad)
    with pytest.raises(gpunet.ConfigError):
        gpunet.wait_until(sig, bad, "ge")
    if not (type(bad) is int and bad >= 0):
        with pytest.raises(gpunet.ConfigError):
            ctx.remote(bad, x)
        with pytest.raises(gpunet.ConfigError):
            ctx.remote(0, x, bad)
        with pytest.raises(gpunet.ConfigError):
            gpunet.wait_until(sig, 0, "ge", index=bad)


def test_a_waiting_caller_drains_the_proxy():
    """Over the proxy, with the proxy thread and the NIC's engine thread both stopped, put +
    quiet, put_signal + wait_until and an atomic still complete with the right bytes: the waiting
    caller runs the proxy's drain pass (gpunet/host/proxy.py proxy_progress_hook, under the thread's
    pass lock) and the NIC's engine pass on its own thread. Without the proxy's hook the quiet
    times out."""
    c = gpunet.init(transport="proxy", heap_bytes=4 << 20, timeout_s=20.0)
    try:
        x = c.alloc((256,), torch.uint8)
        y = c.alloc((256,), torch.uint8)
        sig = c.alloc((2,), torch.int64)
        word = c.alloc((1,), torch.int64)
        eng = c._transports.engine
        eng._stop_word[0] = 1
        for th in eng._threads:
            th.join(timeout=10)
            assert not th.is_alive()
        eng._stop_word[0] = 0
        _stop_engine_thread(c.nic)
        cmds = eng.stats_dict()["commands"]
        _twenty_rounds(c, x, y, sig, word)
        assert eng.stats_dict()["commands"] >= cmds + 60
    finally:
        c.close()


@pytest.mark.parametrize("transport", ["ibgda", "proxy"])
def test_an_idle_cpu_contexts_nic_engine_wakes_at_most_every_ms(transport):
    """A Context on the CPU lets its NIC's engine thread, and the proxy threads that follow the
    NIC's cap, sleep up to rawmem.HOOKED_IDLE_SLEEP_MAX_US when idle (its waiters run their
    passes): over 1 s of idleness each makes at most ~1 pass per ms (plus slack), not the ~5 per
    ms of the 200 us cap that an engine nobody progresses keeps (measured: ~4100 vs ~940). Load
    only lengthens sleeps, so the bound holds on a busy machine."""
    from gpunet.host import rawmem, softnic

    c = gpunet.init(transport=transport, heap_bytes=4 << 20, timeout_s=20.0)
    try:
        T = c.nic._arena.T
        eng = c._transports.engine
        assert int(T[softnic.H_SLEEP_MAX_US]) == rawmem.HOOKED_IDLE_SLEEP_MAX_US
        time.sleep(0.1)                       # past the yield window and the back-off ramp
        n0 = int(T[softnic.H_ITERS])
        p0 = eng.stats_dict()["passes"] if eng is not None else 0
        time.sleep(1.0)
        bound = 1.6e6 / rawmem.HOOKED_IDLE_SLEEP_MAX_US
        assert int(T[softnic.H_ITERS]) - n0 < bound
        if eng is not None:
            assert eng.stats_dict()["passes"] - p0 < bound
    finally:
        c.close()


def test_a_marked_down_nic_is_not_run_by_its_waiting_caller():
    """The progress hook honours the NIC's down flag as the engine thread does: after
    mark_down() a put is not executed by the caller that waits for it; its quiet times out
    (bounded) and no byte lands."""
    c = gpunet.init(transport="ibgda", heap_bytes=4 << 20, timeout_s=1.0)
    try:
        x = c.alloc((64,), torch.uint8)
        y = c.alloc((64,), torch.uint8)
        x.fill_(9)
        c.nic.mark_down()
        wqes = c.nic.stats()["wqes"]
        with pytest.raises(gpunet.TimeoutError):
            gpunet.put(c.remote(0, y), x)
            gpunet.quiet()
        assert c.nic.stats()["wqes"] == wqes and not y.any()
    finally:
        c.close()


class _FakeStatus:
    code = 0


class _FakeDev:
    def read_status(self):
        return _FakeStatus()


def test_the_cuda_launcher_waits_for_every_stream_it_launched_on(monkeypatch):
    """The CUDA Launcher's stream bookkeeping, with torch.cuda's calls recorded instead of made
    (no GPU here; tests/test_api_cuda.py test_quiet_waits_for_a_put_on_another_stream runs it
    on one). Launches on one stream: a sync waits for that stream only. Launches on two: a sync
    waits for the whole device (a kernel on the other stream still reads its ring slots), and a
    quiet launched on one of them first waits for the device too. Every wait frees the ring."""
    calls, cur = [], [11]
    monkeypatch.setattr(_launch, "current_stream_handle", lambda device=None: cur[0])

    class Stream:
        def synchronize(self):
            calls.append(("stream", cur[0]))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("device",)))
    lau = _launch.Launcher.__new__(_launch.Launcher)
    lau._gpu, lau._device, lau.dev, lau._top, lau._streams = True, 0, _FakeDev(), 7, set()
    lau.stream()
    lau.stream()
    assert lau.sync("one stream") is None and calls == [("stream", 11)] and lau._top == 0
    cur[0] = 22
    lau.stream()                  # a side stream
    cur[0] = 11
    lau.stream()
    lau._top = 3
    lau.sync("two streams")
    assert calls[1:] == [("device",)] and lau._top == 0 and lau._streams == set()
    launched = []
    lau.lib = type("Lib", (), {"gpunet_ops_launch_stream": lambda *a: launched.append(a) or 0})()
    ring = (abi.OpDesc * 4)()     # kept alive: the launch copies the OpDescs into it
    lau._ring = type("Ring", (), {"ctypes": type("C", (), {"data": ctypes.addressof(ring)})()})()
    lau.dev.addr, lau.warp_size = 0, 32
    cur[0] = 22
    lau.stream()                  # a put on the side stream, then a quiet from stream 11
    cur[0] = 11
    lau._run_gpu(_launch.op_list(dict(kind=abi.OP_QUIET)), "quiet", blocking=False)
    assert calls[2:] == [("device",)] and len(launched) == 1 and lau._streams == {11}
