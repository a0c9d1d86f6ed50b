"""TEST ONLY ``--server-module``: stop LMCache's request thread once a flag file exists.

Once the launcher's loop guard (``upstream.install_request_loop_guard``) holds, no frame a
client can send stops the request thread, so a test of what happens when it stops anyway
(a bug not yet known) must cause the fault from inside: this module's watcher thread waits
for ``flag``, then gives every ``MessageQueueServer`` of the process a poller whose ``poll``
raises, which ends the loop at its next turn (within its 1 s poll). Load it with
``tests/support`` on the server's ``PYTHONPATH`` (``support.lmcache_mp.support_pythonpath``)::

    --server-module '{"module_path": "request_loop_fault", "factory_name":
                      "build_server_modules", "config": {"flag": "/some/path"}}'
"""

from __future__ import annotations

import gc
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["build_server_modules"]


class _BrokenPoller:
    def poll(self, *_args: Any) -> Any:
        raise RuntimeError("TEST: injected request-loop fault")


def _break_when_flagged(flag: str) -> None:
    from lmcache.v1.multiprocess.transport.zmq_impl.mq import MessageQueueServer

    while not os.path.exists(flag):
        time.sleep(0.05)
    for obj in gc.get_objects():
        if isinstance(obj, MessageQueueServer):
            obj.poller = _BrokenPoller()


@dataclass
class RequestLoopFault:
    """Server module object: shows the fault's flag under ``GET /status``."""

    context: Any
    flag: str

    def report_status(self) -> dict[str, Any]:
        return {"TEST_request_loop_fault": {"flag": self.flag}}

    def close(self) -> None:
        return None


def build_server_modules(build_ctx: Any) -> RequestLoopFault:
    """``--server-module`` factory; config ``{"flag": PATH}`` (required)."""
    flag = str(dict(getattr(build_ctx, "config", {}) or {})["flag"])
    threading.Thread(target=_break_when_flagged, args=(flag,), daemon=True,
                     name="TEST-request-loop-fault").start()
    return RequestLoopFault(build_ctx.server_context, flag)
