"""gpunet.ep on an NVIDIA GPU (platform "cuda"): the same Buffer, its kernels on the GPU, over
the soft NIC asked for by name (transport="ibgda": "auto" on CUDA would be p2p), the heap device
memory (the soft NIC's engine copies through the CUDA runtime). Runs only where torch.cuda.is_available(); elsewhere every test is
skipped with the reason (scripts/gpu-check.sh counts a skip as a failure on the H200).

What it checks beyond the CPU suite (tests/test_ep_ll.py): the CUDA arm of the EP kernels, CUDA
tensors in and out, hooks and zero-copy on a stream, a CUDA graph that captures dispatch + combine
and replays them on new inputs (counts stay on the device, the per-call state is device-resident),
and two rank processes sharing the GPU.
"""
import pytest
import torch

from gpunet.ep import Buffer
from gpunet.ep import reference as ref
import ep_jobs


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs an NVIDIA GPU: torch.cuda.is_available() is False")

T_MAX, HIDDEN, EXPERTS, TOPK = 16, 512, 8, 4
MODES = [dict(), dict(use_fp8=True), dict(use_fp8=True, round_scale=True, use_ue8m0=True),
         dict(hook=True), dict(zero_copy=True)]


@pytest.fixture(scope="module")
def buf(cuda_platform_module):              # tests/conftest.py selects platform "cuda"
    b = Buffer(None, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(T_MAX, HIDDEN, 1, EXPERTS),
               low_latency_mode=True, explicitly_destroy=True, timeout_s=20.0, transport="ibgda")
    assert b.runtime.platform.name == "cuda" and b.runtime.transports == {0: "ibgda"}
    yield b
    b.destroy()


def _inputs(seed):
    return ref.make_rank_inputs(1, T_MAX, HIDDEN, TOPK, EXPERTS, seed, holes=3)[0]


def _check_dispatch(out, want, use_fp8):
    recv, count, handle = out
    assert torch.equal(count.cpu(), want[1])
    assert torch.equal(handle[1].cpu(), want[3])
    for e in range(EXPERTS):
        n = int(want[1][e])
        assert torch.equal(handle[0][e, :n].cpu(), want[2][e, :n])
        if use_fp8:
            assert torch.equal(recv[0][e, :n].cpu().view(torch.uint8), want[0][0][e, :n].view(torch.uint8))
            assert torch.equal(recv[1][e, :n].cpu(), want[0][1][e, :n])
        else:
            assert torch.equal(recv[e, :n].cpu(), want[0][e, :n])


def test_the_gpus_e4m3_conversion_is_the_software_casts_bit_for_bit(cuda_platform_module):
    """The dispatch quantiser's conversion on the GPU (ll.cuh f32x2_to_e4m3x2: the sm_89+
    cvt.rn.satfinite.e4m3x2 instruction, NaN rewritten to 0x7f | sign) gives the same byte as the
    software cast f32_to_e4m3 (run on the CPU, the HOST arm's path, itself equal to torch's cast)
    for every e4m3 value, every midpoint and its neighbours, the saturation edges, +-inf, zeros
    and NaNs of both signs; also for an odd count (the last value converted alone)."""
    import numpy as np
    from gpunet.device import ep as dep
    lib = dep.load_ep("cuda")
    f = ep_jobs.e4m3_cases()
    for n in (f.size, f.size - 1):
        src = torch.from_numpy(f[:n].copy()).cuda()
        out = torch.zeros(n, dtype=torch.uint8, device="cuda")
        assert lib.gpunet_ep_f32_to_e4m3_device(src.data_ptr(), out.data_ptr(), n) == 0
        want = np.zeros(n, dtype=np.uint8)
        lib.gpunet_ep_f32_to_e4m3(np.ascontiguousarray(f[:n]).ctypes.data, want.ctypes.data, n)
        got = out.cpu().numpy()
        bad = np.nonzero(got != want)[0]
        assert bad.size == 0, "GPU e4m3 differs at %s: got %s, software %s" % (
            f[bad[:8]], got[bad[:8]], want[bad[:8]])


def test_block_threads_beyond_the_kernels_limit_is_refused_with_the_limit(cuda_platform_module):
    """The LL kernel's register use bounds its block size (gpunet_ep_ll_max_block, from the CUDA
    runtime): a Buffer asked for more threads a block raises a ConfigError naming that limit
    instead of failing at the first launch; the default block fits it."""
    from gpunet.errors import ConfigError
    nbytes = Buffer.get_low_latency_rdma_size_hint(T_MAX, HIDDEN, 1, EXPERTS)
    # the limit of the build this Buffer loads (its transports pick it: a p2p-only build uses
    # fewer registers than the all-transport one, so another build's limit may differ)
    fits = Buffer(None, num_rdma_bytes=nbytes, low_latency_mode=True, explicitly_destroy=True)
    most = fits._lib.gpunet_ep_ll_max_block()
    fits.destroy()
    assert 256 <= most <= 1024, most
    if most < 1024:
        with pytest.raises(ConfigError, match="at most %d threads" % most):
            Buffer(None, num_rdma_bytes=nbytes, low_latency_mode=True, explicitly_destroy=True,
                   block_threads=1024)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(sorted(m)) or "bf16")
