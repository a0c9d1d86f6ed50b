"""TEST ONLY ``--server-module``: delay the store controller's hand-off while a flag exists.

LMCache's store controller hands objects committed to L1 over to the store policy on its
own thread (``StoreController._submit_store_for_single_shape`` calls
``select_store_targets``, lmcache 0.5.6). On a busy host that hand-off can come after the
next LOOKUP, which LMCache already serves from L1; a test cannot make the host that busy
on demand. While ``flag`` exists, this module makes every hand-off wait ``delay_s``
seconds first, so a LOOKUP sent right after a STORE reliably lands in that gap.

Load it next to HiState's own module, with ``tests/support`` on the server's ``PYTHONPATH``
(``support.lmcache_mp.support_pythonpath``)::

    --server-module '{"module_path": "slow_store_handoff", "factory_name":
                      "build_server_modules", "config": {"flag": "/some/path"}}'

It wraps the one store policy instance of the server (an instance attribute; nothing in
LMCache's modules changes). ``/status`` lists it as ``TEST_slow_store_handoff`` with the
hand-offs it held back and those it has released.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from lmcache.v1.multiprocess.ext_server_module import ExtServerModuleBuildContext

__all__ = ["SlowStoreHandoff", "build_server_modules"]


class SlowStoreHandoff:
    def __init__(self, ctx: Any, flag: str, delay_s: float) -> None:
        self._ctx = ctx
        self.flag = flag
        self.delay_s = delay_s
        self.held = 0  # hand-offs that waited
        self.released = 0  # ... and have gone on to the store policy
        policy = ctx.storage_manager._store_controller._policy
        original = policy.select_store_targets

        @functools.wraps(original)
        def select_store_targets(*args: Any, **kwargs: Any) -> Any:
            if not os.path.exists(self.flag):
                return original(*args, **kwargs)
            self.held += 1
            time.sleep(self.delay_s)
            try:
                return original(*args, **kwargs)
            finally:
                self.released += 1

        policy.select_store_targets = select_store_targets

    @property
    def context(self) -> Any:
        return self._ctx

    def report_status(self) -> dict:
        return {"TEST_slow_store_handoff": {"held": self.held, "released": self.released}}

    def close(self) -> None:
        return None


def build_server_modules(build: ExtServerModuleBuildContext) -> SlowStoreHandoff:
    config = build.config or {}
    return SlowStoreHandoff(build.server_context, str(config["flag"]),
                            float(config.get("delay_s", 2.0)))
