"""p2p on an NVIDIA GPU: ``gpunet.init(transport="p2p")`` puts the heap in device memory (cudaMalloc),
the ranks open each other's heaps by CUDA IPC handles, and the kernels store into them directly
(gpunet/context.py, gpunet/transports.py, gpunet/host/platform.py ipc_export / ipc_open).

One rank in this process (p2p to itself), then two rank processes on ONE GPU under a private MPS
daemon the module starts and stops (FACTS.md: without MPS the processes' kernels are time-sliced,
4.5 ms a round trip; a daemon that cannot start fails the test, it does not skip). The GPU tests
are skipped with the reason where torch.cuda is not available (scripts/gpu-check.sh runs them on
the H200, where a skip counts as a failure). Mixed worlds (p2p beside ibgda / proxy over
device-memory heaps, the soft NIC copying through the CUDA runtime) run on the GPU too; the copy
hook with a stand-in runtime and the close of IPC mappings after a failed set-up (a platform
stand-in) run everywhere.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpunet
import ep_jobs
from mp_jobs import _pattern
from mp_ranks import Ranks
from p2p_cuda_jobs import MEMORY_TYPE_DEVICE, MEMORY_TYPE_HOST, SLOT, memory_type

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="needs an NVIDIA GPU: torch.cuda.is_available() is False")
SIZES = [1, 40, 4096, 100001]


# --- one rank: p2p to itself ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def ctx(cuda_platform_module):                                   # tests/conftest.py
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU: torch.cuda.is_available() is False")
    c = gpunet.init(transport="p2p", nic="soft", heap_bytes=8 << 20, timeout_s=10.0)
    try:
        yield c
    finally:
        c.close()


@needs_gpu
def test_launches_follow_the_callers_current_stream(ctx):
    """The launcher's stream (gpunet/_launch.py current_stream_handle, torch's raw getter) is
    torch's current stream, also inside ``with torch.cuda.stream(s)``; a put issued there runs
    on s (it has landed once s is synchronized)."""
    x = ctx.alloc((1 << 16,), torch.uint8)
    y = ctx.alloc((1 << 16,), torch.uint8)
    try:
        assert ctx._launcher.stream() == torch.cuda.current_stream().cuda_stream
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            assert ctx._launcher.stream() == s.cuda_stream != torch.cuda.default_stream().cuda_stream
            x.fill_(9)
            gpunet.put(ctx.remote(0, y), x)
        s.synchronize()
        assert int((y == 9).sum()) == y.numel()
        assert ctx._launcher.stream() == torch.cuda.current_stream().cuda_stream
        ctx.quiet()
    finally:
        ctx.free(y)
        ctx.free(x)


@needs_gpu
def test_alloc_is_device_memory_outside_the_nic(ctx):
    """With transport='p2p' the heap is a device allocation (cudaPointerGetAttributes: device
    memory), not inside any range the soft NIC maps, and alloc returns zeroed CUDA tensors on it
    that the GPU computes on."""
    assert ctx.transports == {0: "p2p"}
    assert memory_type(ctx.heap_base) == MEMORY_TYPE_DEVICE
    assert not any(b <= ctx.heap_base < b + n for b, n in ctx.nic.mapped_ranges())
    x = ctx.alloc((1000,), torch.float32)
    assert x.device.type == "cuda" and ctx.heap_base <= x.data_ptr() < ctx.heap_base + ctx.heap_bytes
    assert int(torch.count_nonzero(x)) == 0
    x += 2.5
    assert float(x.sum()) == 2500.0
    ctx.free(x)
    y = ctx.alloc((1000,), torch.float32)       # the same range again: zeroed once more
    assert int(torch.count_nonzero(y)) == 0
    ctx.free(y)


@needs_gpu
@pytest.mark.parametrize("nbytes", SIZES)
def test_self_put_get_put_signal_wait_until_barrier_land(ctx, nbytes):
    """put / get to this rank over p2p copy exactly the bytes asked (nothing past them);
    put_signal ADD and SET leave the signal values wait_until and read_signal see, with the
    payload in place; atomic_add returns the old value; barriers pass."""
    src = ctx.alloc((nbytes + 64,), torch.uint8)
    dst = ctx.alloc((nbytes + 64,), torch.uint8)
    back = ctx.alloc((nbytes + 64,), torch.uint8)
    sig = ctx.alloc((2,), torch.int64)
    try:
        pat = _pattern(0, nbytes, nbytes + 64).cuda()
        src.copy_(pat)
        ctx.put(ctx.remote(0, dst), src[:nbytes])
        ctx.quiet()
        assert torch.equal(dst[:nbytes], pat[:nbytes]) and int(torch.count_nonzero(dst[nbytes:])) == 0
        ctx.get(back[:nbytes], ctx.remote(0, dst))
        ctx.quiet()
        assert torch.equal(back[:nbytes], pat[:nbytes]) and int(torch.count_nonzero(back[nbytes:])) == 0
        dst.zero_()
        ctx.put_signal(ctx.remote(0, dst), src[:nbytes], ctx.remote(0, sig), value=3)
        ctx.wait_until(sig, 3, "ge")
        assert torch.equal(dst[:nbytes], pat[:nbytes]) and gpunet.read_signal(sig) == 3
        ctx.put_signal(ctx.remote(0, dst), src[:nbytes], ctx.remote(0, sig, 1), value=77, op="set")
        ctx.wait_until(sig, 77, "eq", index=1)
        assert gpunet.read_signal(sig, 1) == 77
        assert ctx.atomic_add(ctx.remote(0, sig), 5) == 3 and gpunet.read_signal(sig) == 8
        ctx.barrier()
        ctx.barrier()
    finally:
        for t in (src, dst, back, sig):
            ctx.free(t)


# --- two rank processes on one GPU, under a private MPS daemon ----------------------------------
@pytest.fixture(scope="module")
def mps():
    """A private MPS daemon (gpunet.device.testing.mps.private_mps, the one bench/p2p.py uses):
    fresh pipe and log directories, given (by the caller) to every rank process; stopped with
    'quit' at the end. A daemon that cannot start fails the test with nvidia-cuda-mps-control's
    words."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU: torch.cuda.is_available() is False")
    from gpunet.device.testing.mps import private_mps

    daemon = private_mps(export=False)
    try:
        dirs = daemon.__enter__()
    except gpunet.GpunetError as e:
        pytest.fail(str(e))
    try:
        yield dirs
    finally:
        daemon.__exit__(None, None, None)


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def pair(request, mps):
    """2 and 4 rank processes on the one GPU (under the private MPS daemon), all p2p."""
    r = Ranks(request.param, env=dict(mps, GPUNET_PLATFORM="cuda"))
    try:
        r.info = r.run("p2p_cuda_jobs:init", timeout=300)
        yield r
        r.run("p2p_cuda_jobs:close", timeout=120)
    finally:
        r.close()


