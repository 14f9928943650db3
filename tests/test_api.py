"""The Python API across processes: 2 and 4 ranks (spawned, gloo), both transports.

Each rank process is started once per (world, transport) and fed generated jobs (mp_ranks.py).
"""
import os

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import gpunet
from gpunet.errors import ClosedError, ConfigError
from gpunet.host.bootstrap import free_port
from mp_jobs import SLOT_ELEMS, _pattern
from mp_ranks import Ranks

TRANSPORTS = ["ibgda", "proxy"]


# (ranks, transport, the ibgda QPs' posting mode: GPUNET_QP_POST_MODE)
@pytest.fixture(scope="module", params=[(2, "ibgda", "batched"), (2, "proxy", "batched"),
                                        (4, "ibgda", "batched"), (4, "proxy", "batched"),
                                        (2, "ibgda", "serial")],
                ids=lambda p: "%dranks-%s" % p[:2] + ("-serial" if p[2] == "serial" else ""))
def ranks(request):
    world, transport, post_mode = request.param
    r = Ranks(world, env={"GPUNET_QP_POST_MODE": post_mode})
    try:
        info = r.run("init", transport)
        assert all(set(i["transports"].values()) == {transport} for i in info)
        if transport == "ibgda":
            assert all(i["post_modes"] == [post_mode] * world for i in info), info
        r.world, r.transport = world, transport
        yield r
    finally:
        r.close()


def _ops(world):
    """(kind, src_rank, dst_rank, nbytes, offset): sizes 0..8 KiB, offsets keep it in its slot."""
    def row(kind, s, d, n, o):
        return (kind, s, d, n, min(o, SLOT_ELEMS - n))
    rank = st.integers(0, world - 1)
    return st.lists(st.builds(row, st.sampled_from(["put", "put_signal", "get"]), rank, rank,
                              st.one_of(st.integers(0, 64), st.integers(0, 8192)),
                              st.integers(0, SLOT_ELEMS)), min_size=1, max_size=12)


