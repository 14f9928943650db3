"""gpunet.ep: MoE expert-parallel all-to-all with DeepEP V1's API (``Buffer``), over gpunet's
transports (ibgda, proxy, p2p, per peer). Both modes, low-latency and high-throughput; see
gpunet/ep/buffer.py.

    from gpunet.ep import Buffer
    buf = Buffer(group, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(128, 7168, R, 288),
                 low_latency_mode=True)
    recv_x, count, handle, event, hook = buf.low_latency_dispatch(x, topk_idx, 128, 288)

``install_as_deep_ep()`` makes ``import deep_ep`` return this module (explicitly, never on import).
``gpunet.ep.reference`` holds the plain-torch references the tests compare against.
"""
import sys

from gpunet.errors import EPTimeout
from gpunet.ep.buffer import Buffer, Config, EventHandle, EventOverlap, topk_idx_t

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "EPTimeout", "topk_idx_t",
           "install_as_deep_ep"]


def install_as_deep_ep():
    """Register this module as ``deep_ep`` in sys.modules, so code that does ``import deep_ep`` /
    ``from deep_ep import Buffer`` gets gpunet's. Returns the module. Refuses (ConfigError) when a
    different ``deep_ep`` is imported already: replacing a live module would mix two libraries."""
    from gpunet.errors import ConfigError

    me = sys.modules[__name__]
    have = sys.modules.get("deep_ep")
    if have is not None and have is not me:
        raise ConfigError("install_as_deep_ep: a different deep_ep module (%r) is imported already; "
                          "call install_as_deep_ep() before anything imports deep_ep" % (have,))
    sys.modules["deep_ep"] = me
    return me
