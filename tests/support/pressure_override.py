"""TEST ONLY: a ``--server-module`` that forces the HiState server's pressure factor.

The interval controller's pressure factor ``F = T_KV / T_state`` is learned from eviction
residence times (``lmcache_histate.core.interval.ResidenceTracker``); a short test cannot
produce a chosen value through real evictions. This module adds one RPC,
``histate_test.force_pressure`` (JSON ``{"factor": F}`` or ``{"factor": null}`` to go back
to the learned value), which makes the server's interval controller use ``F`` for every
following ``histate.plan`` (``HiStateCache.force_pressure_factor``, the core's test hook).
Nothing else changes: eviction keeps its own residence tracker.

Load it next to HiState's own module, with ``tests/support`` on the server's ``PYTHONPATH``
(``support.lmcache_mp.support_pythonpath``), e.g. in a test configuration::

    extra_server_args:
      - --server-module
      - '{"module_path": "pressure_override",
          "factory_name": "build_server_modules", "config": {}}'

It lives with the tests, not in the package: it overrides HiState's interval control.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from lmcache.v1.multiprocess.ext_server_module import (
    ExtServerModuleBuildContext,
    server_module_handler,
)
from lmcache_histate.backends.server import registry

__all__ = ["PressureOverrideModule", "build_server_modules"]

logger = logging.getLogger("lmcache_histate.pressure_override")


class PressureOverrideModule:
    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self.forced: float | None = None

    @property
    def context(self) -> Any:
        return self._ctx

    def report_status(self) -> dict:
        return {"TEST_pressure_override": {"forced_factor": self.forced}}

    def close(self) -> None:
        return None

    @server_module_handler("histate_test.force_pressure")
    def force_pressure(self, payload: bytes) -> bytes:
        request = json.loads(payload or b"{}")
        factor = request.get("factor")
        runtime = registry.current()
        if runtime is None:
            raise RuntimeError("no HiState runtime in this server")
        if factor is not None and float(factor) <= 0:
            raise ValueError(f"factor must be positive, got {factor}")
        effective = runtime.force_pressure_factor(None if factor is None else float(factor))
        self.forced = None if factor is None else float(factor)
        logger.warning("TEST ONLY: HiState pressure factor forced to %s", self.forced)
        return json.dumps({"forced_factor": self.forced, "pressure_factor": effective}).encode()


def build_server_modules(build: ExtServerModuleBuildContext) -> PressureOverrideModule:
    return PressureOverrideModule(build.server_context)
