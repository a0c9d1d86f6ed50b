"""The LMCache extension points' own checks (``backends/server/plugins.py``), without a
server: a ``histate.plan`` payload becomes a ``PlanRequest`` or one refusal naming the
argument; the server module finds the launcher's runtime on the HTTP app's state only
(plugins NOTE 2)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lmcache") is None, reason="needs the live extra (lmcache)"
)

CHUNK = 16
MAX = 1024


def test_a_plan_payload_becomes_a_plan_request() -> None:
    from lmcache_histate.backends.server.plugins import PlanRequest, parse_plan_request

    full = {"start_tokens": 32, "input_tokens": 256, "step_tokens": 240, "step_price": 2}
    assert parse_plan_request(full, MAX, CHUNK) == PlanRequest(32, 256, 240, 2.0)
    # start_tokens defaults to 0; without the engine's grid and price both stay None.
    assert parse_plan_request({"input_tokens": MAX}, MAX, CHUNK) == PlanRequest(0, MAX)


@pytest.mark.parametrize(("request_", "message"), [
    ({}, "input_tokens is missing"),
    ({"input_tokens": MAX + 1}, r"input_tokens must be an integer in \[0, 1024\]"),
    ({"input_tokens": True}, r"input_tokens must be an integer in \[0, 1024\]"),
    ({"start_tokens": 64, "input_tokens": 32}, "start_tokens 64 is after input_tokens 32"),
    ({"input_tokens": 64, "step_tokens": 24}, "step_tokens must be a positive multiple of"),
    ({"input_tokens": 64, "step_tokens": MAX + CHUNK}, "step_tokens must be a positive"),
    ({"input_tokens": 64, "step_price": -1}, "step_price must be a finite number >= 0"),
])
def test_a_bad_plan_payload_is_refused_in_one_line(request_: dict, message: str) -> None:
    from lmcache_histate.backends.server.access import RpcRefused
    from lmcache_histate.backends.server.plugins import parse_plan_request

    with pytest.raises(RpcRefused, match=message) as refused:
        parse_plan_request(request_, MAX, CHUNK)
    assert "\n" not in str(refused.value)


def test_the_server_module_finds_the_runtime_on_the_app_state_only(tmp_path: Path) -> None:
    from lmcache_histate.backends.server.plugins import RUNTIME_STATE, runtime_of
    from lmcache_histate.backends.server.runtime.runtime import HiStateRuntime

    from lmcache_histate.config import parse_config

    cfg = parse_config({"model": "tiny-qwen3-next", "chunk_size": CHUNK, "cpu_gib": 1,
                        "disk_path": str(tmp_path), "disk_gib": 1})
    runtime = HiStateRuntime(cfg)
    stock = SimpleNamespace(state=SimpleNamespace())  # a stock ``lmcache server``'s app
    assert runtime_of(stock) is None
    assert runtime_of(SimpleNamespace(state=SimpleNamespace(**{RUNTIME_STATE: object()}))) is None
    launched = SimpleNamespace(state=SimpleNamespace(**{RUNTIME_STATE: runtime}))
    assert runtime_of(launched) is runtime
