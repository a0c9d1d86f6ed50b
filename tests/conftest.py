"""Shared test configuration."""

from __future__ import annotations

import os

from hypothesis import settings

# CI runs must be reproducible: the same examples every run. Locally, HYPOTHESIS_PROFILE=deep
# explores far more sequences.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("deep", max_examples=5000)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default")
)
