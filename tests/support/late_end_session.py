"""TEST ONLY ``--server-module``: END_SESSION requests for ``TEST-late-*`` ids finish only
after the request server has closed.

A request that ends on a pool thread after ``MessageQueueServer.close()`` is what made
LMCache 0.5.6 log a ``_notify_response`` traceback at shutdown (``file descriptor cannot be
a negative integer (-1)``, docs/reliability.md); under real load some store does, but a
quick test server finishes its requests before any signal lands, so a test holds some back
on purpose. It wraps ``LookupModule.end_session`` on the module *instance* (as HiState's
server module wraps its hooks): for a ``TEST-late-*`` id it waits until the request server
(found by type) is closed, plus ``after_s`` for ``close()`` to release its notifier, and
answers without running the original (the engines' state is gone by then); other ids are
served as before. Load it with ``tests/support`` on the
server's ``PYTHONPATH``::

    --server-module '{"module_path": "late_end_session", "factory_name":
                      "build_server_modules", "config": {}}'
"""

from __future__ import annotations

import functools
import gc
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["LATE_PREFIX", "build_server_modules"]

LATE_PREFIX = "TEST-late-"


def _wait_for_close(after_s: float, limit_s: float = 120.0) -> None:
    from lmcache.v1.multiprocess.transport.zmq_impl.mq import MessageQueueServer

    servers = [o for o in gc.get_objects() if isinstance(o, MessageQueueServer)]
    for server in servers:
        server.is_finished.wait(limit_s)
    time.sleep(after_s)


def _late(original: Any, after_s: float) -> Any:
    @functools.wraps(original)
    def end_session(request_id: str) -> None:
        if request_id.startswith(LATE_PREFIX):
            _wait_for_close(after_s)
            return None  # nothing to end: the engines' state is gone by now
        return original(request_id)

    return end_session


@dataclass
class LateEndSession:
    """Server module object: shows itself under ``GET /status``."""

    context: Any

    def report_status(self) -> dict[str, Any]:
        return {"TEST_late_end_session": {"prefix": LATE_PREFIX}}

    def close(self) -> None:
        return None


def build_server_modules(build_ctx: Any) -> LateEndSession:
    """``--server-module`` factory; config ``{"after_s": SECONDS}`` (default 0.3)."""
    from lmcache.v1.multiprocess.modules.lookup import LookupModule

    after_s = float(dict(getattr(build_ctx, "config", {}) or {}).get("after_s", 0.3))
    for module in build_ctx.modules:
        if isinstance(module, LookupModule):
            module.end_session = _late(module.end_session, after_s)
    return LateEndSession(build_ctx.server_context)
