"""The object map: LMCache's ``ObjectKey``s <-> the core's chunk-node parts, and the chains
that place each chunk in its prefix.

The core knows chunk nodes (int keys) with two parts, KV (the attention object group(s))
and snapshot (the recurrent group(s); ``ModelCore.part`` tells them apart); LMCache knows
objects. ``ObjectMap`` is the one structure between them, and holds three maps:

* ``links``: node key -> ``Link``, where a chunk sits in its prefix (depth, parent), which
  the chunk hash alone does not say. Every request's ordered chunk-hash chain is linked
  (``link_chain``); a STORE also leaves its ``StoreRecord`` on the chunks it stores, so
  objects committed later are traced back to their request (``place``). LRU-bounded to
  ``_LINKS_MAX``: links of nodes the core still holds are kept.
* ``parts``: node key -> part -> its objects (several with tensor parallelism, one per
  shard), and ``part_of``, the inverse: object -> (node key, part).

Where a part lives (its tiers) is the core's answer (``HiStateCache.tiers_of``), never
stored here. The disk header of an object (``object_meta``: kind, depth, parent chunk hash)
is read from the links when a write is decided (``TierActions.header``) and travels down
with the write, so the disk tier's I/O threads never call in here.

Invariants (``check``, O(n)):

1. every registered part is held by the core in at least one tier;
2. ``parts`` and ``part_of`` are inverse maps, and no part is registered with no object;
3. every registered node has its ``Link`` (trimming keeps the links of nodes in the core);
4. a link at depth 0 has no parent, a deeper one has one; a link's ``StoreRecord``, if
   any, names the link's node at the link's depth of the record's chain.

Locking: every method runs under the runtime lock (``HiStateRuntime.lock``); the map has
no lock of its own.

Placing a commit batch (``place``, within the caller's ``TierActions.step``): a batch may
mix several STOREs; each record's objects are placed together (``HiStateCache.attach`` +
``complete``) along the record's chain, from the first stored chunk up to the first one
whose KV neither the batch nor the core holds. Objects the core does not accept leave L1;
the ones the core puts on the disk tier are routed there by the store policy. ``place``
completes the request with the session tracker and leaves its L1 deletes and the routed
writes' headers in the tier actions; the runtime passes both in (the map holds neither).
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmcache_histate.backends.server.disk import file_format as df

from lmcache_histate.core.cache import HiStateCache
from lmcache_histate.core.tiers import KV, SNAPSHOT, ServerTier

from .model_core import ModelCore

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey

    from .sessions import SessionTracker
    from .tier_actions import TierActions

__all__ = ["Link", "ObjectMap", "StoreRecord", "node_key"]

_LINKS_MAX = 1 << 21
_CPU_BIT, _DISK_BIT = 1 << ServerTier.CPU, 1 << ServerTier.DISK
# node key's depth -> part -> the objects of that part committed in this batch
ByDepth = dict[int, dict[str, list["ObjectKey"]]]


def node_key(chunk_hash: bytes, salt: str = "") -> int:
    """The core's int key of a chunk: its rolling prefix hash (salted per cache_salt)."""
    if salt:
        chunk_hash = hashlib.blake2b(salt.encode() + b"\0" + chunk_hash, digest_size=8).digest()
    return int.from_bytes(chunk_hash[:8].ljust(8, b"\0"), "little")


@dataclass(slots=True)
class StoreRecord:
    """One STORE request as the server received it (before its objects are committed)."""

    request_id: str
    chain: tuple[int, ...]  # node keys of chunks [0, end)
    start: int  # first chunk stored by this request
    session_hint: str | None
    request_chunks: int = 0  # whole chunks of the request's tokens: its final state's end


@dataclass(slots=True)
class Link:
    """Where a chunk sits in its prefix: what the chunk hash alone does not say."""

    parent: int | None
    parent_hash: bytes
    depth: int
    chunk_hash: bytes
    salt: str
    record: StoreRecord | None = None


