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
