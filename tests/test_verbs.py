"""The real-NIC side on a host without a NIC: pyverbs loads (or says why not), no devices, and
the DevX NIC (gpunet/host/devx.py, through its real pyverbs layer) refuses clearly. Tests needing a NIC
skip with the reason."""
import pytest

from gpunet.errors import GpunetError, ToolchainError
from gpunet.host import verbs

needs_pyverbs = pytest.mark.skipif(not verbs.have_pyverbs(),
                                   reason="pyverbs is not installed (python3-pyverbs)")


@needs_pyverbs
def test_no_nic_means_no_devices_and_the_devx_nic_refuses():
    """Without an RDMA device available_devices() is [] and DevxNic (pyverbs underneath) raises
    'use nic=soft', for the first device as for a named one."""
    from gpunet.host.devx import DevxNic
    if verbs.available_devices():
        pytest.skip("this host has an RDMA device")
    with pytest.raises(GpunetError, match="no RDMA device found; use nic='soft'"):
        DevxNic()
    with pytest.raises(verbs.NoRdmaDeviceError):
        DevxNic("mlx5_0")


def test_missing_pyverbs_is_a_toolchain_error(monkeypatch):
    """When pyverbs cannot be imported, the error says so and names the package to install."""
    monkeypatch.setattr(verbs, "_pyverbs", None)
    monkeypatch.setattr(verbs, "_pyverbs_error", None)
    monkeypatch.setattr(verbs, "DEBIAN_DIST_PACKAGES", "/nonexistent")
    import sys
    saved = {k: v for k, v in sys.modules.items() if k == "pyverbs" or k.startswith("pyverbs.")}
    for k in saved:
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.setitem(sys.modules, "pyverbs", None)     # makes `import pyverbs` fail
    with pytest.raises(ToolchainError, match="python3-pyverbs"):
        verbs.available_devices()
    assert not verbs.have_pyverbs()
