"""Access control of the control plane: the shared secret on HTTP routes and HiState RPCs.

With ``auth_token_file`` set (required by ``allow_remote: true``, see
``lmcache_histate.config`` NOTE 4):

* every HTTP route of the server (LMCache's and HiState's: ``/cache/clear``,
  ``DELETE /cache/objects``, ``/config``, ``/env``, ``/status``, ``/metrics``, ...) needs
  ``Authorization: Bearer <secret>``, except ``GET /healthcheck`` (liveness probes);
  a request without it gets 401 and never reaches the route;
* HiState's RPCs (``histate.status``, ``histate.plan``) need ``"token": "<secret>"`` in
  their JSON payload.

LMCache's ZMQ protocol (REGISTER, STORE, LOOKUP, RETRIEVE, ...) has no authentication in
0.5.6 and cannot be guarded from here: that port must be firewalled to the vLLM hosts
(docs/deployment.md, Security).

NOTE 1: the guard is an ASGI middleware added to LMCache's module-level FastAPI ``app``
by the launcher before uvicorn starts it (Starlette refuses middleware on a started app;
server modules are built inside the app's lifespan, too late). Comparison is
constant-time (``hmac.compare_digest``).

Bounded and quiet, authenticated or not:

* ``BodyLimit`` (always installed, outermost): a request body over ``MAX_BODY`` bytes gets
  413 before any of it is read when ``Content-Length`` says so, and as soon as the bound is
  crossed when the body is chunked (the route never sees more than the bound: NOTE 3);
* ``RefusalLog``: LMCache logs a full traceback for every exception a server-module RPC
  raises (``ext_server_module.server_module_call``); a refused RPC (``RpcRefused``: no
  token, a bad argument) is a client's fault, not the server's, so its record is replaced
  by one line at the first refusal and one summary line per ``window_s`` while refusals
  go on (NOTE 2).

NOTE 2 (why a filter on LMCache's logger): the router turns a handler's exception into
the ``success=False`` answer the client must get and logs it in the same step; a handler
that did not raise would answer success. Dropping the record there keeps the answer and
stops an unauthenticated loopback caller from flooding the log (100 refusals: 1 line).

NOTE 3 (a chunked body over the bound): an exception raised out of ``receive`` is turned
into a 400 by FastAPI's body parsing, so the middleware sends the 413 itself and hands the
route an ``http.disconnect`` (the client is treated as gone); whatever the route answers
after that is dropped.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .quiet_log import RateLimitedLine, install_filter

__all__ = ["MAX_BODY", "OPEN_ROUTES", "AuthError", "BearerGuard", "BodyLimit", "RefusalLog",
           "RpcRefused", "check_rpc_token", "install_http_guard", "install_refusal_log"]

MAX_BODY = 1 << 20
"""Bytes: the largest HTTP request body (LMCache's routes take small JSON objects)."""
RPC_LOGGER = "lmcache.v1.multiprocess.ext_server_module"
"""LMCache 0.5.6's logger of server-module RPC failures (``init_logger(__name__)``)."""


OPEN_ROUTES = frozenset({("GET", "/healthcheck")})
"""(method, path) pairs reachable without the secret."""

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class RpcRefused(ValueError):
    """An RPC refused for the caller's fault (bad argument, no secret): logged quietly."""


class AuthError(RpcRefused, PermissionError):
    """A request without the right secret."""


def _same(given: str | bytes, secret: str) -> bool:
    if isinstance(given, str):
        given = given.encode()
    return hmac.compare_digest(given, secret.encode())


class BearerGuard:
    """ASGI middleware: 401 for every HTTP request without ``Authorization: Bearer <secret>``
    (``OPEN_ROUTES`` excepted)."""

    def __init__(self, app: ASGIApp, secret: str) -> None:
        self.app = app
        self._expected = b"Bearer " + secret.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["method"], scope["path"]) not in OPEN_ROUTES:
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                body = json.dumps({"error": "missing or wrong bearer token"}).encode()
                await send({
                    "type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"www-authenticate", b"Bearer")],
                })
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


async def _reply(send: Send, status: int, error: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": json.dumps({"error": error}).encode()})


class BodyLimit:
    """ASGI middleware: 413 for a request body over ``limit`` bytes (module docstring)."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = f"request body over {self.limit} bytes"
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await _reply(send, 413, too_big)
            return
        seen = 0
        started = refused = False

        async def bounded() -> MutableMapping[str, Any]:
            # NOTE 3: over the bound, answer 413 here and tell the route the client left.
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    refused = True
                    if not started:
                        await _reply(send, 413, too_big)
                    return {"type": "http.disconnect"}
            return message

        async def tracked(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            if refused:
                return  # the 413 is the answer; the route's own reply is dropped
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, bounded, tracked)


def install_http_guard(app: Any, secret: str | None) -> None:
    """Add ``BearerGuard`` (with a secret) and ``BodyLimit`` (always, outermost) to a
    FastAPI/Starlette ``app`` that has not started yet."""
    if secret is not None:
        app.add_middleware(BearerGuard, secret=secret)
    app.add_middleware(BodyLimit)


class RefusalLog(logging.Filter):
    """Drops LMCache's traceback of a refused RPC; logs one line at the first refusal and
    one summary per ``window_s`` while they go on (module docstring, NOTE 2)."""

    def __init__(self, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self._line = RateLimitedLine(
            "RPC refused: %s (further refusals: one line per %.0f s)",
            "%d more RPCs refused in the last %.0f s; latest: %s",
            window_s, clock,
        )

    @property
    def refused(self) -> int:
        return self._line.events

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, RpcRefused):
            return True
        self._line(str(exc))
        return False


def install_refusal_log(window_s: float = 60.0) -> RefusalLog:
    """Put a ``RefusalLog`` on LMCache's RPC logger (idempotent per process)."""
    return install_filter(RPC_LOGGER, RefusalLog, window_s)


def check_rpc_token(request: dict[str, Any], secret: str | None) -> None:
    """Raise ``AuthError`` unless ``request["token"]`` is the secret (no secret: no check)."""
    if secret is None:
        return
    token = request.get("token")
    if not isinstance(token, str) or not _same(token, secret):
        raise AuthError("HiState RPC: missing or wrong token")