@needs_gpu
def test_ranks_open_each_others_device_heap(pair):
    """Each rank's heap and allocations are device memory, every peer is p2p, and each rank
    opened every other rank's heap by its IPC handle (a device-memory mapping)."""
    n = len(pair.info)
    for rank, i in enumerate(pair.info):
        others = [p for p in range(n) if p != rank]
        assert i["rank"] == rank and set(i["transports"].values()) == {"p2p"}, i
        assert i["heap_type"] == MEMORY_TYPE_DEVICE and i["alloc_type"] == MEMORY_TYPE_DEVICE, i
        assert i["mapped_peers"] == others, i
        assert i["peer_types"] == {p: MEMORY_TYPE_DEVICE for p in others}, i
    assert len({i["pid"] for i in pair.info}) == n


@needs_gpu
@pytest.mark.parametrize("nbytes", SIZES)
def test_ranks_put_put_signal_wait_until_get_barrier(pair, nbytes):
    """Two rounds per size, around the ring of ranks: each rank's put and put_signal payload
    land whole in the next rank's slot before that rank's wait_until on the ADD signal returns;
    the ADD word counts the rounds, the SET word holds the last value set; get reads the next
    rank's source exactly."""
    n = len(pair.info)
    for k in (1, 2):
        rnd = 1000 * nbytes + k
        pair.adds = getattr(pair, "adds", 0) + 1          # ADD signals per rank so far
        out = pair.run("p2p_cuda_jobs:verbs", nbytes, rnd, pair.adds, timeout=300)
        for rank, o in enumerate(out):
            prv, nxt = (rank - 1) % n, (rank + 1) % n
            want_prv, want_nxt = _pattern(prv, rnd, SLOT), _pattern(nxt, rnd, SLOT)
            assert torch.equal(o["after_signal"], want_prv[:2 * nbytes]), (rank, nbytes, k)
            assert torch.equal(o["got"], want_nxt[:nbytes]), (rank, nbytes, k)
            assert o["set"] == 10 * rnd, (rank, o["set"])
        assert all(o["add"] == pair.adds for o in out), ([o["add"] for o in out], pair.adds)


@needs_gpu
def test_ranks_device_atomics_are_exact(pair):
    """Every rank adds 1 to rank 0's word 40 times by device atomics on the mapped heap: every
    old value is seen once and the final value is 40 per rank."""
    out = pair.run("p2p_cuda_jobs:atomics", 40, timeout=300)
    total = 40 * len(out)
    olds = sorted(o for r in out for o in r["olds"])
    assert olds == list(range(total)) and out[0]["final"] == total, out


@needs_gpu
def test_two_ranks_ep_dispatch_and_combine_over_p2p_match_the_reference(mps):
    """gpunet.ep low_latency_dispatch + combine between two rank processes over p2p (device
    heaps, IPC-mapped): BF16 tagged rows and an FP8 round with hooks; every rank's dispatch is
    gpunet.ep.reference's and combine is within DeepEP's bounds."""
    info = ep_jobs.two_rank_rounds("p2p", dict(mps, GPUNET_PLATFORM="cuda"))
    assert all(set(i["transports"].values()) == {"p2p"} for i in info), info