class ObjectMap:
    """``ObjectKey`` <-> (node key, part), and each chunk's ``Link`` (see module doc)."""

    def __init__(self, model: ModelCore, stats: Counter[str]) -> None:
        self.model = model
        self.stats = stats
        self.links: OrderedDict[int, Link] = OrderedDict()
        self.parts: dict[int, dict[str, list[ObjectKey]]] = {}
        self.part_of: dict[ObjectKey, tuple[int, str]] = {}

    # ================================================================ chains
    def link_chain(
        self, hashes: Sequence[bytes], salt: str, record: StoreRecord | None, start: int = 0
    ) -> list[int]:
        """Record a request's chain; returns its node keys. A STORE's ``record`` is left on
        the chunks from ``start`` on (the ones it stores)."""
        chain: list[int] = []
        parent: int | None = None
        parent_hash = b""
        links = self.links
        for depth, h in enumerate(hashes):
            nk = node_key(h, salt)
            link = links.get(nk)
            if link is None:
                link = Link(parent, parent_hash, depth, h, salt)
                links[nk] = link
            else:
                links.move_to_end(nk)
            if record is not None and depth >= start:
                link.record = record
            chain.append(nk)
            parent, parent_hash = nk, h
        self._trim()
        return chain

    def _trim(self) -> None:
        core = self.model.core
        scans = 0
        while len(self.links) > _LINKS_MAX and scans < 1024:
            nk, _link = next(iter(self.links.items()))
            scans += 1
            if core is not None and nk in core:
                self.links.move_to_end(nk)
            else:
                del self.links[nk]

    def link_of(self, key: ObjectKey) -> Link | None:
        return self.links.get(node_key(key.chunk_hash, key.cache_salt))

    def object_meta(self, key: ObjectKey) -> tuple[int, int, bytes]:
        """(kind, depth, parent chunk hash) for the disk header of ``key``."""
        link = self.link_of(key)
        part = self.model.part(key)
        kind = df.KIND_KV if part == KV else df.KIND_SNAPSHOT if part == SNAPSHOT else df.KIND_OTHER
        if link is None:
            return kind, -1, b""
        return kind, link.depth, link.parent_hash

    # ================================================================ objects
    def __len__(self) -> int:
        return len(self.part_of)

    def nodes(self) -> list[int]:
        """The node keys with registered objects."""
        return list(self.parts)

    def keys(self, nk: int, part: str) -> list[ObjectKey]:
        return list(self.parts.get(nk, {}).get(part, ()))

    def has_part(self, nk: int, part: str) -> bool:
        return bool(self.parts.get(nk, {}).get(part))

    def where(self, key: ObjectKey) -> tuple[int, str] | None:
        """``(node key, part)`` of a registered object."""
        return self.part_of.get(key)

    def register(self, nk: int, part: str, key: ObjectKey) -> None:
        keys = self.parts.setdefault(nk, {}).setdefault(part, [])
        if key not in keys:
            keys.append(key)
        self.part_of[key] = (nk, part)

    def unregister_part(self, nk: int, part: str) -> list[ObjectKey]:
        parts = self.parts.get(nk)
        if not parts:
            return []
        keys = parts.pop(part, [])
        if not parts:
            del self.parts[nk]
        for key in keys:
            self.part_of.pop(key, None)
        return keys

    def adopt(self, nk: int, link: Link, part: str, keys: Sequence[ObjectKey]) -> None:
        """A part found again on disk after a restart (``recovery``), the core holding it:
        its chunk's link and its objects."""
        self.links[nk] = link
        for key in keys:
            self.register(nk, part, key)

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

    # ================================================================ commits
    def place(
        self,
        core: HiStateCache,
        keys: Sequence[ObjectKey],
        now: float,
        sessions: SessionTracker,
        actions: TierActions,
    ) -> set[ObjectKey]:
        """Objects just committed to L1 (one or more STOREs): place them with the core and
        map them (within the caller's ``TierActions.step``).

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
            link = self.link_of(key)
            if link is None or link.record is None:
                unknown.append(key)
                continue
            rec = link.record
            entry = records.setdefault(id(rec), (rec, {}))
            entry[1].setdefault(link.depth, {}).setdefault(part, []).append(key)
        rejected: set[ObjectKey] = set(unknown)
        if unknown:
            self.stats["objects_rejected.unknown_chain"] += len(unknown)
        with actions.committing(keys):
            for rec, by_depth in records.values():
                rejected.update(self._place_record(core, rec, by_depth, now, sessions, actions))
        for key in keys:
            if self.key_tiers(key) & _DISK_BIT:
                route.add(key)
        actions.expect_writes(route)
        # Committed objects the core does not hold on the CPU tier and that are not
        # about to be written to disk have no business in L1. (Decided before ``take``
        # reconciles: a part it forgets holds no tier here, so it is deleted either way.)
        l1_delete = actions.pending.l1_delete
        for key in keys:
            if key in route:
                continue
            if self.where(key) is None:
                if key in rejected:
                    l1_delete.append(key)
            elif not self.key_tiers(key) & _CPU_BIT:
                l1_delete.append(key)
        return route

    def _place_record(
        self,
        core: HiStateCache,
        rec: StoreRecord,
        by_depth: ByDepth,
        now: float,
        sessions: SessionTracker,
        actions: TierActions,
    ) -> list[ObjectKey]:
        chain, chunk = rec.chain, self.model.chunk
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
                held = self.tiers(chain[depth], part)
                for k in ks:
                    self.register(chain[depth], part, k)
                if held:
                    # The part is already placed: these objects join it where it lives
                    # (another worker's shard of the chunk; or a fresh L1 copy of an
                    # object demoted to disk, which is routed there — a no-op — and then
                    # leaves L1).
                    self.stats["objects_joined"] += len(ks)
                    continue
                if part == SNAPSHOT:
                    snaps.append(depth)
                actions.touched.add(chain[depth])
        sid = sessions.session_for_store(core, rec, chain[:end])
        sessions.take_lookup_pins(core, rec.request_id)  # what it loaded is in place
        handle = core.attach(sid, chain[:end])
        boundaries = [(d + 1) * chunk for d in sorted(snaps)]
        core.complete(handle, end * chunk, now, boundaries=boundaries)
        sessions.stored(sid, (end - first) * chunk, now)
        for depth, parts in by_depth.items():
            if depth >= end:
                continue
            for part, ks in parts.items():
                if not self.tiers(chain[depth], part) and self.has_part(chain[depth], part):
                    self.unregister_part(chain[depth], part)
                    rejected += ks
                    self.stats[f"{part}_not_placed"] += len(ks)
        return rejected

    # ================================================================ checks
    def check(self) -> None:
        """Assert the invariants of the module docstring (each message names its number)."""
        for nk, parts in self.parts.items():
            assert nk in self.links, f"invariant 3: node {nk:#x} has objects and no link"
            for part, keys in parts.items():
                assert keys, f"invariant 2: {part} of node {nk:#x} registered with no object"
                assert self.tiers(nk, part), f"invariant 1: {part} of node {nk:#x} held nowhere"
                for key in keys:
                    assert self.part_of.get(key) == (nk, part), \
                        f"invariant 2: part_of[{key}] is not ({nk:#x}, {part})"
        held = sum(len(keys) for parts in self.parts.values() for keys in parts.values())
        assert len(self.part_of) == held, "invariant 2: part_of holds an object no part holds"
        for nk, link in self.links.items():
            assert (link.parent is None) == (link.depth == 0), \
                f"invariant 4: node {nk:#x} at depth {link.depth} with parent {link.parent}"
            rec = link.record
            assert rec is None or not rec.chain or rec.chain[link.depth] == nk, \
                f"invariant 4: node {nk:#x}'s STORE record has another node at {link.depth}"
