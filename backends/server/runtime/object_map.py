"""Which LMCache objects make up each node of the policy core, and where they live.

A chunk node of the core has two parts: KV = the attention object group(s), snapshot =
the recurrent group(s) (learned from the registered layouts' ``group_kinds``, never from
group ids). Tensor parallelism makes a part several objects (one per shard). This map is
the one place that translates between ``ObjectKey``s and (node key, part); every other
runtime concern asks it. State (``objects``, ``part_of``, ``kinds``, ``model``, ``core``)
lives on ``HiStateRuntime``; callers hold ``self.lock``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache_histate.core.placement import KV, SNAPSHOT

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey

CPU, DISK = 0, 1
TIER_NAMES = ("cpu", "disk")
ATTENTION, RECURRENT = "attention", "recurrent"


class ObjectMapMixin:
    """Node key + part <-> ``ObjectKey`` bookkeeping of ``HiStateRuntime``."""

    def _kind(self, key: ObjectKey) -> str | None:
        kind = self.kinds.get(key.object_group_id)
        return {ATTENTION: KV, RECURRENT: SNAPSHOT}.get(kind or "")

    def _ours(self, key: ObjectKey) -> bool:
        return self.model == (key.model_name, key.kv_rank >> 24 or 1)

    def _keys(self, nk: int, part: str) -> list[ObjectKey]:
        return list(self.objects.get(nk, {}).get(part, ()))

    def _register(self, nk: int, part: str, key: ObjectKey) -> None:
        parts = self.objects.setdefault(nk, {})
        keys = parts.setdefault(part, [])
        if key not in keys:
            keys.append(key)
        self.part_of[key] = (nk, part)

    def _unregister_part(self, nk: int, part: str) -> list[ObjectKey]:
        parts = self.objects.get(nk)
        if not parts:
            return []
        keys = parts.pop(part, [])
        if not parts:
            del self.objects[nk]
        for key in keys:
            self.part_of.pop(key, None)
        return keys

    def _tiers(self, nk: int, part: str) -> int:
        node = self.core.index.get(nk) if self.core is not None else None
        if node is None:
            return 0
        return node.kv_tiers if part == KV else node.snap_tiers

    def is_cpu_tracked(self, key: ObjectKey) -> bool:
        where = self.part_of.get(key)
        return where is not None and bool(self._tiers(*where) & (1 << CPU))