@needs_gpu
def test_two_ranks_ep_direct_dispatch_on_one_gpu_matches_the_reference(mps):
    """The same rounds with a receive pool: both ranks p2p on this GPU, so the dispatch is direct
    (ll.cuh "The direct dispatch": a count round, then each row stored straight into its packed
    row in the peer's pool tensors): the BF16 and the FP8 round's recv_x lie in the pool, both
    equal the reference and combine is within DeepEP's bounds."""
    info = ep_jobs.two_rank_rounds("p2p", dict(mps, GPUNET_PLATFORM="cuda", GPUNET_EP_LL_DIRECT="1"),
                                   recv_pool_bytes=64 << 20)
    assert all(i["in_pool"] == [True, True] for i in info), [i["in_pool"] for i in info]


@needs_gpu
@pytest.mark.parametrize("transport", ["ibgda", "proxy"])
def test_two_ranks_ep_over_nic_transports_on_device_heaps(mps, transport):
    """The same EP rounds over a NIC transport with both heaps in device memory
    (GPUNET_HEAP_MEMORY=device): the soft NIC's engine moves every row, header and signal between
    the two device heaps with the CUDA runtime (each NIC maps the peer's heap by CUDA IPC), and
    the Buffer reads its control block through a copy; dispatch equals the reference, combine is
    within DeepEP's bounds, and no copy failed."""
    info = ep_jobs.two_rank_rounds(transport, dict(mps, GPUNET_PLATFORM="cuda",
                                                   GPUNET_HEAP_MEMORY="device"))
    ep_jobs.check_device_heap_rounds(info, transport)


@needs_gpu
def test_auto_is_p2p_between_two_ranks_on_one_gpu(mps):
    """transport="auto", two rank processes on this node: every pair and each rank to itself is
    p2p (the reason says same node / itself), each rank opened the other's device heap by CUDA
    IPC and none for the NIC."""
    r = Ranks(2, env=dict(mps, GPUNET_PLATFORM="cuda"))
    try:
        info = r.run("p2p_cuda_jobs:init", 8 << 20, 20.0, "auto", timeout=300)
        for rank, i in enumerate(info):
            assert i["transports"] == {0: "p2p", 1: "p2p"}, i
            assert i["reasons"][1 - rank].startswith("auto: same node (host "), i["reasons"]
            assert i["reasons"][rank].startswith("auto: this rank itself"), i["reasons"]
            assert i["mapped_peers"] == [1 - rank] and i["dma_peers"] == [], i
            assert i["heap_type"] == MEMORY_TYPE_DEVICE, i
        r.run("p2p_cuda_jobs:close", timeout=120)
    finally:
        r.close()


# --- mixed worlds on CUDA: p2p and NIC transports over device-memory heaps -----------------------
# world (p2p_cuda_jobs' per-pair function) -> the transport between the two ranks: the proxy or
# ibgda, each rank reaching itself by p2p, or only rank 0 (rank 1 then uses no p2p at all). Every
# heap is device memory (CUDA), so each rank's soft NIC maps the other's for its copy engine.
MIXED = {"self_p2p_proxy": "proxy", "self_p2p_ibgda": "ibgda", "rank0_p2p_else_ibgda": "ibgda"}


@pytest.fixture(scope="module", params=sorted(MIXED))
def mixed_pair(request, mps):
    r = Ranks(2, env=dict(mps, GPUNET_PLATFORM="cuda"))
    try:
        r.world = request.param
        r.info = r.run("p2p_cuda_jobs:init", 8 << 20, 20.0, request.param, timeout=300)
        yield r
        r.run("p2p_cuda_jobs:close", timeout=120)
    finally:
        r.close()


@needs_gpu
@pytest.mark.parametrize("nbytes", [40, 100001])
def test_mixed_world_puts_signals_gets_and_atomics_over_device_heaps(mixed_pair, nbytes):
    """A CUDA world mixing p2p (a rank to itself) with the proxy or ibgda (between the ranks)
    over a device-memory heap for every rank with a p2p peer and the host-mapped heap for a rank
    without one (rank 1 in rank0_p2p_else_ibgda: a world of both kinds), the soft NIC's engine
    copying through the CUDA runtime: a rank's soft NIC maps the other's heap when it is device
    memory; put and put_signal payloads land whole before wait_until on the ADD word returns, the
    SET word holds the value set, get reads the peer's source exactly; each rank adds 1 to the
    other's counter 30 times through the NIC (a bounce on device memory) and sees every old
    value once."""
    has_p2p = [any(t == "p2p" for t in i["transports"].values()) for i in mixed_pair.info]
    for rank, i in enumerate(mixed_pair.info):
        other = 1 - rank
        assert i["transports"][other] == MIXED[mixed_pair.world], i
        assert i["heap_type"] == (MEMORY_TYPE_DEVICE if has_p2p[rank] else MEMORY_TYPE_HOST), i
        assert i["dma_peers"] == ([other] if has_p2p[other] else []), i
    for k in (1, 2):
        rnd = 7000 * nbytes + k
        mixed_pair.adds = getattr(mixed_pair, "adds", 0) + 1
        out = mixed_pair.run("p2p_cuda_jobs:verbs", nbytes, rnd, mixed_pair.adds, timeout=300)
        for rank, o in enumerate(out):
            want = _pattern(1 - rank, rnd, SLOT)
            assert torch.equal(o["after_signal"], want[:2 * nbytes]), (rank, nbytes, k)
            assert torch.equal(o["got"], want[:nbytes]), (rank, nbytes, k)
            assert o["set"] == 10 * rnd and o["add"] == mixed_pair.adds, (rank, o["set"], o["add"])
    out = mixed_pair.run("p2p_cuda_jobs:cross_atomics", 30, timeout=300)
    for rank, o in enumerate(out):
        assert sorted(o["olds"]) == list(range(30)) and o["final"] == 30, (rank, o)


