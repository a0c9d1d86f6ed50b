"""Shared test configuration."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import Phase, settings
from support.live_marker import LiveGuard

# `make test` and CI run the same examples every run (the ``ci`` profile, the default):
# a failure there is a regression, never a lucky draw. `make fuzz` (docs/testing.md) draws
# fresh examples from a printed seed instead, FUZZ_SCALE times as many as each property
# test asks for. Locally, HYPOTHESIS_PROFILE=deep explores far more sequences.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("deep", max_examples=5000)
settings.register_profile("fuzz", derandomize=False, print_blob=True, deadline=None)
# Mutation testing (make mutants): a failing example is enough to kill a mutant, so no
# shrinking (which can take a minute per mutant) and fewer examples.
settings.register_profile(
    "mutants", derandomize=True, max_examples=30,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
)
_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(_PROFILE)


# The live marker (tests/support/live_marker.py): folders decide, a guard keeps it true.
_GUARD = LiveGuard(Path(__file__).resolve().parent)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "live: may start a real part (lmcache server, vLLM engine, redis-server, a mount); "
        "-m 'not live' is the fast tier, make test-fast (docs/testing.md)",
    )
    config.addinivalue_line(
        "markers",
        "vllm_layout: the outcome depends on the layout vLLM picks per CPU ISA (block size, "
        "state dtypes, kernels); make test-avx2 runs these again on vLLM's AVX2 path "
        "(docs/testing.md 3.3)",
    )
    config.pluginmanager.register(_GUARD, "histate-live-guard")
    _GUARD.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    _GUARD.uninstall()


def pytest_collection_modifyitems(items: list) -> None:
    """Under the fuzz profile, scale each property test's own example budget.

    A test's ``@settings(max_examples=N)`` overrides any profile, so the profile alone
    cannot ask for more examples: the budget each test chose is multiplied instead
    (FUZZ_SCALE, default 20), keeping the tests' relative costs."""
    _GUARD.mark(items)
    if _PROFILE != "fuzz":
        return
    scale = int(os.environ.get("FUZZ_SCALE", "20"))
    for item in items:
        test = getattr(item, "obj", None)
        if getattr(test, "is_hypothesis_test", False):
            # Hypothesis keeps a test's own settings here (``hypothesis._settings``).
            own = getattr(test, "_hypothesis_internal_use_settings", None) or settings()
            test._hypothesis_internal_use_settings = settings(
                own, max_examples=own.max_examples * scale, derandomize=False,
                print_blob=True, deadline=None,
            )


# HISTATE_TEST_ISA=avx2: every vLLM process the tests start (engines, layout probes) takes
# vLLM's AVX2 path, so an AVX-512 machine also checks the AVX2 layout (block size 256,
# bfloat16 GDN state). See tests/support/force_avx2/sitecustomize.py.
if os.environ.get("HISTATE_TEST_ISA", "").lower() == "avx2":
    _FORCE = str(Path(__file__).resolve().parent / "support" / "force_avx2")
    _paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _FORCE not in _paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([_FORCE, *_paths])
