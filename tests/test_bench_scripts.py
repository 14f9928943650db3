"""The benchmark scripts' CPU-side logic: bench/device_post.py builds its CUDA kernels and runs its
whole flow (sink, soft NIC rows, GPU ordering variant) on the HOST arm."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "device_post.py"


def _nvcc():
    return shutil.which(os.environ.get("GPUNET_NVCC", "nvcc")) or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT))


@pytest.mark.skipif(_nvcc() is None, reason="nvcc (the CUDA toolkit) is not installed: the CUDA arm "
                                            "of device_post.py cannot be compiled here")
def test_device_post_compile_only():
    r = _run("--compile-only")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "built for CUDA" in r.stdout


def test_device_post_cpu_smoke(tmp_path):
    """The same script on the HOST arm: sink rows, soft-NIC rows and ordering schedules all pass."""
    out = tmp_path / "dp.json"
    r = _run("--cpu-smoke", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    import json
    d = json.loads(out.read_text())
    assert d["ordering_pass"] is True
    assert all(o["ok"] for o in d["ordering"])
    assert any(row["row"] == "post, sink" for row in d["rows"])
    assert all(row["note"].startswith("OK") for row in d["rows"] if row["row"] == "post, soft NIC")


def test_post_warp_k_moves_every_byte_on_the_host_arm(tmp_path):
    """post_warp_k (8 WQEs per lane per reservation, warps of 32 interleaved so each store covers
    consecutive WQEBBs): on the soft NIC every WQE executes and the destination equals the source,
    in both CQ modes; the sink rows account for every WQEBB (heads agree)."""
    out = tmp_path / "dpk.json"
    r = _run("--cpu-smoke", "--per-lane", "8", "--skip", "ordering", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    import json
    rows = json.loads(out.read_text())["rows"]
    e2e = [row for row in rows if row["row"] == "post, soft NIC"]
    assert len(e2e) == 4 and all(row["note"].startswith("OK") for row in e2e), e2e
    assert all(row["wqes"] > 0 for row in rows if row["row"] == "post, sink")


def test_device_post_without_gpu_fails_fast():
    """No GPU: a clear message and exit status 2, not a crash or a hang."""
    env = dict(os.environ, GPUNET_PLATFORM="cpu")
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120,
                       cwd=str(ROOT), env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "needs an NVIDIA GPU" in r.stderr