# --- everywhere: the soft NIC's copy hook, with a stand-in for the CUDA runtime -----------------
def test_the_soft_nic_engine_moves_device_bytes_through_the_copy_hook():
    """A copy engine stand-in (C-callable functions that record each call and memmove) attached
    to NIC a; NIC b owns "device memory" (registered device_memory=True at address D1) that
    looks like another process's and that this process maps at D2 (one memfd mapped twice,
    Nic.add_peer_memory). a's WRITE, inline WRITE, READ (into a's own device memory) and
    fetch-add / compare-swap on b's device memory all land correctly, every byte moving through
    the hook (with its kind, stream and device), at D2 and never at D1. Without the mapping the
    access fails with a remote access error; without a copy engine, with a local protection
    error."""
    import ctypes
    import mmap

    import numpy as np

    from gpunet import mlx5
    from gpunet.host import softnic
    from gpunet.host.softnic import SoftNic
    from gpunet.host.wq import CompletionQueue, SendQueue

    calls = []
    COPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                            ctypes.c_int, ctypes.c_void_p)
    SYNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
    SETDEV = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)

    def copy(dst, src, n, kind, stream):
        calls.append(("copy", dst, src, n, kind, stream))
        ctypes.memmove(dst, src, n)
        return 0

    fns = [COPY(copy), SYNC(lambda st: calls.append(("sync", st)) or 0),
           SETDEV(lambda d: calls.append(("setdev", d)) or 0)]
    fake = types_ns(copy_fn=ctypes.cast(fns[0], ctypes.c_void_p).value,
                    sync_fn=ctypes.cast(fns[1], ctypes.c_void_p).value, kind=4, stream=0x5150,
                    set_device_fn=ctypes.cast(fns[2], ctypes.c_void_p).value, device=3)
    N = 1 << 16
    fd = os.memfd_create("gpunet-fake-device")
    os.ftruncate(fd, N)
    m1, m2 = mmap.mmap(fd, N), mmap.mmap(fd, N)
    v1, v2 = np.frombuffer(m1, np.uint8), np.frombuffer(m2, np.uint8)
    D1, D2 = v1.ctypes.data, v2.ctypes.data
    with SoftNic(retry_timeout_s=0.5) as a, SoftNic(retry_timeout_s=0.5) as b:
        a.attach_copy_engine(fake)
        T = b._arena.T
        pid = int(T[softnic.H_PID])
        try:
            T[softnic.H_PID] = os.getppid()            # b now looks like another process's NIC
            dmr = b.reg_mr(D1, N, kind="device", device_memory=True)
            host = a.alloc(1 << 14)
            hmr = a.reg_mr(host)
            ldev = np.zeros(4096, np.uint8)            # a's own "device memory" (this process)
            lmr = a.reg_mr(ldev.ctypes.data, ldev.size, kind="device", device_memory=True)

            def qp():
                cq = a.create_cq(64)
                q, rq = a.create_qp(cq, sq_wqebbs=64), b.create_qp(b.create_cq(64))
                a.connect(q, rq.info())
                b.connect(rq, q.info())
                return SendQueue(q, CompletionQueue(cq)), rq

            sq, rq = qp()
            sq.post_write(hmr.addr, hmr.lkey, D1, dmr.rkey, 64, signaled=True)
            c = sq.cq.wait(1)[0]
            assert c.error and c.syndrome == mlx5.SYNDROME_REMOTE_ACCESS_ERR, c   # not mapped here
            assert calls == []

            sq, rq = qp()
            sq2, _ = qp()
            a.add_peer_memory(rq.info(), D1, N, D2)
            host[:1000] = np.arange(1000) % 251
            v2[8:16] = np.frombuffer((1000).to_bytes(8, sys.byteorder), np.uint8)
            sq.post_write(hmr.addr, hmr.lkey, D1 + 4096, dmr.rkey, 1000)
            sq.post_write_inline(bytes(range(7, 47)), D1 + 8192, dmr.rkey)
            sq.post_read(lmr.addr + 64, lmr.lkey, D1 + 4096, dmr.rkey, 1000)
            sq.post_atomic_fa(lmr.addr, lmr.lkey, D1 + 8, dmr.rkey, 5)
            sq.post_atomic_cs(lmr.addr + 8, lmr.lkey, D1 + 8, dmr.rkey, 1005, 77, signaled=True)
            sq.quiet(10.0)
            assert not any(x.error for x in sq.cq.poll(64))
            assert np.array_equal(v1[4096:5096], host[:1000])
            assert bytes(v1[8192:8232]) == bytes(range(7, 47))
            assert np.array_equal(ldev[64:1064], host[:1000])
            assert int.from_bytes(bytes(ldev[0:8]), sys.byteorder) == 1000
            assert int.from_bytes(bytes(ldev[8:16]), sys.byteorder) == 1005
            assert int.from_bytes(bytes(v1[8:16]), sys.byteorder) == 77
            copies = [x for x in calls if x[0] == "copy"]
            assert copies and all(x[4] == 4 and x[5] == 0x5150 for x in copies)
            assert ("setdev", 3) in calls and ("sync", 0x5150) in calls
            touched = [x[1] for x in copies] + [x[2] for x in copies]
            assert not any(D1 <= t < D1 + N for t in touched), "the peer's own address was used"
            dev_side = [t for t in touched if D2 <= t < D2 + N]
            assert {D2 + 4096, D2 + 8192, D2 + 8} <= set(dev_side), copies
            assert any(ldev.ctypes.data <= t < ldev.ctypes.data + ldev.size for t in touched)
            assert a.stats()["dma_copies"] == len(copies) and a.stats()["dma_error"] == 0

            n0 = len(calls)
            sq2.post_write(hmr.addr, hmr.lkey, D1, dmr.rkey, 64, signaled=True)   # any QP to b
            with SoftNic(retry_timeout_s=0.5) as c_nic:           # a third NIC: no copy engine
                cq = c_nic.create_cq(64)
                q, rq3 = c_nic.create_qp(cq, sq_wqebbs=64), b.create_qp(b.create_cq(64))
                c_nic.connect(q, rq3.info())
                b.connect(rq3, q.info())
                c_nic.add_peer_memory(rq3.info(), D1, N, D2)
                cbuf = c_nic.alloc(4096)
                cmr = c_nic.reg_mr(cbuf)
                s3 = SendQueue(q, CompletionQueue(cq))
                s3.post_write(cmr.addr, cmr.lkey, D1, dmr.rkey, 64, signaled=True)
                c = s3.cq.wait(1)[0]
                assert c.error and c.syndrome == mlx5.SYNDROME_REMOTE_ACCESS_ERR, c
                assert c_nic.stats()["dma_error"] == -1         # no copy engine attached
            assert not sq2.cq.wait(1)[0].error
            assert len(calls) > n0
        finally:
            T[softnic.H_PID] = pid
    del v1, v2
    m1.close(), m2.close(), os.close(fd)