def test_dispatch_and_combine_on_the_gpu_match_the_reference(buf, mode):
    """CUDA tensors in: the packed rows (FP8 bytes and scales bit for bit), counts and layout equal
    the reference's; combine of the dispatched rows gives x * sum of the weights (one rank holds
    every expert) within DeepEP's bound."""
    inp = _inputs(7)
    x, tk, w = inp["x"].cuda(), inp["topk_idx"].cuda(), inp["topk_weights"].cuda()
    fp8 = mode.get("use_fp8", False)
    recv, count, handle, event, hook = buf.low_latency_dispatch(
        x, tk, T_MAX, EXPERTS, use_fp8=fp8, round_scale=mode.get("round_scale", False),
        use_ue8m0=mode.get("use_ue8m0", False), return_recv_hook=mode.get("hook", False))
    assert (hook is None) != bool(mode.get("hook", False))  # None without return_recv_hook
    if hook is not None:
        hook()
    torch.cuda.synchronize()
    _check_dispatch((recv, count, handle),
                    ref.ll_dispatch_ref([inp["x"]], [inp["topk_idx"]], EXPERTS, T_MAX, 0, use_fp8=fp8,
                                        round_scale=mode.get("round_scale", False),
                                        use_ue8m0=mode.get("use_ue8m0", False)), fp8)
    y = recv if not fp8 else ref.per_token_cast_back(
        recv[0].reshape(-1, HIDDEN), recv[1].reshape(-1, recv[1].shape[-1])
    ).view(recv[0].shape).to(torch.bfloat16)
    if mode.get("zero_copy"):
        z = buf.get_next_low_latency_combine_buffer(handle)
        z.copy_(y)
        y = z
    out, _, chook = buf.low_latency_combine(y, tk, w, handle, zero_copy=mode.get("zero_copy", False),
                                            return_recv_hook=mode.get("hook", False))
    if chook is not None:
        chook()
    torch.cuda.synchronize()
    ws = (inp["topk_weights"] * (inp["topk_idx"] >= 0)).sum(1, keepdim=True)
    want = (inp["x"].float() * ws).to(torch.bfloat16)
    bound = 9e-4 if fp8 else 1e-5
    assert ref.calc_diff(out.cpu(), want) < bound


def test_a_cuda_graph_replays_dispatch_and_combine_on_new_inputs(buf):
    """Capture one dispatch + combine in a CUDA graph, then replay it on three new routings copied
    into the captured inputs: every replay's counts, layout, rows and combined output are that
    routing's reference (nothing of a call lives on the host; the signal counts advance on the
    device)."""
    inp = _inputs(1)
    x, tk, w = inp["x"].cuda(), inp["topk_idx"].cuda(), inp["topk_weights"].cuda()
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, tk, T_MAX, EXPERTS, use_fp8=False)
    buf.low_latency_combine(recv, tk, w, handle)          # warm-up: workspace made outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, tk, T_MAX, EXPERTS, use_fp8=False)
        out, _, _ = buf.low_latency_combine(recv, tk, w, handle)
    for seed in (11, 12, 13):
        new = _inputs(seed)
        x.copy_(new["x"])
        tk.copy_(new["topk_idx"])
        w.copy_(new["topk_weights"])
        g.replay()
        torch.cuda.synchronize()
        _check_dispatch((recv, count, handle),
                        ref.ll_dispatch_ref([new["x"]], [new["topk_idx"]], EXPERTS, T_MAX, 0), False)
        ws = (new["topk_weights"] * (new["topk_idx"] >= 0)).sum(1, keepdim=True)
        assert ref.calc_diff(out.cpu(), (new["x"].float() * ws).to(torch.bfloat16)) < 1e-5


def test_two_ranks_share_the_gpu(cuda_platform):
    """Two rank processes on one GPU (time-sliced without MPS: slow, still bounded), over ibgda:
    tagged BF16 rows and an FP8 round with hooks; every rank's dispatch is the reference's and
    combine is within DeepEP's bounds."""
    ep_jobs.two_rank_rounds("ibgda", {"GPUNET_PLATFORM": "cuda"})
