"""Hypothesis settings of the property suite: the "ci" profile (the default) draws a fixed,
derandomized sequence of examples, so a run's verdict does not depend on the machine or the
day; `HYPOTHESIS_PROFILE=thorough` draws 10x as many (run by hand, not in CI). A test that is
expensive per example asks for a fraction of `settings.default.max_examples`."""

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=50, **_COMMON)
settings.register_profile("thorough", max_examples=500, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
