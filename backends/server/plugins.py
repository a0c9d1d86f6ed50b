"""Every LMCache extension point HiState plugs into, in one place, each bound to the one
``HiStateRuntime`` the launcher builds.

=====================================  ====================================================
extension point (lmcache 0.5.6)        what HiState puts there
=====================================  ====================================================
store-policy registry                  ``HiStateStorePolicy`` (``--l2-store-policy
(``register_store_policy``)            histate``): where committed objects go, which leave L1
L1 eviction policy (no registry:       ``HiStateL1EvictionPolicy``: L1 victims, L1 removals;
``upstream.route_l1_eviction_policy``) its factory bound for the server's run only
L1 manager listener                    ``CommitListener``: commits queued the moment the L1
(``L1ManagerListener``)                write finishes (``runtime`` NOTE 3)
``--server-module`` factory            ``build_server_modules``: the runtime attached to the
(``ext_server_module.py``)             server context, four request handlers observed,
                                       ``GET /status``, metrics, the ``histate.*`` RPCs
FastAPI app state (``app.state``)      the runtime itself, for the server module (NOTE 2)
=====================================  ====================================================

How the runtime gets here: the launcher builds it and calls ``install(runtime, app)``
before LMCache parses its command line (the parser checks ``--l2-store-policy`` against
the registry). ``install`` registers the store policy's factory bound to it (LMCache calls
it with no argument we choose), puts it on the HTTP app's state and returns the L1
eviction policy's factory, which the launcher binds for the run of ``lmcache server``
only; the server module, which LMCache builds later from a module path, takes it from
there (``runtime_of``). Nothing here reads LMCache's private state: the HiState disk tier
is found through ``StorageManager.l2_adapters()`` (lmcache 0.5.6
``v1/distributed/storage_manager.py:1229``).

The store policy (LMCache calls ``select_store_targets`` with every batch of objects just
committed to L1, from its store controller's thread; with a shared tier it also sends it
what the runtime's ``shared_route`` picks): the runtime places them with the core and
answers which go to the disk tier now (every snapshot whose home is disk — intermediate
ones, and a durable copy of each session's final one —, and KV the CPU tier could not
keep). After a successful write, ``select_l1_deletions`` lets go of the L1 copies the core
does not keep on the CPU tier (the runtime deletes them itself, retrying a delete a
reader's lock refused; final snapshots stay).

The L1 eviction policy: LMCache's L1 eviction loop (1 s tick, when L1 usage is above the
watermark) asks it for victims. Objects HiState does not manage (other models, auxiliary
groups, copies already released) go first, oldest first; then the runtime evicts from the
core's CPU tier by lowest ``H`` (demoting to disk or dropping, exactly as the core decides
when it makes room for new objects). It also reports L1 removals to the runtime, so
objects removed behind HiState's back (``/cache/clear``) are known to be gone. The
launcher passes ``--eviction-policy LRU`` to satisfy the CLI; L2 adapters configured with
LMCache eviction keep LMCache's policies.

The server module (loaded by LMCache after its built-in modules exist and before the
request server binds handlers):

* hands the runtime the server context (storage manager, layout registry with each object
  group's kind, token hasher, chunk size) and the ``CommitListener`` to register;
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
  recurrent states HiState's interval controller wants saved; ``PlanRequest``). Every
  argument is checked before the runtime lock is taken (NOTE 1); with ``auth_token_file``
  set both need ``"token"`` in the payload (``access.check_rpc_token``).

NOTE 1: ``histate.plan`` returns one position per snapshot interval of the segment, so its
work is proportional to ``input_tokens``; an unchecked 10^10 held the runtime lock for
3.8 s and answered 116 MB. Arguments are bounded by ``max_model_tokens`` (the longest
prompt the engine accepts), which bounds the plan to ``max_model_tokens / chunk_size``
positions whatever a client sends.

NOTE 2 (the runtime travels on the app's state). LMCache 0.5.6 gives a server-module
factory only its ``ExtServerModuleBuildContext`` (the server context, the parsed configs,
the built-in modules and the spec's JSON ``config``; ``ext_server_module.py:91-109``), and
keeps the store controller and its policy private (``StorageManager._store_controller``,
``StoreController._policy``; ``storage_manager.py:243-259``, ``store_controller.py:244``);
the store-policy registry lists names only (``get_registered_store_policies``,
``store_policy.py:89-91``). What the factory can reach publicly is the FastAPI app the
``lmcache server`` command always runs (``cli/commands/server.py:93-109``): it builds the
server modules inside the app's lifespan (``http_server.py:69-92``) and keeps its own
engine and context on ``app.state`` (``http_server.py:113-118``). So the launcher, which
creates the runtime and already extends that app (``routing_api``), puts the runtime on
its state too (``RUNTIME_STATE``), and ``runtime_of`` reads it back. A stock ``lmcache
server`` has none: the module loads inactive.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.eviction import EvictionPolicy
from lmcache.v1.distributed.internal_api import (
    EvictionAction,
    EvictionDestination,
    L1ManagerListener,
)
from lmcache.v1.distributed.storage_controllers.store_policy import (
    StorePolicy,
    get_registered_store_policies,
    register_store_policy,
)
from lmcache.v1.distributed.storage_controllers.utils import L2AdapterDescriptor
from lmcache.v1.multiprocess.ext_server_module import (
    ExtServerModuleBuildContext,
    server_module_handler,
)

from lmcache_histate.core.interval import check_step_price, check_step_tokens
from lmcache_histate.exposure import read_secret
from lmcache_histate.protocol import PLAN_METHOD, RESUMED_CONFIG, STATUS_METHOD

from .access import RpcRefused, check_rpc_token
from .disk.tier import HiStateDiskAdapter
from .metrics import register_disk_metrics, register_metrics
from .runtime.runtime import HiStateRuntime

logger = logging.getLogger("lmcache_histate.plugins")

__all__ = ["RUNTIME_STATE", "STORE_POLICY_NAME", "CommitListener", "HiStateL1EvictionPolicy",
           "HiStateServerModule", "HiStateStorePolicy", "LoadCounter", "PlanRequest",
           "build_server_modules", "find_disk_tier", "install", "parse_plan_request",
           "runtime_of"]

STORE_POLICY_NAME = "histate"
DISK_ADAPTER_CLASS = "HiStateDiskAdapter"
SHARED_ADAPTER_CLASS = "HiStateSharedAdapter"
RUNTIME_STATE = "histate_runtime"
"""The attribute of LMCache's ``app.state`` that holds the runtime (NOTE 2)."""
MAX_RPC_PAYLOAD = 4096
"""Bytes: an RPC payload is a small JSON object."""


