"""How a Context runs device code for its host wrappers: one thread of device/kernels/ops.cu's
op-list kernel per call, and (CUDA) the ring of OpDesc slots for launches in flight.

- CPU platform: the HOST arm runs the kernel synchronously on the calling thread; the Status
  block is read right after it.
- CUDA: the kernel is enqueued on ``torch.cuda.current_stream()``; its OpDescs live in a ring in
  NIC-registered (host-mapped) memory until the next stream synchronization frees every slot.

The Status block has one rule on both: a failure a kernel recorded is reported once and then
cleared, by the next synchronizing call (:meth:`Launcher.run` with ``blocking``, :meth:`sync`)
or, for a user kernel, by ``Context.check()``; a failure still recorded when a launch starts (a
user kernel nobody checked) is reported before that launch, so no kernel starts with the
failure of another (every device call would return false at once).
"""
import ctypes

import torch

from gpunet.device import abi
from gpunet.device.ops import op_list  # noqa: F401 - the Context builds its op lists with it
from gpunet.errors import ConfigError, GpunetError
from gpunet.resource import Resource

OPS_RING = 1024                   # GPU: OpDesc slots for launches in flight (64 KiB, mapped arena)


class Launcher(Resource):
    """Runs op lists for one Context. ``nic``: where the CUDA ring lives (``nic.alloc``);
    ``gpu``: launch on CUDA (else the HOST arm); ``warp_size``: the launches' warp size. ``dev``
    (the Context's device context, device/descriptors.py DeviceContext) is set once it exists.

    A Resource: on CUDA ``close()`` first waits for the current stream, because no kernel may
    still run on descriptors its Context is about to free (the Context closes it first).
    """

    def __init__(self, nic, gpu, warp_size):
        from gpunet.device.ops import Launch, load_ops

        self._gpu = gpu
        self.dev = None
        self.warp_size = warp_size
        self.launch = Launch(grid=1, block=1, warp_size=warp_size)
        self.lib = load_ops("cuda" if gpu else "host")
        if gpu:
            u32, vp = ctypes.c_uint32, ctypes.c_void_p
            f = self.lib.gpunet_ops_launch_stream
            f.argtypes, f.restype = [u32, u32, u32, vp, vp, u32, vp, u32], ctypes.c_int
            self._ring = nic.alloc(OPS_RING * ctypes.sizeof(abi.OpDesc), 4096)
            self._top = 0            # next free OpDesc slot; reset after each stream sync

    def run(self, ops, what, blocking=True):
        """Launch the op-list kernel on ``ops``. Returns (the OpDescs the kernel writes, the
        failure recorded or None, whether the kernel is known to be done: always on the CPU, on
        CUDA only with ``blocking``: then the stream was synchronized)."""
        if self._gpu:
            return self._run_gpu(ops, what, blocking)
        st = self.dev.status
        if st.code:                   # recorded by a kernel nobody checked (see the module doc)
            return ops, self._take_failure("an earlier device kernel (not followed by "
                                           "ctx.check()), reported before %s" % what), False
        rc = self.lib.gpunet_ops_launch(*self.launch.args(), self.dev.addr, ctypes.addressof(ops),
                                        len(ops))
        if rc != 0:
            raise GpunetError("%s: device kernel launch failed (%d)" % (what, rc))
        return ops, self._take_failure(what) if st.code else None, True

    def _run_gpu(self, ops, what, blocking):
        n = len(ops)
        if n > OPS_RING:
            raise ConfigError("%s: %d ops exceed the launch ring (%d)" % (what, n, OPS_RING))
        if self._top + n > OPS_RING:
            err = self.sync(what)    # every slot in flight: wait for them (and report)
            if err is not None:
                return ops, err, False
        addr = self._ring.ctypes.data + self._top * ctypes.sizeof(abi.OpDesc)
        self._top += n
        dops = (abi.OpDesc * n).from_address(addr)
        ctypes.memmove(addr, ctypes.addressof(ops), ctypes.sizeof(ops))
        rc = self.lib.gpunet_ops_launch_stream(1, 1, self.warp_size, self.dev.addr, addr, n,
                                               self.stream() or None, 0)
        if rc != 0:
            raise GpunetError("%s: CUDA kernel launch failed (cudaError %d)" % (what, rc))
        if blocking:
            return dops, self.sync(what), True
        return dops, None, False

    def stream(self):
        """The stream launches go on: torch's current CUDA stream handle (0 on the CPU)."""
        return torch.cuda.current_stream().cuda_stream if self._gpu else 0

    def sync(self, what):
        """Wait until every kernel launched so far is done (CUDA: the current stream), then take
        the failure they recorded: returned (and cleared), or None."""
        if self._gpu:
            torch.cuda.current_stream().synchronize()
            self._top = 0
        st = self.dev.read_status()
        if not st.code:
            return None
        return self._take_failure(what + " (or an earlier non-blocking call on this stream)"
                                  if self._gpu else what)

    def _take_failure(self, what):
        err = abi.status_error(self.dev.read_status(), what)
        self.dev.clear_status()
        return err

    def _release(self):
        if self._gpu:
            torch.cuda.current_stream().synchronize()