def test_nic_atomics_on_device_memory_from_two_engines_are_exact():
    """Two requester NICs (two engine threads), each with a copy engine stand-in, do 300
    fetch-add(+1) each on ONE word of a third NIC's device memory (a bounce: copy in, add, copy
    out, under the owning NIC's lock). Invariant: the word ends at 600 and the old values are
    0 .. 599, each once (no lost update between the engines' read-modify-writes)."""
    import ctypes

    import numpy as np

    from gpunet.host.softnic import SoftNic
    from gpunet.host.wq import CompletionQueue, SendQueue

    COPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                            ctypes.c_int, ctypes.c_void_p)
    SYNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
    fns = [COPY(lambda d, s, n, k, st: ctypes.memmove(d, s, n) and 0), SYNC(lambda st: 0)]
    fake = types_ns(copy_fn=ctypes.cast(fns[0], ctypes.c_void_p).value,
                    sync_fn=ctypes.cast(fns[1], ctypes.c_void_p).value, kind=4, stream=0)
    word = np.zeros(8, np.uint64)                      # the "device memory" (this process)
    K, ROUNDS = 50, 6
    with SoftNic(retry_timeout_s=2.0) as owner, SoftNic(retry_timeout_s=2.0) as a, \
            SoftNic(retry_timeout_s=2.0) as c:
        dmr = owner.reg_mr(word.ctypes.data, word.nbytes, kind="device", device_memory=True)
        qs = []
        for nic in (a, c):
            nic.attach_copy_engine(fake)
            cq = nic.create_cq(64)
            q, rq = nic.create_qp(cq, sq_wqebbs=64), owner.create_qp(owner.create_cq(64))
            nic.connect(q, rq.info())
            owner.connect(rq, q.info())
            res = nic.alloc(8 * K * ROUNDS)
            qs.append((SendQueue(q, CompletionQueue(cq)), nic.reg_mr(res), res))
        for r in range(ROUNDS):
            for sq, mr, _ in qs:
                for i in range(K):
                    sq.post_atomic_fa(mr.addr + 8 * (r * K + i), mr.lkey, dmr.addr + 16, dmr.rkey,
                                      1, doorbell=False)
            for sq, _, _ in qs:
                sq.ring()
            for sq, _, _ in qs:
                sq.quiet(30.0)
                assert not any(x.error for x in sq.cq.poll(256))
        olds = sorted(int.from_bytes(bytes(res[8 * i:8 * i + 8]), sys.byteorder)
                      for _, _, res in qs for i in range(K * ROUNDS))
        assert int(word[2]) == 2 * K * ROUNDS
        assert olds == list(range(2 * K * ROUNDS)), olds[:20]


