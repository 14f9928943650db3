"""gpunet.ep: MoE expert-parallel all-to-all with DeepEP V1's API (``Buffer``), over gpunet's
transports (ibgda, proxy, p2p, per peer). Both modes, low-latency and high-throughput; see
gpunet/ep/buffer.py.

    from gpunet.ep import Buffer
    buf = Buffer(group, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(128, 7168, R, 288),
                 low_latency_mode=True)
    recv_x, count, handle, event, hook = buf.low_latency_dispatch(x, topk_idx, 128, 288)

``install_as_deep_ep()`` makes ``import deep_ep`` return this module (explicitly, never on import);
for processes that are not yours (a framework's workers), ``python -m gpunet ep-shim`` prints a
folder whose ``deep_ep`` package does it when put on PYTHONPATH.
``gpunet.ep.reference`` holds the plain-torch references the tests compare against.
"""
import sys

from gpunet.errors import EPTimeout
from gpunet.ep.buffer import Buffer, Config, EventHandle, EventOverlap, topk_idx_t

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "EPTimeout", "topk_idx_t",
           "install_as_deep_ep", "shim_path"]


# DeepEP's submodules that callers import by name, as gpunet's: `import deep_ep.buffer` would
# otherwise run gpunet/ep/buffer.py again under that name, and its Buffer / Config would be other
# classes than deep_ep.Buffer / deep_ep.Config.
_DEEP_EP_SUBMODULES = ("buffer", "utils")


def install_as_deep_ep():
    """Register this module as ``deep_ep`` in sys.modules (and its ``buffer`` and ``utils`` as
    ``deep_ep.buffer`` / ``deep_ep.utils``), so code that does ``import deep_ep`` /
    ``from deep_ep import Buffer`` / ``from deep_ep.utils import EventOverlap`` gets gpunet's.
    Returns the module. Refuses (ConfigError) when a different ``deep_ep`` is imported already:
    replacing a live module would mix two libraries (gpunet's own shim, ``python -m gpunet
    ep-shim``, is the one it replaces)."""
    import importlib

    from gpunet.errors import ConfigError

    me = sys.modules[__name__]
    have = sys.modules.get("deep_ep")
    if have is not None and have is not me and not getattr(have, "__gpunet_shim__", False):
        raise ConfigError("install_as_deep_ep: a different deep_ep module (%r) is imported already; "
                          "call install_as_deep_ep() before anything imports deep_ep" % (have,))
    sys.modules["deep_ep"] = me
    for name in _DEEP_EP_SUBMODULES:
        sys.modules["deep_ep." + name] = importlib.import_module(__name__ + "." + name)
    return me


def shim_path():
    """The folder to put on PYTHONPATH so that ``import deep_ep`` gives gpunet.ep in any process
    (its ``deep_ep`` package calls install_as_deep_ep()); ``python -m gpunet ep-shim`` prints it."""
    from pathlib import Path

    return str(Path(__file__).resolve().parent / "deep-ep-shim")
