"""Test and benchmark support, not the API: kernels/schedule.cu bound for Python.

``SchedParams`` mirrors schedule.cu's struct byte for byte (tests/test_device_qp.py's layout
test compiles it); ``K_*`` are the kinds of its operation table (``SchedParams.mix`` bits).
"""
import ctypes

from gpunet.device import abi

u32, u64 = ctypes.c_uint32, ctypes.c_uint64

K_PUT, K_INLINE, K_GET, K_SIGNAL, K_ATOMIC, K_QUIET, K_FENCE, K_WARP = range(8)
MIX_ALL = 0xFF                 # every kind enabled


class SchedParams(ctypes.Structure):
    _fields_ = [("seed", u64), ("rounds", u32), ("ops", u32), ("nthreads", u32), ("region", u32),
                ("max_size", u32), ("mix", u32), ("ncounters", u32), ("warp_region", u32),
                ("check_every", u32), ("pe", u32), ("src", u64), ("wsrc", u64), ("get_src", u64),
                ("get_dst", u64), ("put_dst", u64), ("warp_dst", u64), ("sig", u64),
                ("counters", u64), ("results", u64), ("violations", u64), ("peer_view", u64)]


STRUCTS = {"SchedParams": SchedParams}
SIZES = {"SchedParams": 136}


def load(arch="host", defines=None):
    """Build (cached) and bind kernels/schedule.cu for ``arch``; checks sizeof(SchedParams)."""
    from gpunet.device import loader
    from gpunet.device.testing import kernels_dir
    from gpunet.errors import ToolchainError

    lib = loader.build([kernels_dir() / "schedule.cu"], arch=arch, defines=defines or {})
    if getattr(lib, "_gpunet_bound", False):
        return lib
    vp = ctypes.c_void_p
    lib.gpunet_schedule_params_size.argtypes, lib.gpunet_schedule_params_size.restype = [], u32
    lib.gpunet_schedule_launch.argtypes = [u32, u32, u32, u32, u64, u32, u32, vp, vp]
    lib.gpunet_schedule_launch.restype = ctypes.c_int
    lib.gpunet_poll_cq_once.argtypes, lib.gpunet_poll_cq_once.restype = [vp, vp], ctypes.c_int
    lib.gpunet_own_once.argtypes, lib.gpunet_own_once.restype = [vp, u64, u64, u64], ctypes.c_int
    got = lib.gpunet_schedule_params_size()
    if got != SIZES["SchedParams"]:
        raise ToolchainError("schedule.cu was built with sizeof(SchedParams) = %d, "
                             "gpunet.device.testing.schedule expects %d" % (got, SIZES["SchedParams"]))
    lib._gpunet_bound = True
    return lib


def run_schedule(lib, lb, params, launch, check=True):
    """Run one schedule launch (``params``: a SchedParams; ``launch``: gpunet.device.ops.Launch)
    on ``lb`` (a Loopback: its ``.ctx`` and ``.status``); raise the Status if ``check``."""
    from gpunet.errors import GpunetError

    rc = lib.gpunet_schedule_launch(*launch.args(), ctypes.addressof(lb.ctx), ctypes.addressof(params))
    if rc != 0:
        raise GpunetError("schedule kernel launch failed (%d)" % rc)
    if check:
        abi.raise_for_status(lb.status, "schedule kernel")
