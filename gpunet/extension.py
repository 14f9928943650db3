"""Build a user's own device sources against gpunet's headers: ``gpunet.build_extension``.

A user kernel includes ``<gpunet/gpunet.cuh>``, takes a ``gpunet::DevCtx*`` (``ctx.device_context()
.ptr``) and is started by an ``extern "C"`` host wrapper that calls ``gpunet::launch_kernel``
(gpunet/device/include/gpunet/arch.cuh). This builds such sources for the arm of the platform gpunet runs
on (CPU: the HOST arm, g++; CUDA: nvcc; MACA: mxcc, unverified) with gpunet/device/loader.py, cached like
gpunet's own kernels, and returns the loaded library. examples/exchange.py is a worked example.
"""
ARMS = {"cpu": "host", "cuda": "cuda", "maca": "maca"}


def build_extension(sources, defines=None, include_dirs=None, extra_flags=None, arch=None):
    """Compile ``sources`` (paths of .cu / .cpp files with ``extern "C"`` launchers) into one
    shared library and load it: a ``ctypes.CDLL`` (set each function's argtypes before calling).

    ``defines`` ({"NAME": value or None}), ``include_dirs`` (searched after gpunet's own
    ``gpunet/device/include``) and ``extra_flags`` go to the compiler; ``arch``: "host" | "cuda" | "maca",
    by default the current platform's arm (gpunet/host/platform.py ``get_platform()``), which is what a
    Context on this platform launches with. Raises ToolchainError when the compiler is missing or
    the compile fails (with its output), ConfigError for a missing source or an unknown arch.
    """
    from gpunet.device import loader

    if arch is None:
        from gpunet.host.platform import get_platform

        arch = ARMS[get_platform().name]
    return loader.build(sources, arch=arch, defines=defines, include_dirs=include_dirs,
                        extra_flags=extra_flags)
