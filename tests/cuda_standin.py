"""TEST DOUBLE, never used outside tests: a stand-in CUDA platform under which a real
``gpunet.init`` runs its set-up on a machine without a GPU (tests/test_transports.py).

What it replaces, and nothing else: the platform object (named "cuda"; "device memory" is a named
shared-memory file, its "CUDA IPC handle" the file's name, so rank processes on this machine open
each other's heaps as CUDA IPC would, and an open can be refused on request), torch's
``cuda.is_available``, the Context's GPU-only leaves (``_setup_gpu_memory``: the NIC mapping and
device descriptors, here the host structs; ``_setup_device_heap``: the allocation's zeroing by a
CUDA fill, here a fresh file is zero) and the launcher (no kernel runs: the tests look at the
set-up, the transport choice and close). The Context's exchanges, checks, transport choice,
peer-heap mappings, NIC registration and close barrier are the real ones.

``node`` makes a rank look as if it were on another machine (gpunet.transports.node_identity).
"""
import contextlib
import mmap
import os

import numpy as np

from gpunet.host.platform import COHERENCE_POLICY, VendorRuntimeError
from gpunet.resource import Resource

HANDLE_BYTES = 64                 # as gpunet/host/platform.py IPC_HANDLE_BYTES
SHM = "/dev/shm"


class _Shm(Resource):
    """A shared-memory file mapped here: ``base`` (its first byte's address), ``nbytes``,
    ``name``; the owner unlinks the file on close."""

    def __init__(self, name, nbytes, create, pid=None):
        path = os.path.join(SHM, name)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            self._mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self._view = np.frombuffer(self._mm, np.uint8)
        self.base, self.nbytes, self.name, self.pid = self._view.ctypes.data, nbytes, name, pid
        self.ptr = self.base                        # as a platform Allocation
        self._owner = create

    def owner_alive(self):
        """As gpunet/host/platform.py IpcMapping.owner_alive: the exporter's pid lives."""
        if self.closed or self.pid is None:
            return not self.closed
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def _release(self):
        del self._view
        self._mm.close()
        if self._owner:
            os.unlink(os.path.join(SHM, self.name))


class StandInCudaPlatform:
    """A platform named "cuda" (profile nvidia, warp 32) for rank ``rank``: ``alloc`` makes
    "device memory" (a named shared-memory file, zeroed), ``ipc_export`` / ``ipc_open`` share it
    by name between the rank processes, ``memcpy`` copies (everything is CPU-addressable here).
    ``refuse``: the ranks whose heap ``ipc_open`` refuses here, as cudaIpcOpenMemHandle does
    between GPUs without peer access. ``opened``: the ranks whose heap was opened here."""

    name, profile, warp_size, is_gpu = "cuda", "nvidia", 32, True

    def __init__(self, rank, refuse=()):
        self.rank, self.refuse, self.opened = rank, set(refuse), []
        self.allocations = []
        self._count = 0

    def policy(self, role):
        return COHERENCE_POLICY[self.profile][role]

    def alloc(self, kind, nbytes, device=None):
        self._count += 1
        a = _Shm("gpunet-standin-rank%d-%d-%d" % (self.rank, os.getpid(), self._count), nbytes,
                 create=True)
        a.kind = kind
        self.allocations.append(a)
        return a

    def ipc_export(self, ptr):
        (a,) = [a for a in self.allocations if a.base == ptr and not a.closed]
        return a.name.encode().ljust(HANDLE_BYTES, b"\0")

    def ipc_open(self, handle, nbytes, device=None, pid=None):
        name = bytes(handle).rstrip(b"\0").decode()
        owner = int(name.split("-")[2][len("rank"):])
        if owner in self.refuse:
            raise VendorRuntimeError("cudaIpcOpenMemHandle failed with error 217 (peer access is "
                                     "not supported between these two devices)",
                                     call="cudaIpcOpenMemHandle", code=217)
        self.opened.append(owner)
        return _Shm(name, nbytes, create=False, pid=pid)

    def memcpy(self, dst, src, nbytes):
        import ctypes
        ctypes.memmove(dst, src, nbytes)


class _NoLauncher(Resource):
    """In place of gpunet/_launch.py Launcher: nothing is launched under the stand-in."""
    dev = None


def _device_heap(ctx, heap_bytes):
    """Context._setup_device_heap without the CUDA fill (a new shared-memory file is zero)."""
    mem = ctx._adopt(ctx.platform.alloc(ctx.platform.policy("p2p_dst").kind, heap_bytes),
                     "device heap")
    return mem.ptr


@contextlib.contextmanager
def standin_cuda(platform, node=None):
    """Within: ``gpunet.init`` runs on ``platform`` (a StandInCudaPlatform) as on CUDA, with
    the leaves the module docstring lists replaced; ``node``: this process's node identity
    (default: the real one)."""
    import pytest
    import torch

    import gpunet.context as C
    import gpunet.transports as T

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(C, "get_platform", lambda: platform)
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(C.Context, "_setup_gpu_memory", lambda self: None)
        mp.setattr(C.Context, "_setup_device_heap", _device_heap)
        mp.setattr(C._launch, "Launcher", lambda nic, gpu, warp_size: _NoLauncher())
        if node is not None:
            mp.setattr(T, "node_identity", lambda: node)
        yield
