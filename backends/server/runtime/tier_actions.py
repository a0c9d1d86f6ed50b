"""The L1 / disk action executor: the core's placement events made real.

The core decides placement in terms of node parts and tiers; ``CoreListener`` turns its
``stored`` / ``moved`` / ``dropped`` events into ``Actions`` on LMCache objects (delete
from L1, delete from disk, demote = write an L1 object to disk, then delete it from L1).
Actions are collected under ``self.lock`` and run after it is released (never call into
LMCache's L1 manager or wait on disk I/O under it). The feedback paths live here too:
L1 removals nobody here decided (queued by LMCache's callback, drained under the lock)
and failed or lost disk files are reported to the core as losses.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lmcache_histate.core.index import Node
from lmcache_histate.core.placement import KV, SNAPSHOT

from .object_map import CPU, DISK, TIER_NAMES

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey

logger = logging.getLogger("lmcache_histate.runtime")


@dataclass(slots=True)
class Actions:
    """Effects decided under the lock, run after it is released."""

    l1_delete: list[ObjectKey] = field(default_factory=list)
    disk_delete: list[ObjectKey] = field(default_factory=list)
    demote: list[tuple[int, str, list[ObjectKey]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.l1_delete or self.disk_delete or self.demote)


class CoreListener:
    """Turns the core's placement events into ``Actions`` and counters.

    ``runtime`` is the ``HiStateRuntime``; it is typed by this mixin so that imports only
    go from ``runtime`` to its parts, never back.
    """

    def __init__(self, runtime: TierActionsMixin) -> None:
        self.rt = runtime

    def stored(self, node: Node, part: str, tier: int) -> None:
        rt = self.rt
        rt._touched.add(node.key)
        rt.stats[f"{part}_stored.{TIER_NAMES[tier]}"] += 1
        keys = rt._keys(node.key, part)
        if tier == DISK and keys and not set(keys) <= rt._batch:
            rt._actions.demote.append((node.key, part, keys))

    def moved(self, node: Node, part: str, src: int, dst: int) -> None:
        rt = self.rt
        rt._touched.add(node.key)
        rt.stats[f"{part}_evicted.{TIER_NAMES[src]}"] += 1
        rt.stats[f"{part}_stored.{TIER_NAMES[dst]}"] += 1
        if src == CPU and dst == DISK:
            rt.stats[f"{part}_demoted"] += 1
        keys = rt._keys(node.key, part)
        if not keys:
            return
        if dst == DISK and not set(keys) <= rt._batch:
            rt._actions.demote.append((node.key, part, keys))
        elif dst == CPU:  # the core never promotes; keep the objects consistent anyway
            rt._actions.disk_delete.extend(keys)

    def dropped(self, node: Node, part: str, tiers: int) -> None:
        rt = self.rt
        rt._touched.add(node.key)
        keys = rt._keys(node.key, part)
        for tier in (CPU, DISK):
            if tiers & (1 << tier):
                rt.stats[f"{part}_evicted.{TIER_NAMES[tier]}"] += 1
                if keys:
                    (rt._actions.l1_delete if tier == CPU else rt._actions.disk_delete).extend(
                        keys
                    )


class TierActionsMixin:
    """Collects and runs the L1 / disk actions of ``HiStateRuntime``."""

    def _reconcile(self) -> None:
        """Forget (and delete) the objects of parts the core no longer holds anywhere.

        Usually their deletion is already queued by the core's ``dropped`` events; this
        also catches parts made of several objects (tensor-parallel shards) of which one
        was lost: the others are useless alone. Deleting what is already gone is a no-op.
        """
        touched, self._touched = self._touched, set()
        for nk in touched:
            for part in (KV, SNAPSHOT):
                if not self._tiers(nk, part) and part in self.objects.get(nk, {}):
                    keys = self._unregister_part(nk, part)
                    self._actions.l1_delete.extend(keys)
                    self._actions.disk_delete.extend(keys)

    def _take_actions(self) -> Actions:
        self._reconcile()
        actions, self._actions = self._actions, Actions()
        return actions

    def after_persisted(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        """Objects written to disk by the store controller: those not kept on the CPU tier
        leave L1 now. Deleted here rather than by the store controller, which ignores a
        delete refused because a lookup holds a read lock; here it is retried.

        Returns the keys deleted or queued for deletion.
        """
        out = self._leaving_l1(keys)
        self._l1_delete(out)
        return out

    def _leaving_l1(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        with self.lock:
            return [k for k in keys if not self.is_cpu_tracked(k)]


    # ============================================================ disk events
    def on_disk_written(self, stored: list[ObjectKey], failed: list[ObjectKey]) -> None:
        if not failed:
            return
        with self.lock:
            self._drain_locked()
            self._lose_on_disk(failed, "not_persisted")
            actions = self._take_actions()
            for key in failed:
                where = self.part_of.get(key)
                if where is None or not self._tiers(*where) & (1 << CPU):
                    actions.l1_delete.append(key)
        self._run(actions)

    def on_disk_lost(self, keys: list[ObjectKey]) -> None:
        """Files found corrupted or missing on load (already removed by the adapter)."""
        with self.lock:
            self._drain_locked()
            self._lose_on_disk(keys, "lost.disk")
            actions = self._take_actions()
        self._run(actions)

    def _lose_on_disk(self, keys: list[ObjectKey], counter: str) -> None:
        """Tell the core the disk copies of ``keys``' parts are gone (under the lock).

        Shared by failed writes and lost files, which differ only in the counter.
        """
        for key in keys:
            where = self.part_of.get(key)
            if where is None or self.core is None:
                continue
            if self._tiers(*where) & (1 << DISK):
                self.stats[f"{where[1]}_{counter}"] += 1
                self.core.lose(where[0], where[1], DISK)
                self._touched.add(where[0])

    # ============================================================ L1 events
    def note_l1_removed(self, keys: list[ObjectKey]) -> None:
        """Called by LMCache under its L1 lock: queue only."""
        if keys:
            self._events.append(list(keys))

    def _expect_removals(self, keys: Iterable[ObjectKey]) -> None:
        with self._expected_lock:
            for key in keys:
                self._expected[key] += 1

    def _unexpect(self, keys: Iterable[ObjectKey]) -> None:
        with self._expected_lock:
            for key in keys:
                if self._expected[key] <= 1:
                    self._expected.pop(key, None)
                else:
                    self._expected[key] -= 1

    def _drain_locked(self) -> None:
        """Apply queued L1 removals: the ones nobody here decided are losses."""
        core = self.core
        while self._events:
            keys = self._events.popleft()
            for key in keys:
                with self._expected_lock:
                    if self._expected.get(key):
                        self._expected[key] -= 1
                        if not self._expected[key]:
                            del self._expected[key]
                        continue
                where = self.part_of.get(key)
                if where is None or core is None:
                    continue
                if self._tiers(*where) & (1 << CPU):
                    self.stats[f"{where[1]}_lost.cpu"] += 1
                    core.lose(where[0], where[1], CPU)
                    self._touched.add(where[0])


    # ============================================================ actions
    def _run(self, actions: Actions) -> None:
        if not actions:
            return
        if actions.disk_delete and self.adapter is not None:
            try:
                self.adapter.delete(list(dict.fromkeys(actions.disk_delete)))
            except Exception:
                logger.exception("HiState: disk delete failed")
        for nk, part, keys in actions.demote:
            self._demote(nk, part, keys)
        if actions.l1_delete:
            self._l1_delete(list(dict.fromkeys(actions.l1_delete)))

    def _l1_delete(self, keys: list[ObjectKey]) -> None:
        if self.l1 is None or not keys:
            return
        from lmcache.v1.distributed.error import L1Error

        self._expect_removals(keys)
        try:
            result = self.l1.delete(keys)
        except Exception:
            logger.exception("HiState: L1 delete failed")
            self._unexpect(keys)
            return
        locked = [k for k, err in result.items() if err == L1Error.KEY_IS_LOCKED]
        gone = [k for k, err in result.items() if err != L1Error.SUCCESS]
        self._unexpect(gone)
        if locked:
            with self._retry_lock:
                self._retry_l1.update(locked)

    def _demote(self, nk: int, part: str, keys: list[ObjectKey]) -> None:
        """Write L1 objects to the disk tier, then let them leave L1."""
        from lmcache.v1.distributed.error import L1Error

        adapter, l1 = self.adapter, self.l1
        if adapter is None or l1 is None:
            self.on_disk_written([], keys)
            return
        result = l1.reserve_read(keys)
        found = [k for k in keys if result[k][0] == L1Error.SUCCESS]
        objs = [result[k][1] for k in found]
        missing = [k for k in keys if k not in found]
        if missing:
            if found:
                l1.finish_read(found)
            self.stats[f"{part}_demote_missing"] += 1
            self.on_disk_written([], keys)
            return

        def done(ok: list[ObjectKey], failed: list[ObjectKey]) -> None:
            l1.finish_read(found)
            self._l1_delete(self._leaving_l1(ok))

        adapter.write_objects(found, [o.byte_array for o in objs], done)
