"""Which LMCache objects make up each node part of the policy core.

A chunk node of the core has two parts: KV (the attention object group(s)) and snapshot
(the recurrent group(s); ``ModelCore.part`` tells them apart). Tensor parallelism makes a
part several objects, one per shard. ``ObjectCatalogue`` is the one place that translates
between ``ObjectKey``s and ``(node key, part)``; where a part lives (its tiers) is the
core's answer (``HiStateCache.tiers_of``), never stored here. Callers hold the runtime lock.

Invariants (``check``): every registered part is held by the core in at least one tier;
``objects`` and ``part_of`` are inverse maps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache_histate.core.defaults import ServerTier

from .model_core import ModelCore

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey

__all__ = ["ObjectCatalogue"]

_CPU_BIT = 1 << ServerTier.CPU


class ObjectCatalogue:
    """Node key + part <-> ``ObjectKey`` bookkeeping."""

    def __init__(self, model: ModelCore) -> None:
        self.model = model
        self.objects: dict[int, dict[str, list[ObjectKey]]] = {}
        self.part_of: dict[ObjectKey, tuple[int, str]] = {}

    def __len__(self) -> int:
        return len(self.part_of)

    def keys(self, nk: int, part: str) -> list[ObjectKey]:
        return list(self.objects.get(nk, {}).get(part, ()))

    def has_part(self, nk: int, part: str) -> bool:
        return bool(self.objects.get(nk, {}).get(part))

    def where(self, key: ObjectKey) -> tuple[int, str] | None:
        """``(node key, part)`` of a registered object."""
        return self.part_of.get(key)

    def register(self, nk: int, part: str, key: ObjectKey) -> None:
        parts = self.objects.setdefault(nk, {})
        keys = parts.setdefault(part, [])
        if key not in keys:
            keys.append(key)
        self.part_of[key] = (nk, part)

    def unregister_part(self, nk: int, part: str) -> list[ObjectKey]:
        parts = self.objects.get(nk)
        if not parts:
            return []
        keys = parts.pop(part, [])
        if not parts:
            del self.objects[nk]
        for key in keys:
            self.part_of.pop(key, None)
        return keys

    def tiers(self, nk: int, part: str) -> int:
        """Bitmask of the tiers the core holds this part in (0: nowhere, or no core)."""
        core = self.model.core
        return core.tiers_of(nk, part) if core is not None else 0

    def key_tiers(self, key: ObjectKey) -> int:
        """``tiers`` of the part ``key`` belongs to (0 for an unregistered object)."""
        where = self.part_of.get(key)
        return self.tiers(*where) if where is not None else 0

    def is_cpu_tracked(self, key: ObjectKey) -> bool:
        return bool(self.key_tiers(key) & _CPU_BIT)

    def check(self) -> None:
        for nk, parts in self.objects.items():
            for part, keys in parts.items():
                assert self.tiers(nk, part), (nk, part, keys)
                for key in keys:
                    assert self.part_of.get(key) == (nk, part)