def types_ns(**kw):
    import types
    return types.SimpleNamespace(**kw)


def test_ipc_mappings_opened_before_a_failed_open_are_closed_with_the_transports():
    """Transports on a cuda-named platform stand-in (no GPU needed): rank 0 of 3 opens peer 1's
    heap by its IPC handle, peer 2's open fails; the set-up raises ConfigError naming peer 2 and
    the runtime's error, and closing the transports (what the Context does after a failed init)
    closes peer 1's mapping with cudaIpcCloseMemHandle, once."""
    import types

    from gpunet.device.descriptors import DeviceContext
    from gpunet.errors import ConfigError
    from gpunet.host.platform import _CUDA_API, IpcMapping, VendorRuntimeError
    from gpunet.host.softnic import SoftNic
    from gpunet.transports import Transports

    closed = []
    rt = types.SimpleNamespace(api=_CUDA_API, call=lambda name, *a: closed.append((name, a[0].value)))
    plat = types.SimpleNamespace(name="cuda", profile="nvidia")
    plat.runtime = lambda: rt

    def ipc_open(handle, nbytes, pid=None):
        if handle == b"\2" * 64:
            raise VendorRuntimeError("cudaIpcOpenMemHandle failed with error 201", call="x", code=201)
        return IpcMapping(plat, 0x7f0000100000, nbytes)

    plat.ipc_open = ipc_open
    plat.ipc_export = lambda ptr: b"\0" * 64
    nic = SoftNic(arena_bytes=8 << 20)
    try:
        t = Transports(nic, plat, 0, 3, "p2p", None, heap=(0x7f0000000000, 1 << 20))
        assert t.kinds == {0: "p2p", 1: "p2p", 2: "p2p"}
        everyone = [dict(qps={}, p2p=bytes([r]) * 64, heap_bytes=1 << 20) for r in range(3)]
        dev = DeviceContext(0x7f0000000000, 1 << 20, 0, 3, 0, 0x7f0000001000, 16, 0x7f0000002000, 1.0)
        with pytest.raises(ConfigError, match="peer 2.*error 201"):
            t.connect(everyone, dev, (0x7f0000000000, 0))
        assert list(t.peer_heaps) == [1] and closed == []
        t.close()
        assert closed == [("cudaIpcCloseMemHandle", 0x7f0000100000)]
        t.close()
        assert len(closed) == 1
    finally:
        nic.close()


@needs_gpu
def test_a_dead_peers_ipc_mapping_is_closed_and_a_new_world_maps_the_new_peer(mps):
    """Two rank processes on one GPU over p2p (CUDA IPC), a 2 s device timeout; rank 1 exits
    without closing anything. Rank 0 (storing nothing into the dead peer's heap) gets a gpunet
    error from its barrier within the bound; its close() returns without an error (the IPC
    mapping of the dead exporter's heap is closed: cudaPointerGetAttributes no longer reports
    device memory there). Then rank 0 (the same process) and a NEW rank 1 process form a new
    world over p2p: rank 0 opens the new peer's handle and puts both ways (1000 bytes and 256 KiB,
    the bulk kernel) land byte for byte."""
    from test_p2p import replace_rank

    env = dict(mps, GPUNET_PLATFORM="cuda")
    r = Ranks(2, env=env)
    try:
        info = r.run("p2p_cuda_jobs:init", 8 << 20, 2.0, timeout=300)
        for q in r.inboxes:
            q.put(("die_if", (1,)))
        assert r.outboxes[0].get(timeout=60) == ("ok", "alive")
        r.procs[1].join(timeout=60)
        r.inboxes[0].put(("p2p_jobs:survive_dead_peer", (1,)))
        status, res = r.outboxes[0].get(timeout=120)
        assert status == "ok", res
        assert res["barrier"]["raised"] in ("TimeoutError", "CompletionError"), res
        assert res["barrier"]["seconds"] < 30, res
        assert res["close"]["raised"] is None, res["close"]
        old_base = res["before"][1][0]
        r.inboxes[0].put(("p2p_cuda_jobs:pointer_type", (old_base,)))
        status, (rc, kind) = r.outboxes[0].get(timeout=60)
        assert status == "ok" and (rc != 0 or kind != MEMORY_TYPE_DEVICE), (rc, kind)
        replace_rank(r, 1, env)
        info2 = r.run("p2p_cuda_jobs:init", 8 << 20, 20.0, timeout=300)
        assert info2[0]["pid"] == info[0]["pid"] and info2[1]["pid"] != info[1]["pid"]
        assert info2[0]["mapped_peers"] == [1] and info2[1]["mapped_peers"] == [0], info2
        out = r.run("p2p_jobs:put_both_ways", 11, timeout=300)
        for rank, o in enumerate(out):
            assert o["wrong"] == {1000: 0, SLOT: 0}, (rank, o["wrong"])
        r.run("p2p_cuda_jobs:close", timeout=120)
    finally:
        r.close()


