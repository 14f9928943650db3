"""The command line's main jobs run end to end (the README's first command)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(args, timeout=600):
    return subprocess.run([sys.executable, "-m", "gpunet", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_selftest_passes_every_row():
    r = _run(["selftest"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "9 passed, 0 failed" in r.stdout


def test_demo_prints_a_row_per_transport_and_size(tmp_path):
    png, js = tmp_path / "demo.png", tmp_path / "demo.json"
    r = _run(["demo", "--iters", "5", "--warmup", "1", "--reps", "2", "--sizes", "64,65536",
              "--plot", str(png), "--json", str(js)])
    assert r.returncode == 0, r.stdout + r.stderr
    for t in ("ibgda", "proxy"):
        assert sum(1 for line in r.stdout.splitlines() if line.startswith(t)) == 4, r.stdout
    assert "[gpunet demo]" in r.stderr           # the progress line
    assert js.exists()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert png.exists() and png.stat().st_size > 1000


def test_unknown_command_is_an_error():
    r = _run(["frobnicate"])
    assert r.returncode != 0 and "invalid choice" in r.stderr


def test_doctor_is_a_command_with_its_options():
    """``doctor`` is a subcommand and takes its own options (tests/test_doctor.py runs it)."""
    r = _run(["doctor", "--help"])
    assert r.returncode == 0, r.stdout + r.stderr
    for opt in ("--json", "--profile", "--nic", "--platform", "--timeout", "--no-loopback"):
        assert opt in r.stdout, opt


def test_warmup_runs_both_loopbacks():
    """``warmup`` (install.sh and conftest run it): a one-rank loopback per NIC transport, whose
    compile caches the rank processes then load instead of each compiling them at once."""
    r = _run(["warmup"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ibgda and proxy loopbacks ok" in r.stdout, r.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH: the CUDA arm cannot be compiled")
def test_cuda_prebuild_fills_the_kernel_cache_in_parallel_and_names_failures(tmp_path, monkeypatch):
    """doctor.prebuild_cuda (``warmup --cuda``; the GPU gate's scripts/gpu_warm.py) builds each
    listed source in a process of its own into the kernel cache, runs ``then`` meanwhile, and the
    next build of the same source in this process is a cache hit (no compile); a source that does
    not exist makes it raise a ToolchainError naming that source, after the others are built.
    The gate's list names only files that exist."""
    import importlib.util

    from gpunet import doctor
    from gpunet.device import loader, testing
    from gpunet.errors import ToolchainError
    spec = importlib.util.spec_from_file_location("gpu_warm", ROOT / "scripts" / "gpu_warm.py")
    gpu_warm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_warm)
    paths = [p[0] if isinstance(p, tuple) else p for p in gpu_warm.sources()]
    assert all(p.is_file() for p in paths) and len(paths) == 9
    monkeypatch.setenv("GPUNET_CACHE_DIR", str(tmp_path))
    ran = []
    small = [loader.kernels_dir() / "doctor.cu", testing.kernels_dir() / "proxy.cu"]
    secs = doctor.prebuild_cuda(small, then=lambda: ran.append(True))
    assert set(secs) == {"doctor.cu", "proxy.cu"} and ran == [True], secs
    assert sorted(p.name.split("-")[0] for p in tmp_path.glob("*-cuda-*.so")) == ["doctor", "proxy"]
    assert loader.build([small[0]], arch="cuda").gpunet_compiled is False
    with pytest.raises(ToolchainError, match=r"cuda prebuild failed for nope\.cu"):
        doctor.prebuild_cuda([loader.kernels_dir() / "nope.cu", small[0]])


def test_a_failed_warmup_names_the_failed_checks():
    """With a NIC kind that cannot open here (no RDMA device in CI), warm() raises a gpunet error
    naming the check that failed, instead of returning as if the caches were ready."""
    from gpunet.errors import GpunetError
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("an RDMA device is present: nic='verbs' may open here")
    from gpunet.doctor import warm
    with pytest.raises(GpunetError, match=r"warm-up failed: ibgda: init"):
        warm(nic_kind="verbs", timeout_s=5.0)
