"""The real NIC's detection: rdma-core's pyverbs (imported lazily) and the RDMA devices it sees.
gpunet/host/devx.py (DevxNic) drives an mlx5 NIC with DevX on top of this.

- ``import_pyverbs()``: imports pyverbs, falling back to Debian's ``python3-pyverbs`` (installed in
  /usr/lib/python3/dist-packages, outside a pyenv/venv Python's path) when its extension modules
  match this interpreter. Run here (Debian bookworm, rdma-core 44, Python 3.11).
- ``available_devices()``: RDMA device names; ``[]`` when there is no NIC (pyverbs raises
  PyverbsRDMAError then: FACTS.md). Run here, where there is no NIC.
- ``NoRdmaDeviceError``: what a real NIC asked for on a host without one raises ("use
  nic='soft'"; tests/test_verbs.py).
"""
import importlib.machinery
import importlib.util
import os
import sys

from gpunet.errors import ConfigError, ToolchainError

# Where Debian/Ubuntu put python3-pyverbs (built for the system Python, matched to the system
# rdma-core; PyPI's pyverbs needs rdma-core >= 59 and fails to import on bookworm — FACTS.md).
DEBIAN_DIST_PACKAGES = "/usr/lib/python3/dist-packages"

_pyverbs = None
_pyverbs_error = None


def _load_debian_pyverbs():
    """Import the Debian pyverbs package by its location, without putting the rest of
    dist-packages on sys.path. Returns the module or None if absent / built for another Python."""
    pkg = os.path.join(DEBIAN_DIST_PACKAGES, "pyverbs")
    init = os.path.join(pkg, "__init__.py")
    if not os.path.exists(init):
        return None
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]   # e.g. .cpython-311-x86_64-linux-gnu.so
    if not os.path.exists(os.path.join(pkg, "device" + suffix)):
        return None
    for name in [m for m in sys.modules if m == "pyverbs" or m.startswith("pyverbs.")]:
        del sys.modules[name]          # a broken PyPI pyverbs half-imported before us
    spec = importlib.util.spec_from_file_location("pyverbs", init, submodule_search_locations=[pkg])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["pyverbs"] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception:
        sys.modules.pop("pyverbs", None)
        raise
    return mod


def import_pyverbs():
    """The pyverbs package, imported once. Raises ToolchainError saying how to get it."""
    global _pyverbs, _pyverbs_error
    if _pyverbs is not None:
        return _pyverbs
    if _pyverbs_error is not None:
        raise ToolchainError(_pyverbs_error)
    try:
        import pyverbs
        import pyverbs.device  # noqa: F401 - the extension modules must load too
        _pyverbs = pyverbs
        return pyverbs
    except ImportError as first:
        problem = f"import pyverbs failed ({first})"
    try:
        mod = _load_debian_pyverbs()
        if mod is not None:
            import pyverbs.device  # noqa: F401
            _pyverbs = mod
            return mod
        problem += (f"; no python3-pyverbs for Python {sys.version_info.major}."
                    f"{sys.version_info.minor} under {DEBIAN_DIST_PACKAGES}")
    except ImportError as second:
        problem += f"; Debian's copy in {DEBIAN_DIST_PACKAGES} failed too ({second})"
    _pyverbs_error = (f"pyverbs (rdma-core's Python bindings) is missing: {problem}. Install "
                      f"python3-pyverbs (Debian/Ubuntu, matched to the system rdma-core) for a "
                      f"real NIC, or use nic='soft'.")
    raise ToolchainError(_pyverbs_error)


def have_pyverbs():
    """True if pyverbs imports (a real NIC may then be used); never raises."""
    try:
        import_pyverbs()
        return True
    except ToolchainError:
        return False


def available_devices():
    """Names of the RDMA devices on this host (e.g. ["mlx5_0", "mlx5_1"]); [] when there is none.

    pyverbs raises PyverbsRDMAError from get_device_list() when no device exists: that means
    "no NIC", not a failure. Raises ToolchainError when pyverbs itself is missing.
    """
    pv = import_pyverbs()
    from pyverbs.device import get_device_list
    from pyverbs.pyverbs_error import PyverbsRDMAError
    try:
        devs = get_device_list()
    except PyverbsRDMAError:
        return []
    del pv
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devs]


class NoRdmaDeviceError(ConfigError):
    """A real NIC was asked for and this host has none (or not the one named)."""
