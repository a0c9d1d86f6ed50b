"""HiState server module for ``lmcache server`` (``--server-module``).

Loaded by LMCache after its built-in modules exist and before the request server binds
handlers (``v1/multiprocess/ext_server_module.py``). It:

* finds the HiState runtime as the store policy of the server context's storage manager
  (``policies.runtime_of``: the launcher bound it there) and hands it the context (storage
  manager, layout registry with each object group's kind, token hasher, chunk size);
* observes the requests the policy core must see, by wrapping four handlers of the
  built-in module *instances* it is given (``ExtServerModuleBuildContext.modules``): the
  wrapper calls the runtime, then the original handler, with the same signature, so the
  request server validates and binds it like the original —
  ``LMCacheDrivenTransferModule.store`` (the STORE's ordered chunk-hash chain, recorded
  before its objects are committed), ``LMCacheDrivenTransferModule.retrieve`` (the tokens
  vLLM loads: :class:`LoadCounter`), ``LookupModule.lookup`` (refresh-all, pins, hit
  counters) and ``LookupModule.end_session`` (unpin). A failure inside HiState is logged
  and counted, never propagated into the request;
* reports the runtime's state in ``GET /status`` (key ``histate``) and as Prometheus
  metrics on ``GET /metrics`` (``histate_*``; the disk tier's write-behind lag for every
  policy, ``metrics.register_disk_metrics``);
* answers two extension RPCs (``server_module_call``), also on a ``policy: lru`` server
  (loaded inactive there, so a caller gets ``{"active": false}`` and a plan error at once
  instead of waiting out its timeout): ``histate.status`` (JSON) and
  ``histate.plan`` (JSON ``{"start_tokens": s, "input_tokens": n}``, optionally with the
  engine's ``step_tokens`` and measured ``step_price`` → the token positions whose
  recurrent states HiState's interval controller wants saved). Every
  argument is checked before the runtime lock is taken (NOTE 1); with ``auth_token_file``
  set both need ``"token"`` in the payload (``access.check_rpc_token``).

NOTE 1: ``histate.plan`` returns one position per snapshot interval of the segment, so its
work is proportional to ``input_tokens``; an unchecked 10^10 held the runtime lock for
3.8 s and answered 116 MB. Arguments are bounded by ``max_model_tokens`` (the longest
prompt the engine accepts), which bounds the plan to ``max_model_tokens / chunk_size``
positions whatever a client sends.
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

from lmcache_histate.core.interval import check_step_price, check_step_tokens
from lmcache_histate.exposure import read_secret
from lmcache_histate.protocol import PLAN_METHOD, RESUMED_CONFIG, STATUS_METHOD

from .access import RpcRefused, check_rpc_token
from .metrics import register_disk_metrics, register_metrics
from .policies import runtime_of
from .runtime.runtime import HiStateRuntime

logger = logging.getLogger("lmcache_histate.server_module")

__all__ = ["HiStateServerModule", "build_server_modules", "parse_plan_request"]

MAX_RPC_PAYLOAD = 4096
"""Bytes: an RPC payload is a small JSON object."""


def _request(payload: bytes, method: str) -> dict[str, Any]:
    if len(payload) > MAX_RPC_PAYLOAD:
        raise RpcRefused(f"{method}: payload of {len(payload)} bytes (at most {MAX_RPC_PAYLOAD})")
    try:
        request = json.loads(payload or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise RpcRefused(f"{method}: payload is not JSON ({exc})") from None
    if not isinstance(request, dict):
        raise RpcRefused(f"{method}: payload must be a JSON object, got {type(request).__name__}")
    return request


def parse_plan_request(
    request: dict[str, Any], max_tokens: int, chunk_tokens: int
) -> tuple[int, int, int | None, float | None]:
    """``(start_tokens, input_tokens, step_tokens, step_price)`` of a ``histate.plan``
    request, each checked: integers with 0 <= start_tokens <= input_tokens <=
    ``max_tokens``; the optional ``step_tokens`` (the engine's step grid,
    ``HiStateCache.set_step_grid``; None when absent) a positive multiple of
    ``chunk_tokens`` up to ``max_tokens``; the optional ``step_price`` (the engine's
    measured ``σ``, tokens of prefill per step end; None when absent) a finite number
    ≥ 0."""
    if "input_tokens" not in request:
        raise RpcRefused("histate.plan: input_tokens is missing")
    values = []
    for name, default in (("start_tokens", 0), ("input_tokens", None)):
        value = request.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= max_tokens:
            raise RpcRefused(
                f"histate.plan: {name} must be an integer in [0, {max_tokens}] "
                f"(max_model_tokens), got {value!r}"[:300]
            )
        values.append(value)
    start, end = values
    if start > end:
        raise RpcRefused(f"histate.plan: start_tokens {start} is after input_tokens {end}")
    step = request.get("step_tokens")
    try:
        valid = check_step_tokens(step, chunk_tokens) is None or step <= max_tokens
    except ValueError:
        valid = False
    if not valid:
        raise RpcRefused(
            f"histate.plan: step_tokens must be a positive multiple of the chunk size "
            f"{chunk_tokens} up to {max_tokens}, got {step!r}"[:300]
        )
    price = request.get("step_price")
    try:
        price = None if price is None else check_step_price(price)
    except ValueError:
        raise RpcRefused(
            f"histate.plan: step_price must be a finite number >= 0 (tokens of prefill per "
            f"step end), got {price!r}"[:300]
        ) from None
    return start, end, step, price


class HiStateServerModule:
    """The engine module LMCache composes into its server (status, RPCs, close)."""

    def __init__(
        self, ctx: Any, runtime: HiStateRuntime | None, secret: str | None = None
    ) -> None:
        self._ctx = ctx
        self.runtime = runtime
        self.secret = secret

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

    def _checked(self, payload: bytes, method: str) -> dict[str, Any]:
        request = _request(payload, method)
        check_rpc_token(request, self.secret)
        return request

    @server_module_handler(STATUS_METHOD)
    def status_rpc(self, payload: bytes) -> bytes:
        self._checked(payload, STATUS_METHOD)
        return json.dumps(self.report_status()["histate"]).encode()

    @server_module_handler(PLAN_METHOD)
    def plan_rpc(self, payload: bytes) -> bytes:
        request = self._checked(payload, PLAN_METHOD)
        if self.runtime is None:
            raise RpcRefused(
                f"{PLAN_METHOD}: this server runs without HiState (policy lru): no plan; "
                "save states as stock LMCache does"
            )
        start, end, step, price = parse_plan_request(
            request, self.runtime.cfg.max_model_tokens, self.runtime.model.chunk
        )
        return json.dumps({"boundaries": self.runtime.plan(start, end, step, price)}).encode()


def _guarded(runtime: HiStateRuntime, what: str, fn: Any, *args: Any) -> None:
    key = args[0]
    tokens = getattr(key, "token_ids", ())
    if len(tokens) > runtime.cfg.max_model_tokens:
        # NOTE 1 again: the chain work under the runtime lock is per chunk of the request;
        # a request longer than any prompt the engine accepts is served without HiState.
        runtime.stats[f"over_max_model_tokens.{what}"] += 1
        return
    try:
        fn(*args)
    except Exception:
        runtime.stats[f"errors.{what}"] += 1
        logger.exception("HiState %s hook failed (request served without it)", what)


class LoadCounter:
    """Tokens vLLM loads from this server, split as vLLM's own counters split them.

    vLLM counts a request's external hits when it is scheduled for the first time; the hits
    of a request re-admitted after a preemption go to ``preempted_hits``, which its
    Prometheus logger does not export (vllm 0.32.0 ``v1/metrics/stats.py:
    PrefixCacheStats.record``; ``v1/core/sched/scheduler.py`` passes ``preempted =
    request.num_preemptions > 0``). Such a request may load more than once, or for the first
    time (a prompt stored while it ran, then preempted). The connector marks it
    (``protocol.RESUMED_CONFIG`` in the key's request configs), so a RETRIEVE adds to
    ``loaded_tokens`` (comparable with ``vllm:external_prefix_cache_hits_total``) or, for a
    marked request, to ``loaded_tokens_resumed``. The tokens are the retrieve range less
    ``skip_first_n_tokens`` (the blocks vLLM's own prefix cache already holds).

    Invariant: only worker 0's retrieves count (tensor-parallel ranks each send one).
    """

    def __init__(self, stats: Any) -> None:
        self._stats = stats

    def __call__(self, key: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(key, "worker_id", 0) not in (0, None):
            return
        try:
            skip = kwargs.get("skip_first_n_tokens", args[3] if len(args) > 3 else 0)
            tokens = max(0, int(key.end) - int(key.start) - int(skip or 0))
        except (AttributeError, TypeError, ValueError):  # a key LMCache will refuse itself
            self._stats["errors.retrieve"] += 1
            return
        configs = getattr(key, "request_configs", None) or {}
        resumed = isinstance(configs, dict) and bool(configs.get(RESUMED_CONFIG))
        self._stats["loaded_tokens_resumed" if resumed else "loaded_tokens"] += tokens


def find_disk_tier(ctx: Any) -> Any:
    """The HiState disk tier among the server's L2 adapters (``runtime`` NOTE 2), or None."""
    from .disk.tier import HiStateDiskAdapter

    adapters = dict(getattr(ctx.storage_manager, "_l2_adapters", None) or {}).values()
    return next((a for a in adapters if isinstance(a, HiStateDiskAdapter)), None)


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
    runtime = runtime_of(ctx)
    disk = find_disk_tier(ctx)
    if disk is not None:
        register_disk_metrics(disk)
    if runtime is None or runtime.cfg.policy != "histate":
        if (build.config or {}).get("policy") == "lru":
            logger.info("HiState server module: policy lru, HiState off; %s answers "
                        "active=false, %s an error", STATUS_METHOD, PLAN_METHOD)
        else:
            logger.warning("HiState server module loaded without the HiState launcher: "
                           "inactive")
        return HiStateServerModule(ctx, None)
    runtime.attach_server(ctx)
    runtime.start_janitor()
    wrapped = []
    for module in build.modules:
        if isinstance(module, LMCacheDrivenTransferModule):
            _wrap(
                module, "store",
                lambda key, *a, **k: _guarded(runtime, "store", runtime.on_store, key),
            )
            _wrap(module, "retrieve", LoadCounter(runtime.stats))
            wrapped += ["store", "retrieve"]
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
    token_file = runtime.cfg.auth_token_file
    secret = read_secret(token_file) if token_file else None
    logger.info("HiState server module active: hooks on %s; RPCs %s", ", ".join(wrapped),
                "need the shared secret" if secret else "open (loopback server, no secret)")
    return HiStateServerModule(ctx, runtime, secret)
