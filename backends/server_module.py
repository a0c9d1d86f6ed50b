"""HiState server module for ``lmcache server`` (``--server-module``).

Loaded by LMCache after its built-in modules exist and before the request server binds
handlers (``v1/multiprocess/ext_server_module.py``). It:

* hands the server context to the HiState runtime (storage manager, layout registry with
  each object group's kind, token hasher, chunk size);
* observes the requests the policy core must see, by wrapping three handlers of the
  built-in module *instances* it is given (``ExtServerModuleBuildContext.modules``): the
  wrapper calls the runtime, then the original handler, with the same signature, so the
  request server validates and binds it like the original —
  ``LMCacheDrivenTransferModule.store`` (the STORE's ordered chunk-hash chain, recorded
  before its objects are committed), ``LookupModule.lookup`` (refresh-all, pins, hit
  counters) and ``LookupModule.end_session`` (unpin). A failure inside HiState is logged
  and counted, never propagated into the request;
* reports the runtime's state in ``GET /status`` (key ``histate``) and as Prometheus
  metrics on ``GET /metrics`` (``histate_*``);
* answers two extension RPCs (``server_module_call``): ``histate.status`` (JSON) and
  ``histate.plan`` (JSON ``{"start_tokens": s, "input_tokens": n}`` → the token
  positions whose recurrent states HiState's interval controller wants saved).
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

from lmcache.v1.multiprocess.ext_server_module import (
    ExtServerModuleBuildContext,
    server_module_handler,
)

from .metrics import register_metrics
from .runtime import HiStateRuntime, get_runtime

logger = logging.getLogger("lmcache_histate.server_module")

__all__ = ["HiStateServerModule", "build_server_modules"]


class HiStateServerModule:
    """The engine module LMCache composes into its server (status, RPCs, close)."""

    def __init__(self, ctx: Any, runtime: HiStateRuntime | None) -> None:
        self._ctx = ctx
        self.runtime = runtime

    @property
    def context(self) -> Any:
        return self._ctx

    def report_status(self) -> dict:
        if self.runtime is None:
            return {"histate": {"active": False}}
        return {"histate": {"active": True, **self.runtime.status()}}

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()

    @server_module_handler("histate.status")
    def status_rpc(self, payload: bytes) -> bytes:
        return json.dumps(self.report_status()["histate"]).encode()

    @server_module_handler("histate.plan")
    def plan_rpc(self, payload: bytes) -> bytes:
        request = json.loads(payload or b"{}")
        start = int(request.get("start_tokens", 0))
        end = int(request["input_tokens"])
        plan = self.runtime.plan(start, end) if self.runtime is not None else []
        return json.dumps({"boundaries": plan}).encode()


def _guarded(runtime: HiStateRuntime, what: str, fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:
        runtime.stats[f"errors.{what}"] += 1
        logger.exception("HiState %s hook failed (request served without it)", what)


def _wrap(module: Any, name: str, before: Any) -> None:
    original = getattr(module, name)

    @functools.wraps(original)
    def handler(*args: Any, **kwargs: Any) -> Any:
        before(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(module, name, handler)


def build_server_modules(build: ExtServerModuleBuildContext) -> HiStateServerModule:
    """``--server-module`` factory."""
    from lmcache.v1.multiprocess.modules.lmcache_driven_transfer import (
        LMCacheDrivenTransferModule,
    )
    from lmcache.v1.multiprocess.modules.lookup import LookupModule

    ctx = build.server_context
    runtime = get_runtime()
    if runtime is None or runtime.cfg.policy != "histate":
        logger.warning("HiState server module loaded without the HiState launcher: inactive")
        return HiStateServerModule(ctx, None)
    runtime.attach_server(ctx)
    wrapped = []
    for module in build.modules:
        if isinstance(module, LMCacheDrivenTransferModule):
            _wrap(
                module, "store",
                lambda key, *a, **k: _guarded(runtime, "store", runtime.note_store, key),
            )
            wrapped.append("store")
        elif isinstance(module, LookupModule):
            _wrap(
                module, "lookup",
                lambda key, *a, **k: _guarded(runtime, "lookup", runtime.on_lookup, key),
            )
            _wrap(
                module, "end_session",
                lambda rid, *a, **k: _guarded(runtime, "end_session", runtime.on_end_session, rid),
            )
            wrapped += ["lookup", "end_session"]
    if "store" not in wrapped or "lookup" not in wrapped:
        raise RuntimeError(
            "HiState needs LMCache's lmcache_driven transfer and lookup modules "
            f"(found hooks for {wrapped}); run with --supported-transfer-mode lmcache_driven"
        )
    register_metrics(runtime)
    logger.info("HiState server module active: hooks on %s", ", ".join(wrapped))
    return HiStateServerModule(ctx, runtime)