def _dead_pid():
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_an_ipc_mapping_knows_when_its_exporter_is_gone_and_close_stores_nothing_into_it():
    """IpcMapping.owner_alive (gpunet/host/platform.py): True for a live exporter pid or an unknown one,
    False for an exited process or once closed. Transports.close_barrier (platform stand-in, no
    GPU needed) then writes its close word into the live peer's mapped heap only, never into the
    heap of the exporter that exited (its memory may be freed), and still closes that mapping."""
    import types

    from gpunet.device.descriptors import DeviceContext
    from gpunet.host.platform import _CUDA_API, IpcMapping
    from gpunet.host.softnic import SoftNic
    from gpunet.transports import CLOSE_SLOTS_OFF, Transports

    closed, stores = [], []
    rt = types.SimpleNamespace(api=_CUDA_API, call=lambda name, *a: closed.append((name, a[0].value)))
    plat = types.SimpleNamespace(name="cuda", profile="nvidia")
    plat.runtime = lambda: rt
    dead = _dead_pid()
    m = IpcMapping(plat, 0x7f0000100000, 1 << 20, pid=dead)
    assert not m.owner_alive()
    assert IpcMapping(plat, 0x7f0000200000, 1 << 20, pid=os.getpid()).owner_alive()
    assert IpcMapping(plat, 0x7f0000300000, 1 << 20).owner_alive()
    bases = {1: 0x7f0000100000, 2: 0x7f0000200000}
    pids = {1: dead, 2: os.getpid()}
    plat.ipc_open = lambda handle, nbytes, pid=None: IpcMapping(plat, bases[handle[0]], nbytes, pid)
    plat.ipc_export = lambda ptr: b"\0" * 64
    plat.memcpy = lambda dst, src, n: stores.append(dst) if n == 8 else None
    nic = SoftNic(arena_bytes=8 << 20)
    try:
        t = Transports(nic, plat, 0, 3, "p2p", None, heap=(0x7f0000000000, 1 << 20))
        everyone = [dict(qps={}, p2p=bytes([r]) * 64, heap_bytes=1 << 20, pid=pids.get(r))
                    for r in range(3)]
        dev = DeviceContext(0x7f0000000000, 1 << 20, 0, 3, 0, 0x7f0000001000, 16, 0x7f0000002000, 1.0)
        t.connect(everyone, dev, (0x7f0000000000, 0))
        assert sorted(t.peer_heaps) == [1, 2]
        silent = t.close_barrier(0.2)
        assert stores == [bases[2] + CLOSE_SLOTS_OFF], [hex(x) for x in stores]
        # rank 2 is alive and never writes its close word (the stand-in's reads return zeros): it
        # is the one silent peer; rank 1's exporter is gone, so it is not waited for
        assert silent == [2], silent
        t.close()
        assert sorted(a for _, a in closed) == [bases[1], bases[2]]
    finally:
        nic.close()


def test_a_nic_that_maps_no_peer_memory_leaves_nic_peers_heaps_alone():
    """Transports on a cuda-named platform stand-in, a device heap, a NIC without
    add_peer_memory (as a real NIC: the peer's NIC reaches its own device heap by DMA) and an
    ibgda peer whose device heap is exported: nothing is opened for the NIC (no ipc_open, no
    dma_heaps), and the close barrier waits for no one, since the peer (whose NIC maps nothing
    either: its info says maps_nic_heaps False) never maps this heap."""
    import time
    import types

    from gpunet.device.descriptors import DeviceContext
    from gpunet.host.softnic import SoftNic
    from gpunet.transports import Transports

    def _no_attribute(self):
        raise AttributeError("add_peer_memory")

    class NoPeerMemoryNic(SoftNic):
        add_peer_memory = property(_no_attribute)

    opened = []
    plat = types.SimpleNamespace(name="cuda", profile="nvidia")
    plat.ipc_open = lambda handle, nbytes, pid=None: opened.append(handle)
    plat.ipc_export = lambda ptr: b"\0" * 64
    plat.memcpy = lambda dst, src, n: None          # reads zeros: no close word ever arrives
    nic = NoPeerMemoryNic(arena_bytes=8 << 20)
    try:
        heap = (0x7f0000000000, 1 << 20)
        t = Transports(nic, plat, 0, 2, "ibgda", lambda: "mapped", heap=heap, device_heap=True)
        mine = dict(t.info(), heap=heap[0], rkey=0, heap_bytes=heap[1])
        peer = dict(qps={}, transports={0: "ibgda", 1: "ibgda"}, p2p=b"\1" * 64,
                    device_heap=True, maps_nic_heaps=False, heap=0x7f0000100000, rkey=0,
                    heap_bytes=heap[1])
        dev = DeviceContext(heap[0], heap[1], 0, 2, 0, heap[0] + 4096, 16, heap[0] + 8192, 1.0)
        t.connect([mine, peer], dev, (heap[0], 0))
        assert opened == [] and t.dma_heaps == {} and t.kinds == {0: "ibgda", 1: "ibgda"}
        t0 = time.monotonic()
        assert t.close_barrier(2.0) == [] and time.monotonic() - t0 < 1.0
        assert mine["p2p"] == b"\0" * 64 and mine["maps_nic_heaps"] is False   # what peers see
        t.close()
    finally:
        nic.close()


