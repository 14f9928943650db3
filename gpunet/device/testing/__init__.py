"""Test and benchmark support, not the API.

What tests/ and bench/ share to drive device code below the public API; nothing in gpunet's own
code imports it. Installed as ``gpunet.device.testing`` so that a benchmark on a GPU machine
imports it from the installed package (never through tests/ on sys.path).

- :mod:`.loopback`: ``Loopback``, a two-PE world in one process on the soft NIC.
- :mod:`.schedule`: binds ``kernels/schedule.cu`` (the ordering schedule kernel, one CQ poll) and
  mirrors its ``SchedParams``.
- :mod:`.ordering_ref`: the schedule's sequential reference and the checks of its invariants.
- ``kernels/``: ``arch.cu`` (arch.cuh's primitives and the weak-memory model,
  tests/test_device_arch.py), ``post_rate.cu`` (qp.cuh's posting rate, bench/device_post.py),
  ``proxy.cu`` (proxy.cuh's producers, round-trip probe and layout reference: tests/test_proxy.py,
  bench/proxy.py), ``schedule.cu``, ``p2p_bench.cu`` (put_signal ping-pong, bench/p2p.py).
- :mod:`.post_rate`: binds ``kernels/post_rate.cu`` and mirrors its ``PostArgs``.
- :mod:`.mps`: ``private_mps()``, a private CUDA MPS daemon for ranks sharing one GPU (bench/p2p.py).
"""
from pathlib import Path

__all__ = ["kernels_dir"]


def kernels_dir() -> Path:
    """``gpunet/device/testing/kernels``: the test and benchmark kernel sources."""
    return Path(__file__).resolve().parent / "kernels"
