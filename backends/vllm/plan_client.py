"""The vLLM connector's client for the HiState server module's RPCs.

``HiStateConnector`` asks the server, over LMCache's ``server_module_call`` RPC on the
connection it already holds, for two things: ``histate.status`` once at start (is a HiState
module active there, and which geometry did it assume) and ``histate.plan`` per new segment
(the snapshot boundaries the server's interval controller chooses with the live pressure
factor, on the engine's step grid and at its measured step price). A server with a shared
secret (``auth_token_file``) wants it in every payload.

Invariant: once :meth:`PlanClient.probe` found no active module, :meth:`plan` returns None
for the connector's lifetime (no RPC per request to a server that cannot answer); a failed
plan call returns None for that request only, counted in ``plan_errors``.

A plan can be asked for before it is needed (:meth:`PlanClient.submit`): the connector
sends it with the request's LMCache lookup, so the two round trips overlap instead of
adding up on the request's way to its first step, and keeps the request waiting (not the
engine) until :meth:`PendingPlan.ready`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

__all__ = ["PendingPlan", "PlanClient"]

from lmcache_histate.protocol import PLAN_METHOD, STATUS_METHOD

logger = logging.getLogger("lmcache_histate.connector")


class PlanClient:
    """``histate.status`` / ``histate.plan`` through one LMCache request client."""

    def __init__(self, client: Callable[[], Any], *, token: str | None, timeout: float,
                 count: Callable[[str], None], step_tokens: int | None = None) -> None:
        """``step_tokens``: the engine's step grid (its budget in whole chunks with the
        step scheduler, one chunk without), sent with every plan request so a server can
        price step ends (``core.interval``); a server that does not read it ignores it.
        :attr:`step_price` (``σ``, tokens of prefill per step end; None: not measured yet)
        goes with it once the step scheduler has measured it (``step_scheduler.StepPriceFit``)."""
        self._client = client  # the adapter's request client, looked up per call
        self._token = token
        self._step_tokens = step_tokens
        self.step_price: float | None = None
        self.timeout = timeout
        self._count = count
        self.active = False

    def call(self, method: str, payload: dict[str, Any], timeout: float) -> Any:
        """One ``server_module_call`` RPC; returns LMCache's response envelope."""
        return self._send(method, payload).result(timeout)

    def _send(self, method: str, payload: dict[str, Any]) -> Any:
        """Send one ``server_module_call``; LMCache's future of the response envelope."""
        from lmcache.v1.multiprocess.protocols.server_module import ServerModuleCallRequest

        if self._token is not None:  # a server with a shared secret (docs/deployment.md)
            payload = {**payload, "token": self._token}
        request = ServerModuleCallRequest(method=method, payload=json.dumps(payload).encode())
        return self._client().server_module_call(request)

    def probe(self) -> dict[str, Any] | None:
        """The server's HiState status if it runs an active HiState module, else None.

        A stock server without any server-module RPC handler does not answer at all (LMCache
        builds its RPC router only when some module declares a handler), so the probe has a
        timeout; the outcome is logged once and holds for the connector's lifetime.
        """
        try:
            response = self.call(STATUS_METHOD, {}, min(self.timeout, 3.0))
        except Exception as exc:
            reason = f"no answer to {STATUS_METHOD} ({type(exc).__name__})"
        else:
            if response.success:
                status = json.loads(response.payload or b"{}")
                if status.get("active"):
                    self.active = True
                    return dict(status)
                reason = "its HiState module is inactive (policy is not histate)"
            else:
                reason = response.error or f"{STATUS_METHOD} failed"
        logger.warning(
            "HiState: the LMCache server has no active HiState module (%s); interval saves "
            "use a local interval controller with pressure factor 1", reason,
        )
        return None

    def plan(self, start: int, end: int) -> list[int] | None:
        """The server's plan, or None (no HiState module there, or the call failed)."""
        pending = self.submit(start, end)
        return None if pending is None else pending.result()

    def submit(self, start: int, end: int) -> PendingPlan | None:
        """Send a ``histate.plan`` request now; None if no server can answer it."""
        if not self.active:
            return None
        try:
            payload: dict[str, Any] = {"start_tokens": start, "input_tokens": end}
            if self._step_tokens is not None:
                payload["step_tokens"] = self._step_tokens
            if self.step_price is not None:
                payload["step_price"] = self.step_price
            future = self._send(PLAN_METHOD, payload)
        except Exception as exc:  # transport failure
            return PendingPlan(None, self.timeout, self._count, exc)
        return PendingPlan(future, self.timeout, self._count)


class PendingPlan:
    """A ``histate.plan`` request in flight; :meth:`result` waits for it the first time and
    returns the same answer after that.

    Invariant: :meth:`ready` never blocks, and once it is True :meth:`result` does not wait
    (the answer is in, the call failed, or the timeout counted from the send has passed); a
    failure is counted and logged once."""

    def __init__(self, future: Any, timeout: float, count: Callable[[str], None],
                 error: Exception | None = None) -> None:
        self._future = future
        self._deadline = time.monotonic() + timeout
        self._count = count
        self._error = error
        self.taken = False
        """Whether :meth:`result` has returned (the answer is kept)."""
        self._answer: list[int] | None = None

    def ready(self) -> bool:
        """Whether :meth:`result` would return without waiting."""
        if self.taken or self._error is not None or time.monotonic() >= self._deadline:
            return True
        try:
            return bool(self._future.query())
        except Exception as exc:  # transport failure
            self._error = exc
            return True

    def result(self) -> list[int] | None:
        """The server's boundaries, or None (the call failed: counted and logged)."""
        if not self.taken:
            self._answer = self._take()
            self.taken = True
        return self._answer

    def _take(self) -> list[int] | None:
        if self._error is None:
            try:
                response = self._future.result(max(0.0, self._deadline - time.monotonic()))
            except Exception as exc:  # timeout, transport failure
                self._error = exc
        if self._error is not None:
            self._count("plan_errors")
            logger.warning("HiState: %s RPC failed (%s); local plan for this request",
                           PLAN_METHOD, self._error)
            return None
        if not response.success:
            self._count("plan_errors")
            logger.warning("HiState: %s failed on the server (%s); local plan for this "
                           "request", PLAN_METHOD, response.error)
            return None
        return [int(b) for b in json.loads(response.payload or b"{}").get("boundaries", [])]