def test_a_stalled_copy_engine_is_counted_and_named_in_a_timeout():
    """A copy engine stand-in whose copy blocks for 60 ms (as the CUDA runtime's did behind a
    .cpu() queued behind the waiting kernel, bench/copy_engine_stall.py): the soft NIC counts the
    stall and its longest copy, and says so in timeout_hint; a fast copy counts nothing. A
    Context's timed-out wait_until carries its NIC's hint in the TimeoutError's message."""
    import ctypes
    import time

    import numpy as np

    from gpunet.host.softnic import SoftNic
    from gpunet.host.wq import CompletionQueue, SendQueue

    delay = {"s": 0.0}
    COPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                            ctypes.c_int, ctypes.c_void_p)
    SYNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)

    def copy(dst, src, n, kind, stream):
        time.sleep(delay["s"])
        ctypes.memmove(dst, src, n)
        return 0

    fns = [COPY(copy), SYNC(lambda st: 0)]
    fake = types_ns(copy_fn=ctypes.cast(fns[0], ctypes.c_void_p).value,
                    sync_fn=ctypes.cast(fns[1], ctypes.c_void_p).value, kind=4, stream=0,
                    set_device_fn=0, device=0)
    with SoftNic(retry_timeout_s=0.5) as a:
        a.attach_copy_engine(fake)
        dev = np.zeros(4096, np.uint8)             # "device memory" of this process
        dmr = a.reg_mr(dev.ctypes.data, dev.size, kind="device", device_memory=True)
        host = a.alloc(4096)
        hmr = a.reg_mr(host)
        cq = a.create_cq(64)
        q, partner = a.create_qp(cq, sq_wqebbs=64), a.create_qp(a.create_cq(64))
        a.connect(q, partner.info())
        a.connect(partner, q.info())
        sq = SendQueue(q, CompletionQueue(cq))
        host[:64] = 7
        sq.post_write(hmr.addr, hmr.lkey, dmr.addr, dmr.rkey, 64, signaled=True)
        assert not sq.cq.wait(1)[0].error
        assert a.stats()["dma_stalls"] == 0 and a.timeout_hint() == ""
        delay["s"] = 0.06
        sq.post_write(hmr.addr, hmr.lkey, dmr.addr + 64, dmr.rkey, 64, signaled=True)
        assert not sq.cq.wait(1)[0].error and bytes(dev[64:128]) == bytes([7]) * 64
        st = a.stats()
        assert st["dma_stalls"] == 1 and 0.05 < st["dma_stall_max_s"] < 5.0, st
        assert "copy engine stalled 1 time(s), up to 0.0" in a.timeout_hint(), a.timeout_hint()
    with gpunet.init(nic="soft", heap_bytes=1 << 20, timeout_s=0.3) as ctx:
        sig = ctx.alloc((1,), torch.int64)
        ctx.nic.timeout_hint = lambda: "the NIC's hint"
        with pytest.raises(gpunet.TimeoutError, match="the NIC's hint"):
            ctx.wait_until(sig, 1, "ge")


@needs_gpu
def test_the_p2p_bench_ping_pong_runs_every_mode_on_the_gpu(tmp_path):
    """bench/p2p.py's ping-pong kernel (gpunet/device/testing/kernels/p2p_bench.cu: put_signal and
    wait_until on a copy of the DevCtx, by number and through a PeerRef, and the raw floor) runs on
    the GPU, 2 ranks under the bench's private MPS daemon, every mode, and a put lands byte for
    byte. In the sixteenth session a device change (a pure-asm load of the QP's constants) made
    this kernel fault with an illegal address while every other CUDA test passed: only the gate's
    p2p step caught it. Timing is not checked here (the gate's p2p step reports it)."""
    out = tmp_path / "p2p.json"
    bench = Path(__file__).resolve().parent.parent / "bench" / "p2p.py"
    proc = subprocess.run([sys.executable, str(bench), "--gpu", "--runs", "1", "--max-mib", "1",
                           "--skip", "sweep,profile,nic", "--pp-iters", "200", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    tests = [g for g in res["gate"] if g["kind"] == "test"]
    assert tests and all(g["result"] == "PASS" for g in tests), tests
    modes = {m["mode"] for m in res["pingpong"]["modes"]}
    import importlib.util
    spec = importlib.util.spec_from_file_location("p2p_bench_script", bench)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert modes == set(script.PP_MODES) and len(modes) == 13, "ping-pong modes that ran: %s" % sorted(modes)
