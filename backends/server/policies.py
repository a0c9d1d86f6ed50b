"""HiState's store policy and L1 eviction policy for ``lmcache server``, and their wiring.

* ``HiStateStorePolicy`` (``--l2-store-policy histate``; LMCache's store-policy registry;
  with a shared tier it also sends it what the runtime's ``shared_route`` picks):
  LMCache calls ``select_store_targets`` with every batch of objects just committed to
  L1. The runtime places them with the core and answers which go to the disk tier now
  (every snapshot whose home is disk — intermediate ones, and a durable copy of each
  session's final one —, and KV the CPU tier could not keep). After a successful write,
  ``select_l1_deletions`` lets go of the L1 copies the core does not keep on the CPU tier
  (intermediate snapshots leave L1 once persisted — the runtime deletes them itself,
  retrying a delete a reader's lock refused; final snapshots stay).
* ``HiStateL1EvictionPolicy``: LMCache's L1 eviction loop (1 s tick, when L1 usage is
  above the watermark) asks it for victims. Objects HiState does not manage (other
  models, auxiliary groups, copies already released) go first, oldest first; then the
  runtime evicts from the core's CPU tier by lowest ``H`` (demoting to disk or dropping,
  exactly as the core decides when it makes room for new objects). It also reports L1
  removals to the runtime, so objects removed behind HiState's back (``/cache/clear``)
  are known to be gone.

LMCache 0.5.6 has no registry for L1 eviction policies: ``install`` returns the factory of
``HiStateL1EvictionPolicy`` bound to the runtime, and the launcher runs ``lmcache server``
inside ``upstream.route_l1_eviction_policy`` with it (L2 adapters configured with LMCache
eviction keep LMCache's policies); it passes ``--eviction-policy LRU`` to satisfy the CLI.

How the runtime gets here: ``install(runtime)`` registers both factories bound to the
launcher's runtime (LMCache calls each with no argument we choose), so each policy holds
the runtime from its construction. The server module, built later from a module path,
finds it as the store policy of its server context (``runtime_of``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, cast

from lmcache.logging import init_logger
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.eviction import EvictionPolicy
from lmcache.v1.distributed.internal_api import EvictionAction, EvictionDestination
from lmcache.v1.distributed.storage_controllers.store_policy import (
    StorePolicy,
    get_registered_store_policies,
    register_store_policy,
)
from lmcache.v1.distributed.storage_controllers.utils import L2AdapterDescriptor

from .runtime.runtime import HiStateRuntime

logger = init_logger(__name__)

__all__ = ["STORE_POLICY_NAME", "HiStateL1EvictionPolicy", "HiStateStorePolicy", "install",
           "runtime_of"]

STORE_POLICY_NAME = "histate"
DISK_ADAPTER_CLASS = "HiStateDiskAdapter"
SHARED_ADAPTER_CLASS = "HiStateSharedAdapter"


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


def install(runtime: HiStateRuntime) -> Callable[[Any], EvictionPolicy | None]:
    """Register the store policy bound to ``runtime`` (before the CLI parser is built: it
    checks ``--l2-store-policy`` against the registry); returns the L1 eviction policy's
    factory bound to it, for ``upstream.route_l1_eviction_policy``.

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

    return l1_policy


def runtime_of(ctx: Any) -> HiStateRuntime | None:
    """The HiState runtime of a server context: its storage manager's store policy's
    (None under a stock ``lmcache server``, whose store policy is another).

    NOTE 1: LMCache 0.5.6 keeps the store controller and its policy private
    (``_store_controller._policy``); no public accessor exists.
    """
    controller = getattr(getattr(ctx, "storage_manager", None), "_store_controller", None)
    policy = getattr(controller, "_policy", None)
    return policy.runtime if isinstance(policy, HiStateStorePolicy) else None
