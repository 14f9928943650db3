"""gpunet: GPU-initiated RDMA transport (IBGDA / GDAKI model) for MetaX C500 and NVIDIA GPUs.

The CPU default runs everything against a software mlx5 NIC (``gpunet.host.softnic``).
"""
from .errors import (CloseError, ClosedError, CoherenceViolation, CompletionError, ConfigError,
                     GpunetError, TimeoutError, ToolchainError)

__version__ = "0.1.0"


def __getattr__(name):
    # The API pulls in torch and numba: import it on first use, so `import gpunet` stays light.
    if name in _API:
        from gpunet import api
        value = getattr(api, name)
        globals()[name] = value     # later lookups are plain attributes (this hook cost ~1.3 us a call)
        return value
    raise AttributeError("module 'gpunet' has no attribute %r" % name)


_API = ("init", "put", "put_batch", "get", "put_signal", "atomic_add", "wait_until", "quiet",
        "barrier", "Context", "Remote", "read_signal", "DeviceHandle", "build_extension")

__all__ = ["GpunetError", "ConfigError", "ToolchainError", "TimeoutError", "CompletionError",
           "CoherenceViolation", "ClosedError", "CloseError", "__version__", *_API]
