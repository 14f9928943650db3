"""pytest configuration: hypothesis profiles.

HYPOTHESIS_PROFILE=ci (the default) keeps CI well under 30 minutes on 2 cores;
HYPOTHESIS_PROFILE=deep runs far more examples for a soak on a developer machine.
Tests scale their example counts off the active profile's max_examples.
"""
import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
