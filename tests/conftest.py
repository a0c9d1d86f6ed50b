"""Shared test configuration."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import Phase, settings

# CI runs must be reproducible: the same examples every run. Locally, HYPOTHESIS_PROFILE=deep
# explores far more sequences.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("deep", max_examples=5000)
# Mutation testing (make mutants): a failing example is enough to kill a mutant, so no
# shrinking (which can take a minute per mutant) and fewer examples.
settings.register_profile(
    "mutants", derandomize=True, max_examples=30,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default")
)

# HISTATE_TEST_ISA=avx2: every vLLM process the tests start (engines, layout probes) takes
# vLLM's AVX2 path, so an AVX-512 machine also checks the AVX2 layout (block size 256,
# bfloat16 GDN state). See tests/support/force_avx2/sitecustomize.py.
if os.environ.get("HISTATE_TEST_ISA", "").lower() == "avx2":
    _FORCE = str(Path(__file__).resolve().parent / "support" / "force_avx2")
    _paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _FORCE not in _paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([_FORCE, *_paths])

# Every test's eviction queue re-ranks a top that its stamp says is current anyway and
# asserts that the stamp told the truth (``core/eviction.py`` NOTE 4): any operation
# sequence a test runs also checks that no input of a rank changes unnoticed.
from lmcache_histate.core.eviction import EvictionQueue  # noqa: E402

EvictionQueue.verify_stamps = True
