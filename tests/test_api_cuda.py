"""The Python API on an NVIDIA GPU (platform "cuda"): the same wrappers, kernels on the GPU.

Runs only where torch.cuda.is_available(); elsewhere every test is skipped with the reason.
The NIC transports are asked for by name (TRANSPORTS: ibgda and proxy), since "auto" on CUDA is
p2p between ranks of one node; asked for NIC transports only, the heap is host-mapped memory in
the soft NIC's arena, viewed as CUDA tensors (with p2p or auto it is device memory). put / get / put_signal are enqueued on
torch's current stream, the other wrappers synchronize it.
"""
import os
import socket

import pytest
import torch

import gpunet
from gpunet.errors import ConfigError, TimeoutError
from p2p_cuda_jobs import MEMORY_TYPE_DEVICE, memory_type

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs an NVIDIA GPU: torch.cuda.is_available() is False"),
              pytest.mark.usefixtures("cuda_platform_module")]      # tests/conftest.py

TRANSPORTS = ["ibgda", "proxy"]     # by name: "auto" here is p2p (test_auto_is_p2p_on_cuda)


@pytest.fixture(scope="module", params=TRANSPORTS)
def ctx(request):
    c = gpunet.init(transport=request.param, nic="soft", heap_bytes=8 << 20, timeout_s=4.0)
    try:
        assert set(c.transports.values()) == {request.param}
        yield c
    finally:
        c.close()


def test_auto_is_p2p_on_cuda():
    """"auto" on CUDA: this rank reaches itself by p2p (its own device heap), and says why."""
    with gpunet.init(nic="soft", heap_bytes=1 << 20) as c:
        assert c.platform.name == "cuda"
        assert c.transports == {0: "p2p"}, c.reasons
        assert c.reasons[0].startswith("auto: this rank itself (host "), c.reasons[0]
        assert memory_type(c.heap_base) == MEMORY_TYPE_DEVICE


def test_alloc_is_a_cuda_tensor_on_the_heap(ctx):
    x = ctx.alloc((1000,), torch.float32)
    assert x.device.type == "cuda" and x.is_contiguous()
    assert ctx.heap_base <= x.data_ptr() < ctx.heap_base + ctx.heap_bytes
    # asked for NIC transports only: the host-mapped heap in the soft NIC's arena (the device
    # heap goes with p2p / auto: gpunet/context.py says why)
    assert any(b <= ctx.heap_base < b + n for b, n in ctx.nic.mapped_ranges())
    assert int(torch.count_nonzero(x)) == 0
    x += 2.5                                      # a GPU kernel on the host-mapped heap
    assert float(x.sum()) == 2500.0
    with pytest.raises(ConfigError, match="cuda"):
        ctx.put(ctx.remote(0, x), torch.zeros(4))     # a CPU tensor is not a heap tensor here
    ctx.free(x)


@pytest.mark.parametrize("nbytes", [1, 64, 4096, 100000])
def test_put_get_quiet(ctx, nbytes):
    src = ctx.alloc((nbytes,), torch.uint8)
    dst = ctx.alloc((nbytes,), torch.uint8)
    back = ctx.alloc((nbytes,), torch.uint8)
    pat = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    src.copy_(pat)                                # queued on the stream before the put: ordered
    gpunet.put(ctx.remote(0, dst), src, ctx=ctx)
    gpunet.quiet(ctx=ctx)
    assert torch.equal(dst, pat)
    gpunet.get(back, ctx.remote(0, dst), ctx=ctx)
    gpunet.quiet(ctx=ctx)
    assert torch.equal(back, pat)
    for t in (back, dst, src):
        ctx.free(t)


def test_many_nonblocking_puts_then_quiet(ctx):
    """More launches than fit one op ring: the wrapper synchronizes when the ring is full."""
    n = 1200
    src = ctx.alloc((n,), torch.int64)
    dst = ctx.alloc((n,), torch.int64)
    src.copy_(torch.arange(n, device="cuda"))
    for i in range(n):
        ctx.put(ctx.remote(0, dst, i), src[i:i + 1])
    ctx.quiet()
    assert torch.equal(dst, src)
    ctx.free(dst)
    ctx.free(src)


