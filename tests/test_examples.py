"""The worked example (examples/exchange.cu + exchange.py): a user's own kernel, built with
gpunet.build_extension, launched from its own host wrapper on ctx.device_context(), exchanging
data between ranks with put_nbi_warp / put_signal_nbi / wait_until, its failures raised by
ctx.check().

HOST arm (every machine, CI): 2 ranks with warps of 32 and 64 lanes over both transports, and the
failure path on one rank. CUDA (where torch.cuda.is_available(); scripts/gpu-check.sh runs this
file on the H200): the same on the GPU, 2 ranks sharing it.
"""
import os
import sys

import pytest
import torch

import gpunet
from mp_ranks import Ranks

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)
import exchange  # noqa: E402 - examples/exchange.py

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs an NVIDIA GPU: torch.cuda.is_available() is False")
N, ROUNDS = 3000, 3


def job_exchange(state, transport, warp_size):
    """One rank of the example: a Context, ROUNDS rounds of the kernel, the Context closed."""
    with gpunet.init(transport=transport, warp_size=warp_size, heap_bytes=4 << 20,
                     timeout_s=30.0) as ctx:
        h = ctx.device_context()
        checked = exchange.exchange(ctx, N, ROUNDS)
        return {"checked": checked, "arch": h.arch, "warp_size": h.warp_size,
                "transports": sorted(set(ctx.transports.values()))}


def _failure_then_recovery(ctx):
    """A kernel that waits for a signal nobody sends: ctx.check() raises the TimeoutError the
    kernel recorded (naming the wait); the next launch then works (the failure was taken)."""
    lib = exchange.load()
    h = ctx.device_context()
    src = ctx.alloc((256,), torch.float32)
    dst = ctx.alloc((256,), torch.float32)
    sig = ctx.alloc((1,), torch.int64)
    # one rank sends to itself once per launch, so the word reaches 1, never 5
    assert lib.example_exchange(h.ptr, dst.data_ptr(), src.data_ptr(), 256, sig.data_ptr(), 5,
                                ctx.rank, h.warp_size, h.stream or None) == 0
    with pytest.raises(gpunet.TimeoutError, match="example_exchange.*wait_until"):
        ctx.check("example_exchange")
    src.fill_(7.0)
    assert lib.example_exchange(h.ptr, dst.data_ptr(), src.data_ptr(), 256, sig.data_ptr(), 2,
                                ctx.rank, h.warp_size, h.stream or None) == 0
    ctx.check("example_exchange")
    assert gpunet.read_signal(sig) == 2 and bool((dst == 7.0).all())


@pytest.fixture(scope="module")
def two_host_ranks():
    r = Ranks(2, env={"GPUNET_PLATFORM": "cpu"})     # the HOST arm, also on a GPU machine
    yield r
    r.close()


@pytest.fixture
def cpu_platform(monkeypatch):
    """This process on the CPU platform (the HOST arm), also on a GPU machine."""
    from gpunet.host import platform as P

    monkeypatch.setenv("GPUNET_PLATFORM", "cpu")
    P.reset_platform()
    yield
    monkeypatch.undo()
    P.reset_platform()


@pytest.mark.parametrize("transport", ["ibgda", "proxy"])
@pytest.mark.parametrize("warp_size", [32, 64])
def test_example_exchanges_between_two_ranks_on_the_host_arm(two_host_ranks, warp_size, transport):
    """2 ranks, HOST arm, one warp of 32 or 64 lanes per rank: every round each rank receives
    exactly what the previous rank sent, over ibgda and over the proxy."""
    res = two_host_ranks.run("test_examples:job_exchange", transport, warp_size)
    for r in res:
        assert r == {"checked": N * ROUNDS, "arch": "host", "warp_size": warp_size,
                     "transports": [transport]}, r


@pytest.mark.parametrize("transport", ["ibgda", "proxy"])
def test_check_raises_what_the_user_kernel_recorded_then_the_context_works(cpu_platform, transport):
    """One rank, HOST arm: a timed-out wait in the user kernel is raised by ctx.check() as
    gpunet.TimeoutError; the Context stays usable."""
    with gpunet.init(transport=transport, heap_bytes=1 << 20, timeout_s=1.0) as ctx:
        _failure_then_recovery(ctx)


def test_an_unchecked_kernel_failure_is_raised_by_the_next_call(cpu_platform):
    """HOST arm: a user kernel's failure nobody checked is raised by the next API call, not
    silently cleared (and not inherited by the next kernel, whose calls would all fail)."""
    with gpunet.init(transport="ibgda", heap_bytes=1 << 20, timeout_s=1.0) as ctx:
        lib = exchange.load()
        h = ctx.device_context()
        buf = ctx.alloc((64,), torch.float32)
        sig = ctx.alloc((1,), torch.int64)
        assert lib.example_exchange(h.ptr, buf.data_ptr(), buf.data_ptr(), 64, sig.data_ptr(), 9,
                                    0, h.warp_size, None) == 0
        with pytest.raises(gpunet.TimeoutError, match="not followed by ctx.check"):
            ctx.quiet()
        ctx.quiet()
        ctx.check()


def test_build_extension_builds_for_the_platform_arm_and_reports_compile_errors(cpu_platform,
                                                                                 tmp_path):
    """build_extension picks the platform's arm (the CPU platform: HOST), caches the library, and
    a source that does not compile raises ToolchainError with the compiler's message."""
    from gpunet.device import loader

    lib = exchange.load()
    assert lib.gpunet_path.name.startswith("exchange-host-")
    before = loader.compile_count
    assert exchange.load().gpunet_path == lib.gpunet_path and loader.compile_count == before
    bad = tmp_path / "bad.cu"
    bad.write_text('#include <gpunet/gpunet.cuh>\nextern "C" int f() { return gpunet::nope; }\n')
    with pytest.raises(gpunet.ToolchainError, match="nope"):
        gpunet.build_extension([bad], arch="host")
    with pytest.raises(gpunet.ConfigError, match="not found"):
        gpunet.build_extension([tmp_path / "missing.cu"], arch="host")


# --- CUDA: the same kernel on the GPU ------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("transport", ["ibgda", "proxy"])
def test_example_exchanges_between_two_ranks_on_cuda(transport):
    """2 ranks sharing the GPU, the kernel launched on torch's current stream: every round each
    rank receives exactly what the previous rank sent."""
    r = Ranks(2, env={"GPUNET_PLATFORM": "cuda"})
    try:
        res = r.run("test_examples:job_exchange", transport, None)
    finally:
        r.close()
    for x in res:
        assert x == {"checked": N * ROUNDS, "arch": "cuda", "warp_size": 32,
                     "transports": [transport]}, x


@needs_cuda
def test_check_raises_what_the_user_kernel_recorded_on_cuda(monkeypatch):
    """One rank on the GPU: ctx.check() synchronizes the stream and raises the kernel's timeout;
    the Context stays usable."""
    from gpunet.host import platform as P

    monkeypatch.setenv("GPUNET_PLATFORM", "cuda")
    P.reset_platform()
    try:
        with gpunet.init(transport="ibgda", nic="soft", heap_bytes=1 << 20, timeout_s=1.0) as ctx:
            assert ctx.device_context().arch == "cuda"
            _failure_then_recovery(ctx)
    finally:
        monkeypatch.undo()
        P.reset_platform()