class TestAcrossRanks:
    _round = 0

    # Each example costs a round trip through every rank process: few examples, and no shrinking
    # (a failing case is printed whole; shrinking it would rerun the ranks hundreds of times).
    @settings(max_examples=max(3, settings().max_examples // 10), deadline=None,
              phases=[Phase.explicit, Phase.reuse, Phase.generate])
    @given(data=st.data())
    def test_put_get_put_signal_land_exactly(self, ranks, data):
        """Generated: lists of put / put_signal / get between random rank pairs, sizes 0..8 KiB,
        random offsets. Invariant: after quiet + barrier every destination slot holds exactly the
        bytes the last op targeting it wrote (slots are per source rank, ops in issue order), every
        byte nobody targeted is still zero, and each signal word counts its put_signals."""
        ops = data.draw(_ops(ranks.world))
        TestAcrossRanks._round += 1
        rnd = TestAcrossRanks._round
        out = ranks.run("exchange", ops, rnd)
        for d in range(ranks.world):
            expect = torch.zeros(2 * ranks.world * SLOT_ELEMS, dtype=torch.uint8)
            sigs = [0] * ranks.world
            for kind, s, dd, n, off in ops:
                if dd != d:
                    continue
                src = _pattern(s, rnd, SLOT_ELEMS)
                slot = s if kind != "get" else ranks.world + s
                expect[slot * SLOT_ELEMS + off: slot * SLOT_ELEMS + off + n] = src[:n]
                if kind == "put_signal":
                    sigs[s] += 1
            got = out[d]["dst"]
            assert torch.equal(got, expect), "rank %d: slots differ from the sequential reference: %r" % (d, ops)
            base = getattr(ranks, "sig_total", {}).get(d, [0] * ranks.world)
            now = out[d]["sigs"]
            assert [now[i] - base[i] for i in range(ranks.world)] == sigs
            ranks.__dict__.setdefault("sig_total", {})[d] = now

    def test_atomics_exact_across_ranks(self, ranks):
        """Every rank adds 1 to one counter 50 times: the old values are 0..total-1, each once."""
        k = 50
        before = ranks.run("atomics", 0)[0]["final"]
        out = ranks.run("atomics", k)
        olds = sorted(o for r in out for o in r["olds"])
        assert olds == list(range(before, before + k * ranks.world))
        assert out[0]["final"] == before + k * ranks.world

    def test_signal_implies_payload(self, ranks):
        """A receiver that sees signal >= k sees every payload put before the k-th signal."""
        bad = ranks.run("signal_order", 40, 256)
        assert bad[0] == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_killed_rank_makes_the_others_raise_in_bounded_time(transport):
    """Rank 1 dies without closing anything; rank 0's put + quiet + barrier raise a GpunetError
    within the configured timeout (3 s) plus slack: no hang. Rank 0 closing then reclaims the
    shared-memory arena rank 1 left in /dev/shm."""
    r = Ranks(2)
    try:
        info = r.run("init", transport, 8 << 20, 3.0)
        for q in r.inboxes:
            q.put(("die_if", (1,)))
        assert r.outboxes[0].get(timeout=60) == ("ok", "alive")
        r.procs[1].join(timeout=30)
        r.inboxes[0].put(("put_to", (1, 3.0)))
        status, res = r.outboxes[0].get(timeout=60)
        assert status == "ok", res
        assert res["raised"] in ("TimeoutError", "CompletionError"), res
        assert res["seconds"] < 20, res
        r.inboxes[0].put(("close", ()))
        status, res = r.outboxes[0].get(timeout=60)
        assert status == "ok" and not res["arena_left"], res
        assert not os.path.exists("/dev/shm/" + info[1]["arena"]), "the dead rank's arena stayed"
    finally:
        r.lose(1)
        r.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_close_frees_everything(transport):
    """Closing a Context leaves no /dev/shm arena and no engine or proxy thread, on every rank."""
    r = Ranks(2)
    try:
        r.run("init", transport)
        for res in r.run("close"):
            assert not res["arena_left"] and res["threads"] == [], res
    finally:
        r.close()


# --- single-rank input checks (no processes needed) -------------------------------------------
@pytest.fixture(scope="module")
def ctx():
    c = gpunet.init(heap_bytes=4 << 20)
    yield c
    c.close()


def test_bad_input_raises_before_posting(ctx):
    """Wrong device, non-contiguous, outside the heap, size mismatch, bad rank, bad arguments:
    each raises ConfigError naming the problem, and nothing is posted (the QP's counters stay)."""
    x = ctx.alloc((64,), torch.float32)
    y = ctx.alloc((16,), torch.float32)
    before = ctx._dev.peers[0].qp and ctx._dev._keep[0].heads()
    cases = [
        (lambda: gpunet.put(ctx.remote(0, y), torch.empty(4, device="meta")), "meta"),
        (lambda: gpunet.put(ctx.remote(0, y), x.view(8, 8).t()), "contiguous"),
        (lambda: gpunet.put(ctx.remote(0, y), torch.zeros(4)), "outside the symmetric heap"),
        (lambda: gpunet.put(ctx.remote(0, y), x), "do not fit"),
        (lambda: ctx.remote(1, y), "out of range"),
        (lambda: ctx.remote(-1, y), "out of range"),
        (lambda: ctx.remote(0, y, 17), "offset"),
        (lambda: gpunet.put(("rank", 0), x), "Remote"),
        (lambda: gpunet.atomic_add(ctx.remote(0, y, 1), 1), "8-byte aligned"),
        (lambda: ctx.alloc((-1,), torch.float32), "shape"),
        (lambda: ctx.alloc((4,), "float"), "dtype"),
        (lambda: ctx.alloc((1 << 30,), torch.float32), "heap full"),
        (lambda: gpunet.init(transport="carrier-pigeon"), "transport"),
    ]
    for fn, words in cases:
        with pytest.raises(ConfigError, match=words):
            fn()
    assert (ctx._dev.peers[0].qp and ctx._dev._keep[0].heads()) == before


def test_single_rank_put_get_atomic(ctx):
    """One rank, through its loopback QP: put, get and atomic_add move the right bytes."""
    a = ctx.alloc((256,), torch.int32)
    b = ctx.alloc((256,), torch.int32)
    c = ctx.alloc((1,), torch.int64)
    a[:] = torch.arange(256, dtype=torch.int32)
    gpunet.put(ctx.remote(0, b), a)
    gpunet.quiet()
    assert torch.equal(a, b)
    a.zero_()
    gpunet.get(a[:100], ctx.remote(0, b, 50))
    gpunet.quiet()
    assert torch.equal(a[:100], torch.arange(50, 150, dtype=torch.int32))
    assert [gpunet.atomic_add(ctx.remote(0, c), 7) for _ in range(3)] == [0, 7, 14]
    assert gpunet.read_signal(c) == 21
    gpunet.barrier()


def test_device_context_image_is_a_copy_of_the_kernels_devctx(ctx):
    """ctx.device_context_image() holds the same bytes as the DevCtx a kernel gets
    (device_context().ptr: host memory on the CPU) and is a copy: changing it changes nothing."""
    import ctypes

    from gpunet.device import abi
    h = ctx.device_context()
    img = ctx.device_context_image()
    assert isinstance(img, abi.DevCtx)
    assert bytes(img) == ctypes.string_at(h.ptr, ctypes.sizeof(abi.DevCtx))
    assert (img.local_base, img.npes, img.my_pe) == (h.heap_base, h.world_size, h.rank)
    img.timeout_ns += 1
    assert ctx.device_context_image().timeout_ns == img.timeout_ns - 1


def test_use_after_close_raises():
    c = gpunet.init(heap_bytes=1 << 20)
    x = c.alloc((4,), torch.float32)
    c.close()
    c.close()                     # idempotent
    with pytest.raises(ClosedError):
        c.put(c.remote(0, x), x)
    with pytest.raises(ClosedError):
        c.alloc((4,), torch.float32)
    with pytest.raises(ClosedError):
        gpunet.quiet(ctx=c)


def test_context_closes_after_an_error():
    """An exception inside ``with gpunet.init()`` still frees the arena and stops the engine."""
    with pytest.raises(RuntimeError):
        with gpunet.init(heap_bytes=1 << 20) as c:
            name = c.nic.arena_name
            raise RuntimeError("user code failed")
    assert c.closed and not os.path.exists("/dev/shm/" + name)


def test_auto_transport_falls_back_to_the_proxy_when_the_doorbell_cannot_be_mapped():
    """choose_transport: a driver that refuses to map the doorbell (cudaHostRegister IoMemory,
    error 800) makes "auto" pick the proxy and say why; "ibgda" then raises; "proxy" never probes."""
    from gpunet.transports import choose_transport
    from gpunet.host.platform import ERR_NOT_PERMITTED, VendorRuntimeError

    def refused():
        raise VendorRuntimeError("not permitted", call="cudaHostRegister", code=ERR_NOT_PERMITTED)

    def mapped():
        return "UAR mapped"

    def must_not_probe():
        raise AssertionError("proxy must not probe the doorbell")

    t, why = choose_transport("auto", refused)
    assert t == "proxy" and "800" in why and "cudaHostRegister" in why
    assert choose_transport("auto", mapped) == ("ibgda", "auto: UAR mapped")
    assert choose_transport("proxy", must_not_probe)[0] == "proxy"
    with pytest.raises(ConfigError, match="doorbell"):
        choose_transport("ibgda", refused)


def test_context_logs_the_transport_of_every_peer(caplog):
    """init() logs, per peer, the transport it got and why."""
    import logging
    with caplog.at_level(logging.INFO, logger="gpunet"):
        c = gpunet.init(heap_bytes=1 << 20)
        c.close()
    assert any("-> peer 0: ibgda (auto:" in r.getMessage() for r in caplog.records), caplog.text


def test_init_under_torchrun():
    """torchrun starts 2 ranks; gpunet.init() bootstraps from its environment (gloo on the CPU),
    each rank puts to the next and checks what it received."""
    import subprocess
    import sys

    job = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun_job.py")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), job],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "torchrun rank 0 of 2 OK" in r.stdout and "torchrun rank 1 of 2 OK" in r.stdout
