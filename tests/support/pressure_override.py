"""TEST ONLY: a ``--server-module`` that forces the HiState server's pressure factor.

The interval controller's pressure factor ``F = T_KV / T_state`` is learned from eviction
residence times (``lmcache_histate.core.interval.ResidenceTracker``); a short test cannot
produce a chosen value through real evictions. This module adds one RPC,
``histate_test.force_pressure`` (JSON ``{"factor": F}``, ``F > 0``), which makes the
server's interval controller plan every following ``histate.plan`` with ``F``, through
the core's public verb for pooled residence times (``HiStateCache.follow_residence`` with
``T_KV = F`` s and ``T_state = 1`` s, one sample each). Nothing else changes: eviction
keeps feeding the core's own residence tracker.

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
from lmcache_histate.backends.server.plugins import runtime_of

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
        if factor is None or not float(factor) > 0:
            raise ValueError(f"factor must be a positive number, got {factor}")
        from lmcache.v1.multiprocess.http_server import app

        runtime = runtime_of(app)
        if runtime is None:
            raise RuntimeError("no HiState runtime in this server")
        with runtime.step():
            core = runtime.core
            if core is None:
                raise RuntimeError("HiState runtime has no core yet (serve one request first)")
            effective = core.follow_residence(float(factor), 1, 1.0, 1)
        self.forced = float(factor)
        logger.warning("TEST ONLY: HiState pressure factor forced to %s", self.forced)
        return json.dumps({"forced_factor": self.forced, "pressure_factor": effective}).encode()


def build_server_modules(build: ExtServerModuleBuildContext) -> PressureOverrideModule:
    return PressureOverrideModule(build.server_context)
