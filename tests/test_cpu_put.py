"""The Python hot path of put / quiet on the CPU arm (bench/cpu_put.py measures it): what it
launches, what it still raises, and that the OpDesc it builds by hand is op_list's.
"""
import ctypes

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
