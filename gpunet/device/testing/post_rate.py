"""Test and benchmark support, not the API: kernels/post_rate.cu bound for Python.

``PostArgs`` mirrors post_rate.cu's struct (``load`` checks its size against the kernel's);
bench/device_post.py times ``gpunet_bench_post`` / ``gpunet_bench_store`` with it and
tests/test_device_post.py drives ``gpunet_test_post`` (the HOST arm) with the same mirror.
"""
import ctypes

u32, u64 = ctypes.c_uint32, ctypes.c_uint64


class PostArgs(ctypes.Structure):
    _fields_ = [("qps", u64), ("status", u64), ("timeout_ns", u64), ("raddr", u64), ("laddr", u64),
                ("span", u64), ("nqps", u32), ("iters", u32), ("rkey", u32), ("lkey", u32),
                ("nbytes", u32), ("do_quiet", u32), ("per_lane", u32), ("mixed", u32)]


def load(arch="host", defines=None):
    """Build (cached) and bind kernels/post_rate.cu for ``arch``; ToolchainError when the
    kernel's sizeof(PostArgs) is not the mirror's (or the compiler is missing)."""
    from gpunet.device import loader
    from gpunet.device.testing import kernels_dir
    from gpunet.errors import ToolchainError

    b = loader.build([kernels_dir() / "post_rate.cu"], arch=arch, defines=defines or {})
    if getattr(b, "_gpunet_bound", False):
        return b
    vp, f32p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_float)
    b.gpunet_bench_post_args_size.argtypes, b.gpunet_bench_post_args_size.restype = [], u32
    b.gpunet_bench_post.argtypes, b.gpunet_bench_post.restype = [u32, u32, vp, f32p], ctypes.c_int
    b.gpunet_bench_store.argtypes = [u32, u32, u64, u32, u32, f32p]
    b.gpunet_bench_store.restype = ctypes.c_int
    b.gpunet_bench_phases.argtypes = [ctypes.POINTER(u64)]
    b.gpunet_bench_phases.restype = ctypes.c_int
    b.gpunet_test_post.argtypes = [u32, u32, u32, u32, u64, vp]   # (the weak-memory option: HOST)
    b.gpunet_test_post.restype = ctypes.c_int
    got = b.gpunet_bench_post_args_size()
    if got != ctypes.sizeof(PostArgs):
        raise ToolchainError("post_rate.cu PostArgs is %d bytes, the mirror %d"
                             % (got, ctypes.sizeof(PostArgs)))
    b._gpunet_bound = True
    return b
