"""pytest configuration: hypothesis profiles, and the fixtures several test files share.

HYPOTHESIS_PROFILE=ci (the default) keeps CI well under 30 minutes on 2 cores;
HYPOTHESIS_PROFILE=deep runs far more examples for a soak on a developer machine.
Tests scale their example counts off the active profile's max_examples.

``cuda_platform`` (one test) and ``cuda_platform_module`` (a whole module) force
GPUNET_PLATFORM=cuda and restore the environment and the platform afterwards.
"""
import contextlib
import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_sessionstart(session):
    """Compile numba's caches and the HOST-arm kernels once, in one process, before any test
    spawns rank processes (``python -m gpunet warmup``; ~2.5 s when they are warm): on a fresh
    clone every rank would otherwise compile the same functions at once, and 2 ranks on 2 cores
    outran the rank pools' 120 s init (CI stop 15). Run in a subprocess so this process's
    platform and environment stay as the tests set them. A failure is reported, not fatal: the
    tests that need what failed say so themselves."""
    import subprocess
    import sys
    try:
        r = subprocess.run([sys.executable, "-m", "gpunet", "warmup"], capture_output=True,
                           text=True, timeout=900)
        msg = (r.stdout + r.stderr).strip().splitlines()
        if r.returncode != 0:
            print("\nconftest: gpunet warmup failed (rc %d): %s" % (r.returncode, "\n".join(msg[-20:])),
                  file=sys.stderr)
    except subprocess.TimeoutExpired:
        print("\nconftest: gpunet warmup gave no answer within 900 s", file=sys.stderr)


@contextlib.contextmanager
def _forced_platform(name):
    """GPUNET_PLATFORM=name with a fresh platform inside; the old value and platform after."""
    from gpunet.host import platform as P
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("GPUNET_PLATFORM", name)
            P.reset_platform()
            yield
    finally:
        P.reset_platform()


@pytest.fixture
def cuda_platform():
    with _forced_platform("cuda"):
        yield


@pytest.fixture(scope="module")
def cuda_platform_module():
    with _forced_platform("cuda"):
        yield