# ====================================================================== store policy
def _is_disk_tier(desc: L2AdapterDescriptor) -> bool:
    return getattr(desc.config, "class_name", None) == DISK_ADAPTER_CLASS


def _is_shared_tier(desc: L2AdapterDescriptor) -> bool:
    return getattr(desc.config, "class_name", None) == SHARED_ADAPTER_CLASS


class HiStateStorePolicy(StorePolicy):
    """Which committed objects go to the disk tier, and which then leave L1."""

    def __init__(self, runtime: HiStateRuntime) -> None:
        self.runtime = runtime

    def select_store_targets(
        self, keys: list[ObjectKey], adapters: list[L2AdapterDescriptor]
    ) -> dict[int, list[ObjectKey]]:
        route = self.runtime.on_committed(keys)
        plan: dict[int, list[ObjectKey]] = {}
        disk = [d.index for d in adapters if _is_disk_tier(d)]
        if route and disk:
            plan[disk[0]] = [k for k in keys if k in route]
        shared = [d.index for d in adapters if _is_shared_tier(d)]
        if shared:  # shared_tier NOTE 3: what another node needs to resume
            to_shared = self.runtime.shared_route(keys, route)
            if to_shared:
                plan[shared[0]] = to_shared
        return plan

    def select_l1_deletions(self, keys: list[ObjectKey]) -> list[ObjectKey]:
        self.runtime.on_persisted(keys)  # deletes itself, retrying keys a reader locked
        return []