def test_put_signal_wait_until_atomic_add(ctx):
    x = ctx.alloc((256,), torch.float32)
    y = ctx.alloc((256,), torch.float32)
    sig = ctx.alloc((2,), torch.int64)
    x.fill_(3.0)
    gpunet.put_signal(ctx.remote(0, y), x, ctx.remote(0, sig, 1), 5, ctx=ctx)
    gpunet.wait_until(sig, 5, "ge", index=1, ctx=ctx)
    assert gpunet.read_signal(sig, 1) == 5
    assert float(y.sum()) == 768.0
    assert gpunet.atomic_add(ctx.remote(0, sig), 7, ctx=ctx) == 0
    assert gpunet.atomic_add(ctx.remote(0, sig), 1, ctx=ctx) == 7
    assert gpunet.read_signal(sig, 0) == 8
    for t in (sig, y, x):
        ctx.free(t)


def test_barrier(ctx):
    for _ in range(3):
        gpunet.barrier(ctx=ctx)


def test_wait_until_timeout_raises_then_recovers(ctx):
    sig = ctx.alloc((1,), torch.int64)
    with pytest.raises(TimeoutError):
        ctx.wait_until(sig, 1)
    ctx.quiet()                                   # the Status was cleared: nothing stale raises
    ctx.free(sig)


# --- 2 and 4 ranks (spawned processes, gloo bootstrap, one GPU) --------------------------------
def _rank_main(rank, world, port, transport, q):
    import torch.distributed as dist
    os.environ["GPUNET_PLATFORM"] = "cuda"
    try:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                                world_size=world)
        with gpunet.init(transport=transport, nic="soft", heap_bytes=4 << 20, timeout_s=8.0) as c:
            peer, prev = (rank + 1) % world, (rank - 1) % world
            x = c.alloc((4096,), torch.int32)
            y = c.alloc((4096,), torch.int32)
            sig = c.alloc((1,), torch.int64)
            ctr = c.alloc((1,), torch.int64)
            x.copy_(torch.arange(4096, device="cuda", dtype=torch.int32) + 1000 * rank)
            c.barrier()
            c.put_signal(c.remote(peer, y), x, c.remote(peer, sig), 1)
            c.wait_until(sig, 1)
            got_ok = bool(torch.equal(y, torch.arange(4096, device="cuda", dtype=torch.int32)
                                      + 1000 * prev))
            old = c.atomic_add(c.remote(0, ctr), 1)
            c.barrier()
            total = gpunet.read_signal(ctr) if rank == 0 else None
            c.barrier()
            q.put((rank, got_ok, old, total, dict(c.transports)))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - report to the test
        q.put((rank, "error", repr(e), None, None))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ranks_share_the_gpu(transport, world):
    """2 and 4 rank processes on the one GPU (no MPS daemon: the driver time-slices them, slow but
    correct): each rank's put_signal lands in the next rank's tensor before its signal, and every
    rank's atomic_add on rank 0's counter sees a distinct old value."""
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mpc = mp.get_context("spawn")
    q = mpc.Queue()
    procs = [mpc.Process(target=_rank_main, args=(r, world, port, transport, q))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        res = sorted(q.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for r in res:
        assert r[1] is True, r
    assert sorted(r[2] for r in res) == list(range(world))
    assert res[0][3] == world
    assert all(set(r[4].values()) == {transport} for r in res)


def test_quiet_waits_for_a_put_on_another_stream(ctx):
    """A put queued on a side stream behind a 50 ms sleep kernel, then a quiet and a second put
    from the default stream: the quiet returns with the first put done (it waits for every stream
    launched on, not the current one alone) and the second put's OpDesc does not overwrite the
    first's ring slot before the first kernel read it. Invariant: both destinations hold their
    sources after the quiet."""
    a, b = ctx.alloc((4096,), torch.uint8), ctx.alloc((4096,), torch.uint8)
    da, db = ctx.alloc((4096,), torch.uint8), ctx.alloc((4096,), torch.uint8)
    a.fill_(7)
    b.fill_(9)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)           # ~50 ms of GPU clock cycles before the put
        ctx.put(ctx.remote(0, da), a)
    ctx.quiet()
    assert int((da == 7).sum()) == 4096, "quiet returned before the side stream's put"
    ctx.put(ctx.remote(0, db), b)
    ctx.quiet()
    assert int((db == 9).sum()) == 4096 and int((da == 7).sum()) == 4096
    for t in (db, da, b, a):
        ctx.free(t)
