"""Objects committed to L1: placed by the core along their STORE's chain.

A commit batch may mix several STOREs; each record's objects are placed together
(``HiStateCache.attach`` + ``complete``), the ones the core does not accept leave L1, and
the ones the core puts on the disk tier are routed there by the store policy. The placer
owns no state: it reads the chains (``ChunkChains``), registers objects in the catalogue,
completes the request with the session tracker, and leaves its L1 deletes and the headers
of the routed writes in the tier actions. Callers run it inside ``TierActions.step`` (the
runtime lock held; the actions run once it is released).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmcache_histate.core.cache import HiStateCache
from lmcache_histate.core.defaults import ServerTier
from lmcache_histate.core.placement import KV, SNAPSHOT

from .catalogue import ObjectCatalogue
from .chains import ChunkChains, StoreRecord
from .model_core import ModelCore
from .sessions import SessionTracker
from .tier_actions import TierActions

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey

__all__ = ["CommitPlacer"]

_CPU_BIT, _DISK_BIT = 1 << ServerTier.CPU, 1 << ServerTier.DISK
# node key's depth -> part -> the objects of that part committed in this batch
ByDepth = dict[int, dict[str, list["ObjectKey"]]]


class CommitPlacer:
    """Places each batch of committed objects with the core."""

    def __init__(
        self,
        model: ModelCore,
        chains: ChunkChains,
        catalogue: ObjectCatalogue,
        sessions: SessionTracker,
        actions: TierActions,
        stats: Counter[str],
    ) -> None:
        self.model = model
        self.chains = chains
        self.catalogue = catalogue
        self.sessions = sessions
        self.actions = actions
        self.stats = stats

    def place(
        self, core: HiStateCache, keys: Sequence[ObjectKey], now: float
    ) -> set[ObjectKey]:
        """Objects just committed to L1 (one or more STOREs): place them (within the
        caller's ``TierActions.step``).

        Returns the keys to write to the disk tier now (their headers are expected by the
        pending actions). Objects the core did not accept (a gap before them, no room) are
        deleted from L1; objects of other models or of auxiliary groups are left alone.
        """
        route: set[ObjectKey] = set()
        records: dict[int, tuple[StoreRecord, ByDepth]] = {}
        unknown: list[ObjectKey] = []
        for key in keys:
            part = self.model.part(key)
            if part is None or not self.model.ours(key):
                continue
            link = self.chains.link_of(key)
            if link is None or link.record is None:
                unknown.append(key)
                continue
            rec = link.record
            entry = records.setdefault(id(rec), (rec, {}))
            entry[1].setdefault(link.depth, {}).setdefault(part, []).append(key)
        rejected: set[ObjectKey] = set(unknown)
        if unknown:
            self.stats["objects_rejected.unknown_chain"] += len(unknown)
        with self.actions.committing(keys):
            for rec, by_depth in records.values():
                rejected.update(self._place_record(core, rec, by_depth, now))
        catalogue = self.catalogue
        for key in keys:
            if catalogue.key_tiers(key) & _DISK_BIT:
                route.add(key)
        self.actions.expect_writes(route)
        # Committed objects the core does not hold on the CPU tier and that are not
        # about to be written to disk have no business in L1. (Decided before ``take``
        # reconciles: a part it forgets holds no tier here, so it is deleted either way.)
        l1_delete = self.actions.pending.l1_delete
        for key in keys:
            if key in route:
                continue
            if catalogue.where(key) is None:
                if key in rejected:
                    l1_delete.append(key)
            elif not catalogue.key_tiers(key) & _CPU_BIT:
                l1_delete.append(key)
        return route

    def _place_record(
        self, core: HiStateCache, rec: StoreRecord, by_depth: ByDepth, now: float
    ) -> list[ObjectKey]:
        chain, chunk, catalogue = rec.chain, self.model.chunk, self.catalogue
        first = min(by_depth)
        every = [k for parts in by_depth.values() for ks in parts.values() for k in ks]
        if not core.holds_kv_prefix(chain[:first]):
            self.stats["objects_rejected.gap"] += len(every)
            return every
        end = first
        while end < len(chain):
            if KV in by_depth.get(end, {}) or core.tiers_of(chain[end], KV):
                end += 1
            else:
                break
        rejected: list[ObjectKey] = []
        snaps: list[int] = []
        for depth, parts in sorted(by_depth.items()):
            if depth >= end:
                rejected += [k for ks in parts.values() for k in ks]
                self.stats["objects_rejected.gap"] += sum(len(ks) for ks in parts.values())
                continue
            for part, ks in parts.items():
                held = catalogue.tiers(chain[depth], part)
                for k in ks:
                    catalogue.register(chain[depth], part, k)
                if held:
                    # The part is already placed: these objects join it where it lives
                    # (another worker's shard of the chunk; or a fresh L1 copy of an
                    # object demoted to disk, which is routed there — a no-op — and then
                    # leaves L1).
                    self.stats["objects_joined"] += len(ks)
                    continue
                if part == SNAPSHOT:
                    snaps.append(depth)
                self.actions.touched.add(chain[depth])
        sid = self.sessions.session_for_store(core, rec, chain[:end])
        self.sessions.take_lookup_pins(core, rec.request_id)  # what it loaded is in place
        handle = core.attach(sid, chain[:end])
        boundaries = [(d + 1) * chunk for d in sorted(snaps)]
        core.complete(handle, end * chunk, now, boundaries=boundaries)
        self.sessions.stored(sid, (end - first) * chunk, now)
        for depth, parts in by_depth.items():
            if depth >= end:
                continue
            for part, ks in parts.items():
                if not catalogue.tiers(chain[depth], part) and catalogue.has_part(
                    chain[depth], part
                ):
                    catalogue.unregister_part(chain[depth], part)
                    rejected += ks
                    self.stats[f"{part}_not_placed"] += len(ks)
        return rejected
