"""Access control of the control plane: the shared secret on HTTP routes and HiState RPCs.

With ``auth_token_file`` set (required by ``allow_remote: true``, see
``lmcache_histate.exposure``):

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
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["OPEN_ROUTES", "AuthError", "BearerGuard", "check_rpc_token", "install_http_guard"]

OPEN_ROUTES = frozenset({("GET", "/healthcheck")})
"""(method, path) pairs reachable without the secret."""

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class AuthError(PermissionError):
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


def install_http_guard(app: Any, secret: str) -> None:
    """Add ``BearerGuard`` to a FastAPI/Starlette ``app`` that has not started yet."""
    app.add_middleware(BearerGuard, secret=secret)


def check_rpc_token(request: dict[str, Any], secret: str | None) -> None:
    """Raise ``AuthError`` unless ``request["token"]`` is the secret (no secret: no check)."""
    if secret is None:
        return
    token = request.get("token")
    if not isinstance(token, str) or not _same(token, secret):
        raise AuthError("HiState RPC: missing or wrong token")
