"""The kernels of device/kernels/ops.cu, bound for Python: the op-list kernel behind the host
wrappers (gpunet/_launch.py); tests drive it directly through :func:`run_ops`."""
import ctypes

from gpunet.device import abi

def load_ops(arch="host", defines=None):
    """Build (cached) and bind device/kernels/ops.cu for ``arch``; checks the struct sizes."""
    from gpunet.device import loader
    from gpunet.errors import ToolchainError

    lib = loader.build([loader.kernels_dir() / "ops.cu"], arch=arch, defines=defines or {})
    if getattr(lib, "_gpunet_bound", False):
        return lib
    u32, u64, vp = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
    lib.gpunet_ops_abi_size.argtypes, lib.gpunet_ops_abi_size.restype = [u32], u32
    lib.gpunet_ops_launch.argtypes = [u32, u32, u32, u32, u64, u32, u32, vp, vp, u32]
    lib.gpunet_ops_launch.restype = ctypes.c_int
    for i, name in enumerate(["Status", "CqDesc", "QpDesc", "PeerDesc", "DevCtx", "OpDesc"]):
        got = lib.gpunet_ops_abi_size(i)
        if got != abi.SIZES[name]:
            raise ToolchainError("ops.cu was built with sizeof(%s) = %d, device/abi.py expects %d"
                                 % (name, got, abi.SIZES[name]))
    lib._gpunet_bound = True
    return lib


def op_list(*specs):
    """An abi.OpDesc array, one per spec (a dict of OpDesc fields)."""
    ops = (abi.OpDesc * len(specs))()
    for o, s in zip(ops, specs):
        for k, v in s.items():
            setattr(o, k, v)
    return ops


class Launch:
    """Launch geometry and the HOST weak-memory choices (ignored on GPUs)."""

    def __init__(self, grid=1, block=1, warp_size=32, weak=False, seed=0, order=0, sleep_ns=0):
        self.grid, self.block, self.warp_size = grid, block, warp_size
        self.weak, self.seed, self.order, self.sleep_ns = weak, seed, order, sleep_ns

    def args(self):
        return (self.grid, self.block, self.warp_size, int(self.weak), self.seed, self.order, self.sleep_ns)


def run_ops(lib, lb, ops, per_thread, launch, check=True):
    """Run ``ops`` (abi.OpDesc array, per_thread per thread) on ``lb`` (anything with a DevCtx
    ``.ctx`` and its Status ``.status``, e.g. gpunet.device.testing.loopback.Loopback); raise the
    Status if ``check``."""
    from gpunet.errors import GpunetError

    rc = lib.gpunet_ops_launch(*launch.args(), ctypes.addressof(lb.ctx), ctypes.addressof(ops), per_thread)
    if rc != 0:
        raise GpunetError("ops kernel launch failed (%d)" % rc)
    if check:
        abi.raise_for_status(lb.status, "ops kernel")
