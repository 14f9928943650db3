"""gpunet: GPU-initiated RDMA transport (IBGDA / GDAKI model) for MetaX C500 and NVIDIA GPUs.

The CPU default runs everything against a software mlx5 NIC (``gpunet.host.softnic``).
"""
from .errors import (ClosedError, CoherenceViolation, CompletionError, ConfigError,
                     GpunetError, TimeoutError, ToolchainError)

__version__ = "0.1.0"

__all__ = ["GpunetError", "ConfigError", "ToolchainError", "TimeoutError", "CompletionError",
           "CoherenceViolation", "ClosedError", "__version__"]