# ============================================================== L1 eviction policy
class HiStateL1EvictionPolicy(EvictionPolicy):
    """L1 victims: unmanaged objects first (LRU), then the core's CPU tier by lowest H."""

    def __init__(self, runtime: HiStateRuntime) -> None:
        self.runtime = runtime
        self._lock = threading.Lock()
        self._order: OrderedDict[ObjectKey, None] = OrderedDict()
        self._destinations: list[EvictionDestination] = []

    @property
    def name(self) -> str:
        return "histate_eviction_policy"

    def register_eviction_destination(self, destination: EvictionDestination) -> None:
        with self._lock:
            if destination not in self._destinations:
                self._destinations.append(destination)

    # The four callbacks below run under LMCache's L1 lock: bookkeeping only.
    def on_keys_created(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            for key in keys:
                self._order[key] = None
                self._order.move_to_end(key)

    def on_keys_touched(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            for key in keys:
                if key in self._order:
                    self._order.move_to_end(key)

    def on_keys_removed(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            for key in keys:
                self._order.pop(key, None)
        self.runtime.on_l1_removed(keys)

    def get_eviction_actions(
        self,
        expected_ratio: float,
        key_eligible_filter: Callable[[ObjectKey], bool] | None = None,
        cache_salt: str | None = None,
    ) -> list[EvictionAction]:
        ratio = max(0.0, min(1.0, expected_ratio))
        with self._lock:
            tracked = list(self._order)
        target = max(1, int(len(tracked) * ratio)) if tracked and ratio > 0 else 0
        runtime = self.runtime
        unmanaged = [k for k in runtime.not_cpu_tracked(tracked)
                     if key_eligible_filter is None or key_eligible_filter(k)][:target]
        if len(unmanaged) < target and runtime.core is not None:
            # The rest comes out of the core's CPU tier, by H (demote or drop).
            share = (target - len(unmanaged)) / max(1, target)
            used = runtime.cpu_used_bytes()
            runtime.evict_cpu(int(used * ratio * share) or 1)
        if not unmanaged:
            return []
        destination = self._destinations[0] if self._destinations else EvictionDestination.DISCARD
        return [EvictionAction(keys=unmanaged, destination=destination)]

    def get_num_tracked_keys(self) -> int:
        with self._lock:
            return len(self._order)


# ================================================================ L1 manager listener
class CommitListener(L1ManagerListener):
    """Hears LMCache's L1 manager: the keys of each finished write reach the runtime's
    commit queue (``runtime`` NOTE 3). Every callback runs under LMCache's L1 lock; the
    others are other parts' business (removals reach the runtime through the L1 eviction
    policy)."""

    def __init__(self, runtime: HiStateRuntime) -> None:
        self.runtime = runtime

    def on_l1_keys_write_finished(self, keys: list[ObjectKey]) -> None:
        self.runtime.on_l1_committed(keys)

    def on_l1_keys_reserved_read(self, keys: list[ObjectKey]) -> None:
        return None

    def on_l1_keys_read_finished(self, keys: list[ObjectKey]) -> None:
        return None

    def on_l1_keys_reserved_write(self, keys: list[ObjectKey]) -> None:
        return None

    def on_l1_keys_finish_write_and_reserve_read(self, keys: list[ObjectKey]) -> None:
        return None  # a prefetch from disk: no commit

    def on_l1_keys_deleted_by_manager(self, keys: list[ObjectKey]) -> None:
        return None

    def on_l1_keys_accessed(self, keys: list[ObjectKey]) -> None:
        return None


# ====================================================================== server module
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


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """A checked ``histate.plan`` request (``parse_plan_request``; NOTE 1).

    Invariants: integers with 0 <= ``start_tokens`` <= ``input_tokens`` <=
    ``max_model_tokens``; ``step_tokens`` (the engine's step grid,
    ``HiStateCache.set_step_grid``) None or a positive multiple of the chunk size up to
    ``max_model_tokens``; ``step_price`` (the engine's measured ``σ``, tokens of prefill
    per step end) None or a finite number >= 0.
    """

    start_tokens: int
    input_tokens: int
    step_tokens: int | None = None
    step_price: float | None = None


def parse_plan_request(request: dict[str, Any], max_tokens: int, chunk_tokens: int) -> PlanRequest:
    """The ``PlanRequest`` of a ``histate.plan`` payload, each argument checked against
    ``max_tokens`` (``max_model_tokens``) and ``chunk_tokens``; raises ``RpcRefused`` with
    one line naming the argument and what it must be."""
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
    return PlanRequest(start, end, step, price)


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
        plan = parse_plan_request(
            request, self.runtime.cfg.max_model_tokens, self.runtime.model.chunk
        )
        boundaries = self.runtime.plan(plan.start_tokens, plan.input_tokens, plan.step_tokens,
                                       plan.step_price)
        return json.dumps({"boundaries": boundaries}).encode()


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


def find_disk_tier(ctx: Any) -> HiStateDiskAdapter | None:
    """The HiState disk tier among the server's L2 adapters (``StorageManager.l2_adapters``,
    public in lmcache 0.5.6), or None."""
    adapters = getattr(ctx.storage_manager, "l2_adapters", None)
    pairs = adapters() if callable(adapters) else []
    return next((a for _desc, a in pairs if isinstance(a, HiStateDiskAdapter)), None)


def _wrap(module: Any, name: str, before: Any) -> None:
    original = getattr(module, name)

    @functools.wraps(original)
    def handler(*args: Any, **kwargs: Any) -> Any:
        before(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(module, name, handler)


def build_server_modules(build: ExtServerModuleBuildContext) -> HiStateServerModule:
    """``--server-module`` factory."""
    from lmcache.v1.multiprocess.http_server import app
    from lmcache.v1.multiprocess.modules.lmcache_driven_transfer import (
        LMCacheDrivenTransferModule,
    )
    from lmcache.v1.multiprocess.modules.lookup import LookupModule

    ctx = build.server_context
    runtime = runtime_of(app)
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
    runtime.attach_server(ctx, CommitListener(runtime))
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


# ============================================================================ wiring
def install(runtime: HiStateRuntime, app: Any) -> Callable[[Any], EvictionPolicy | None]:
    """Register the store policy bound to ``runtime`` and put it on ``app``'s state for the
    server module (NOTE 2); return the L1 eviction policy's factory bound to it, which the
    launcher routes for the server's run (``upstream.route_l1_eviction_policy``, a context
    manager). Call before LMCache's CLI parser is built: it checks ``--l2-store-policy``
    against the registry.

    Raises:
        RuntimeError: a store policy ``histate`` is registered already (one runtime per
            process).
    """
    if STORE_POLICY_NAME in get_registered_store_policies():
        raise RuntimeError("a HiState runtime is installed in this process already")
    # LMCache calls the registered class with no argument; a bound factory is one.
    register_store_policy(STORE_POLICY_NAME,
                          cast("type[StorePolicy]", lambda: HiStateStorePolicy(runtime)))

    def l1_policy(_eviction_config: Any) -> EvictionPolicy | None:
        if runtime.cfg.policy != "histate":
            return None  # LMCache's own policy
        logger.info("HiState L1 eviction policy installed (unified H queue)")
        return HiStateL1EvictionPolicy(runtime)

    setattr(app.state, RUNTIME_STATE, runtime)
    return l1_policy


def runtime_of(app: Any) -> HiStateRuntime | None:
    """The HiState runtime the launcher put on ``app``'s state (NOTE 2); None under a
    stock ``lmcache server``."""
    runtime = getattr(getattr(app, "state", None), RUNTIME_STATE, None)
    return runtime if isinstance(runtime, HiStateRuntime) else None
