"""The kernels of gpunet/device/kernels/ops.cu, bound for Python: the op-list kernel and the bulk put
behind the host wrappers (gpunet/_launch.py); tests drive them directly through :func:`run_ops`
and :func:`run_put_bulk`."""
import ctypes

from gpunet.device import abi

def load_ops(arch="host", defines=None):
    """Build (cached) and bind gpunet/device/kernels/ops.cu for ``arch``; checks the struct sizes."""
    from gpunet.device import loader
    from gpunet.errors import ToolchainError

    lib = loader.build([loader.kernels_dir() / "ops.cu"], arch=arch, defines=defines or {})
    if getattr(lib, "_gpunet_bound", False):
        return lib
    u32, u64, vp = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
    lib.gpunet_ops_abi_size.argtypes, lib.gpunet_ops_abi_size.restype = [u32], u32
    lib.gpunet_ops_launch.argtypes = [u32, u32, u32, u32, u64, u32, u32, vp, vp, u32]
    lib.gpunet_ops_launch.restype = ctypes.c_int
    lib.gpunet_put_bulk_launch.argtypes = [u32, u32, u32, u32, u64, u32, u32, vp, vp, u32, u64, vp, u32]
    lib.gpunet_put_bulk_launch.restype = ctypes.c_int
    lib.gpunet_put_p2p_launch.argtypes = [u32, u32, u32, u64, u64, u64, u64, u32, vp, u32]
    lib.gpunet_put_p2p_launch.restype = ctypes.c_int
    for i, name in enumerate(["Status", "CqDesc", "QpDesc", "PeerDesc", "DevCtx", "OpDesc"]):
        got = lib.gpunet_ops_abi_size(i)
        if got != abi.SIZES[name]:
            raise ToolchainError("ops.cu was built with sizeof(%s) = %d, gpunet/device/abi.py expects %d"
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


def run_put_bulk(lib, lb, ops, chunk, launch, check=True):
    """Run ops.cu's bulk put (k_put_bulk) on ``ops`` (an abi.OpDesc array of OP_PUT, shared by
    the whole grid; each ``ok`` is set to 1 first and cleared by the block that fails it), cut in
    ``chunk``-byte pieces, with ``launch``'s geometry and weak-memory choices, on ``lb`` (as
    :func:`run_ops`); raise the Status if ``check``."""
    from gpunet.errors import ConfigError, GpunetError

    if chunk <= 0:
        raise ConfigError("run_put_bulk: chunk must be > 0 bytes, not %r" % (chunk,))
    for o in ops:
        if o.kind != abi.OP_PUT:
            raise ConfigError("run_put_bulk: every op must be OP_PUT, not kind %d" % o.kind)
        o.ok = 1
    rc = lib.gpunet_put_bulk_launch(*launch.args(), ctypes.addressof(lb.ctx), ctypes.addressof(ops),
                                    len(ops), chunk, None, 1)
    if rc != 0:
        raise GpunetError("bulk put kernel launch failed (%d)" % rc)
    if check:
        abi.raise_for_status(lb.status, "bulk put kernel")
