"""Client faults in LMCache's log: one line at the first, one summary per window after.

LMCache logs a full traceback for several faults that are a client's, not the server's: a
refused server-module RPC (``access.RefusalLog``), and in the request thread an
undecodable operation id or payload and an unknown operation (:class:`MalformedRequestLog`).
A local user could flood the log with them (20 malformed frames: 480 lines). Each filter
here drops such a record and counts it through a :class:`RateLimitedLine`: the first event
logs one line, later ones one summary line per ``window_s`` while they go on.

The request thread's frames are told apart by the exception the upstream patch raises
(``upstream.lmcache_patches.MalformedRequest``, ``lmcache_patches`` NOTE 4) and, for the
unknown operation (two ``logger.error`` lines, no exception), by LMCache's message
template; everything else passes unchanged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["MQ_LOGGER", "MalformedRequestLog", "RateLimitedLine", "install_filter",
           "install_malformed_request_log"]

MQ_LOGGER = "lmcache.v1.multiprocess.transport.zmq_impl.mq"
"""LMCache 0.5.6's logger of the ZMQ request server (``init_logger(__name__)``)."""

logger = logging.getLogger("lmcache_histate.quiet_log")


class RateLimitedLine:
    """Logs ``first`` at the first event and ``summary`` once per ``window_s`` after it.

    ``first`` is formatted with the event's detail and the window; ``summary`` with the
    count of events since the last line, the window and the latest detail.
    """

    def __init__(self, first: str, summary: str, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.first = first
        self.summary = summary
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._window_start: float | None = None
        self._count = 0
        self.events = 0

    def __call__(self, detail: str) -> None:
        now = self._clock()
        with self._lock:
            self.events += 1
            if self._window_start is not None and now - self._window_start < self.window_s:
                self._count += 1
                return
            count, self._count, self._window_start = self._count, 0, now
        if count:
            logger.warning(self.summary, count, self.window_s, detail)
        else:
            logger.warning(self.first, detail, self.window_s)


_UNKNOWN_OPERATION = ("No handler registered for operation %s", "Available handlers: %s")


class MalformedRequestLog(logging.Filter):
    """Drops the request thread's records of malformed frames; counts them in ``line``."""

    def __init__(self, window_s: float = 60.0) -> None:
        super().__init__()
        self.line = RateLimitedLine(
            "malformed request dropped: %s (further ones: one line per %.0f s)",
            "%d more malformed requests dropped in the last %.0f s; latest: %s",
            window_s,
        )

    def filter(self, record: logging.LogRecord) -> bool:
        from lmcache_histate.backends.upstream import MalformedRequest

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, MalformedRequest):
            self.line(str(exc))
            return False
        if record.msg == _UNKNOWN_OPERATION[0]:
            self.line(f"unknown operation {record.args[0] if record.args else '?'!r}"[:300])
            return False
        return record.msg != _UNKNOWN_OPERATION[1]


F = TypeVar("F", bound=logging.Filter)


def install_filter(logger_name: str, kind: type[F], window_s: float = 60.0) -> F:
    """The ``kind`` filter on ``logger_name``: the one already there, or a new one."""
    target = logging.getLogger(logger_name)
    existing = next((f for f in target.filters if isinstance(f, kind)), None)
    if existing is not None:
        return existing
    quiet = kind(window_s)  # type: ignore[call-arg]
    target.addFilter(quiet)
    return quiet


def install_malformed_request_log(window_s: float = 60.0) -> MalformedRequestLog:
    """Put a :class:`MalformedRequestLog` on LMCache's request-server logger (idempotent)."""
    return install_filter(MQ_LOGGER, MalformedRequestLog, window_s)
