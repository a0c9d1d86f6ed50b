"""Objects committed to L1: placed by the core along their STORE's chain.

A commit batch may mix several STOREs; each record's objects are placed together
(``HiStateCache.attach`` + ``complete``), the ones the core does not accept leave L1,
and the ones the core puts on the disk tier are routed there by the store policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmcache_histate.core.cache import HiStateCache
from lmcache_histate.core.placement import KV, SNAPSHOT

from .chains import StoreRecord, node_key
from .object_map import CPU, DISK

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey


class CommitsMixin:
    """``on_committed`` of ``HiStateRuntime``."""

    def on_committed(self, keys: Sequence[ObjectKey]) -> set[ObjectKey]:
        """Objects just committed to L1 (one or more STOREs): place them.

        Returns the keys to write to the disk tier now. Objects the core did not accept
        (a gap before them, no room) are deleted
        from L1; objects of other models or of auxiliary groups are left alone.
        """
        if not keys or self.ctx is None:
            return set()
        now = self.clock()
        route: set[ObjectKey] = set()
        with self.lock:
            self._drain_locked()
            core = self._ensure_core(keys[0].model_name, keys[0].kv_rank >> 24 or 1)
            if core is None:
                return route
            records: dict[int, tuple[StoreRecord, dict[int, dict[str, list[ObjectKey]]]]] = {}
            unknown: list[ObjectKey] = []
            for key in keys:
                part = self._kind(key)
                if part is None or not self._ours(key):
                    continue
                link = self.links.get(node_key(key.chunk_hash, key.cache_salt))
                if link is None or link.record is None:
                    unknown.append(key)
                    continue
                rec = link.record
                entry = records.setdefault(id(rec), (rec, {}))
                entry[1].setdefault(link.depth, {}).setdefault(part, []).append(key)
            rejected: set[ObjectKey] = set(unknown)
            if unknown:
                self.stats["objects_rejected.unknown_chain"] += len(unknown)
            self._batch = set(keys)
            try:
                for rec, by_depth in records.values():
                    rejected.update(self._commit_record(core, rec, by_depth, now))
            finally:
                self._batch = set()
            for key in keys:
                where = self.part_of.get(key)
                if where is None:
                    continue
                tiers = self._tiers(*where)
                if tiers & (1 << DISK):
                    route.add(key)
            actions = self._take_actions()
            # Committed objects the core does not hold on the CPU tier and that are not
            # about to be written to disk have no business in L1.
            for key in keys:
                where = self.part_of.get(key)
                if key in route:
                    continue
                if where is None:
                    if key in rejected:
                        actions.l1_delete.append(key)
                elif not self._tiers(*where) & (1 << CPU):
                    actions.l1_delete.append(key)
        self._run(actions)
        return route

    def _commit_record(
        self,
        core: HiStateCache,
        rec: StoreRecord,
        by_depth: dict[int, dict[str, list[ObjectKey]]],
        now: float,
    ) -> list[ObjectKey]:
        chain = rec.chain
        first = min(by_depth)
        every = [k for parts in by_depth.values() for ks in parts.values() for k in ks]
        walk = core.index.walk(chain[:first])
        if len(walk) < first or not all(n.kv_tiers for n in walk):
            self.stats["objects_rejected.gap"] += len(every)
            return every
        end = first
        while end < len(chain):
            node = core.index.get(chain[end])
            if KV in by_depth.get(end, {}) or (node is not None and node.kv_tiers):
                end += 1
            else:
                break
        rejected: list[ObjectKey] = []
        snaps: list[int] = []
        for depth, parts in sorted(by_depth.items()):
            node = core.index.get(chain[depth])
            if depth >= end:
                rejected += [k for ks in parts.values() for k in ks]
                self.stats["objects_rejected.gap"] += sum(len(ks) for ks in parts.values())
                continue
            for part, ks in parts.items():
                held = self._tiers(chain[depth], part)
                for k in ks:
                    self._register(chain[depth], part, k)
                if held:
                    # The part is already placed: these objects join it where it lives
                    # (another worker's shard of the chunk; or a fresh L1 copy of an
                    # object demoted to disk, which is routed there — a no-op — and then
                    # leaves L1).
                    self.stats["objects_joined"] += len(ks)
                    continue
                if part == SNAPSHOT:
                    snaps.append(depth)
                self._touched.add(chain[depth])
        sid = self._session_for_store(rec, chain[:end])
        state = self.requests.get(rec.request_id)
        if state is not None and state.handle is not None:
            core.release(state.handle)  # the lookup's pins: what it loaded is in place now
            state.handle = None
        handle = core.attach(sid, chain[:end])
        boundaries = [(d + 1) * self.chunk for d in sorted(snaps)]
        core.complete(handle, end * self.chunk, now, boundaries=boundaries)
        self.session_seen[sid] = now
        self.last_segment_tokens = max(self.chunk, (end - first) * self.chunk)
        for depth, parts in by_depth.items():
            if depth >= end:
                continue
            for part, ks in parts.items():
                if not self._tiers(chain[depth], part) and self.objects.get(chain[depth], {}).get(
                    part
                ):
                    self._unregister_part(chain[depth], part)
                    rejected += ks
                    self.stats[f"{part}_not_placed"] += len(ks)
        return rejected
