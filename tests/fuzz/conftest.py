"""Hypothesis budgets for the fuzz targets in this directory.

`make test` runs them with the bounded profile (a few seconds per target, so the whole set adds
well under a minute on two cores); `make fuzz` sets `FUZZ_PROFILE=long` for a run of many minutes.
Examples are drawn at random each run; a failure prints the `@reproduce_failure` line that replays it.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# Generating nested messages and YAML is slower than the code under test: not a health problem here.
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]

# Bounded and repeatable under `make test` (a fixed seed); `make fuzz` explores anew each run.
settings.register_profile(
    "bounded", max_examples=150, deadline=None, suppress_health_check=_QUIET, derandomize=True
)
settings.register_profile(
    "long", max_examples=10_000, deadline=None, suppress_health_check=_QUIET, print_blob=True
)
settings.load_profile(os.environ.get("FUZZ_PROFILE", "bounded"))
