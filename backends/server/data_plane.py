"""Health is the data plane: ``/healthcheck``, ``/status`` and ``/metrics`` answer 503 while
engines cannot be served.

LMCache 0.5.6's ``/healthcheck`` answers ``healthy`` whenever its HTTP app holds an engine
object (``http_apis/info_api.py: healthcheck``). Engines are served by another part: the
ZMQ request server's one thread (``mq-server-thread``) that reads every REGISTER, STORE,
LOOKUP and RETRIEVE. When that thread was gone, the probe found ``/healthcheck`` healthy
while every engine RPC timed out.

:class:`DataPlaneProbe` asks what an engine needs, in order:

1. the request server's thread is alive (``MessageQueueServer.worker_thread``);
2. a ``ping`` RPC (LMCache's own liveness RPC, answered by a pool thread and sent back
   through the request thread's output queue: the whole path a STORE's answer takes) makes
   the round trip on the ZMQ port within ``timeout_s``.

The answer is kept ``max_age_s``, and one check runs at a time, so a flood of probes costs
at most one round trip per ``max_age_s`` (NOTE 1). :class:`DataPlaneGate`, an ASGI
middleware the launcher adds before the app starts (as ``access``, NOTE 1 there), runs the
check before ``HEALTH_ROUTES`` and answers ``503 {"status": "unhealthy", "reason": ...}``
when it fails; a Prometheus scrape of ``/metrics`` then fails too (``up == 0``), which is
what an alert on a stopped data plane needs.

NOTE 1 (a cached answer): a check that found the data plane healthy may be up to
``max_age_s`` old; a check that fails is as old as the failure. The ping itself is one
small message on loopback (< 1 ms on an idle server); under load it waits for a normal-pool
thread, like a LOOKUP would.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from .access import ASGIApp, Receive, Scope, Send

__all__ = ["HEALTH_ROUTES", "DataPlaneGate", "DataPlaneProbe", "install_data_plane_gate",
           "probe_url"]

HEALTH_ROUTES = frozenset({"/healthcheck", "/status", "/metrics"})
"""Paths whose answer says the server is serving: each fails with the data plane."""


def probe_url(host: str, port: int) -> str:
    """The ZMQ URL to reach a server bound on ``host:port`` from this machine."""
    if host in ("0.0.0.0", "", "*"):
        host = "127.0.0.1"
    return f"tcp://{host}:{port}"


class DataPlaneProbe:
    """Whether the request thread lives and a ``ping`` RPC makes the round trip (module
    docstring). :meth:`check` returns None when healthy, else the reason in one line."""

    def __init__(self, zmq_url: str, timeout_s: float = 2.0, max_age_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.zmq_url = zmq_url
        self.timeout_s = timeout_s
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: tuple[float, str | None] | None = None
        self._uids = itertools.count(1)
        self._context: Any = None

    def check(self, request_server: Any) -> str | None:
        with self._lock:
            if self._last is not None and self._clock() - self._last[0] < self.max_age_s:
                return self._last[1]
            reason = self._thread_stopped(request_server) or self._round_trip()
            self._last = (self._clock(), reason)
            return reason

    @staticmethod
    def _thread_stopped(request_server: Any) -> str | None:
        thread = getattr(request_server, "worker_thread", None)
        if thread is not None and not thread.is_alive():
            return f"LMCache's request thread ({thread.name}) has stopped: engines get no answers"
        return None

    def _round_trip(self) -> str | None:
        import msgspec
        import zmq
        from lmcache.v1.multiprocess.transport.zmq_impl.wire import encode_operation

        if self._context is None:
            self._context = zmq.Context()
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.zmq_url)
            uid = msgspec.msgpack.encode(next(self._uids))
            sock.send_multipart([uid, encode_operation("ping"), msgspec.msgpack.encode(None)])
            if not sock.poll(int(self.timeout_s * 1000)):
                return (f"no answer to a ping RPC on {self.zmq_url} within "
                        f"{self.timeout_s:g} s: engines get no answers")
            frames = sock.recv_multipart()
        except zmq.ZMQError as exc:
            return f"ping RPC on {self.zmq_url} failed: {exc}"
        finally:
            sock.close()
        try:
            ok = len(frames) == 3 and frames[0] == uid and msgspec.msgpack.decode(frames[2])
        except msgspec.DecodeError:
            ok = False
        return None if ok is True else f"unexpected answer to a ping RPC: {frames!r}"[:300]


class DataPlaneGate:
    """ASGI middleware: ``HEALTH_ROUTES`` answer 503 while :class:`DataPlaneProbe` fails."""

    def __init__(self, app: ASGIApp, probe: DataPlaneProbe) -> None:
        self.app = app
        self.probe = probe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in HEALTH_ROUTES:
            state = getattr(scope.get("app"), "state", None)
            server = getattr(state, "request_server", None)
            if server is not None:  # before start-up the route answers 503 itself
                reason = await asyncio.to_thread(self.probe.check, server)
                if reason is not None:
                    body = json.dumps({"status": "unhealthy", "reason": reason}).encode()
                    await send({"type": "http.response.start", "status": 503,
                                "headers": [(b"content-type", b"application/json")]})
                    await send({"type": "http.response.body", "body": body})
                    return
        await self.app(scope, receive, send)


def install_data_plane_gate(app: Any, zmq_url: str) -> DataPlaneProbe:
    """Add a :class:`DataPlaneGate` probing ``zmq_url`` to a FastAPI app not yet started.

    Call before ``access.install_http_guard``: the last middleware added is the outermost,
    so the secret and the body bound are checked first."""
    probe = DataPlaneProbe(zmq_url)
    app.add_middleware(DataPlaneGate, probe=probe)
    return probe
