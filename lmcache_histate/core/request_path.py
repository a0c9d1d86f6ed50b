"""A request's life in the cache: ``begin`` → (``promote``) → ``complete`` / ``release``.

The algorithm behind ``HiStateCache``'s request verbs (the facade delegates to a
``RequestPath`` it owns; both share one index, eviction queue, tiered store and interval
controller):

1. ``begin(session, keys, now)`` matches the prompt against the index, samples the
   hit-position model (did the access continue the session from its end? if not, where
   in its segment did it leave the context: ``hit_positions``) and the
   session's re-access gap (for the score's ``τ``), refreshes the hit prefix
   (refresh-all), and pins the KV prefix the engine is about to load.
2. ``promote(handle, tier, now)`` (simulator only) moves what the request loaded up to a
   faster tier, prefix first, while the pins keep it from being evicted.
3. ``complete(handle, input_tokens, now)`` refreshes the hit prefix again (NOTE 1),
   unpins, stores the KV of every chunk not cached (again), moves the session's end to
   the new tail, stores the snapshots of the segment's plan (``snapshot_plan``: the
   interval controller's boundaries, or a fixed interval; placed by the measured hit
   positions of the request's content kind), final one first, re-ranks the new chain
   once, and retires the session's previous final snapshot to the snapshot tier.
4. ``release(handle)`` unpins without storing, pruning nodes that lost their content
   while pinned.

Invariants kept: pins taken by ``begin`` are released exactly once (``complete`` calls
``release``); KV is stored prefix-first, so a chain that stops storing stops at a prefix;
the session's end is moved before the new snapshots are ranked (their cost depends on the
sessions through them). Deterministic given the call sequence and the ``now`` values.

NOTE 1 (recency counts from release). A request holds what it hit from ``begin`` to
``complete`` (pinned: nothing of it can be evicted meanwhile), so the time it last
*used* its prefix is its completion, which is where the engines put it too: vLLM frees a
finished request's blocks to the tail of its free queue (``v1/core/block_pool.py``
``free_blocks``), and the LRU rows here re-queue a prompt when it is admitted
(``sim/baselines/tiered_lru.py``). Refreshed only at ``begin``, a prefix that waited
behind a long prefill (minutes, for a 500K-token prompt under load) came out of it as
the oldest thing in the cache: on the whole Weka folder at 1/8 of the paper's CPU+disk a
session's hit prefix, snapshots first, left within seconds of the request finishing,
and with them the whole context (``benchmarks/sim_eviction.md``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from .cache_types import CacheConfig, RequestHandle
from .eviction import EvictionQueue
from .hit_positions import HitPositions
from .index import Node, PrefixIndex, Session
from .interval import IntervalController
from .placement import TieredStore
from .score import ReaccessScale
from .tiers import KV, SNAPSHOT
from .units import HitModel

__all__ = ["RequestPath"]


@dataclass(slots=True)
class RequestPath:
    """The request verbs over the parts ``HiStateCache`` wires together (shared, not owned)."""

    config: CacheConfig
    index: PrefixIndex
    queue: EvictionQueue
    store: TieredStore
    interval: IntervalController
    hit_model: HitModel
    reaccess: ReaccessScale
    positions: HitPositions | None  # None: hit positions uniform (the paper's model)

    def snapshot_plan(
        self,
        start_tokens: int,
        input_tokens: int,
        kind: Hashable = None,
        segment_start: int | None = None,
    ) -> list[int]:
        """Token positions at which to save states for a span ``[start, input)`` whose
        new input (content ``kind``) starts at ``segment_start``."""
        fixed = self.config.fixed_interval
        if fixed is None:
            return self.interval.boundaries(
                start_tokens,
                input_tokens,
                positions=self.positions,
                kind=kind,
                segment_start=segment_start,
            )
        chunk = self.config.chunk_tokens
        end = input_tokens - input_tokens % chunk
        start = start_tokens - start_tokens % chunk
        if end <= start:
            return []
        points = list(range(start + fixed, end, fixed)) if fixed else []
        return [*points, end]

    def begin(
        self, session_id: str, keys: Sequence[int], now: float, kind: Hashable = None
    ) -> RequestHandle:
        keys = tuple(keys)
        path = self.index.walk(keys)
        match = self.index.match_path(path)
        session = self.index.sessions.get(session_id)
        at_end: bool | None = None
        segment_start = 0
        if session is not None:
            end = session.node
            at_end = end.depth < 0 or (end.depth < len(path) and path[end.depth] is end)
            self.hit_model.observe(at_end)
            if not at_end and self.positions is not None:
                self._observe_divergence(session, end, path, self.positions)
            segment_start = session.segments.end
            last, session.last_access = session.last_access, now
            if last is not None:
                # After the update: this session is no longer idle (``score`` NOTE 4).
                self.reaccess.observe_at(now - last, now)
        self.queue.touch(path, match.hit_chunks, now)
        pinned = path[: match.kv_chunks]
        for node in pinned:
            node.pins += 1
        return RequestHandle(session_id, keys, match, pinned, at_end, now, kind, segment_start)

    def _observe_divergence(
        self, session: Session, end: Node, path: Sequence[Node], positions: HitPositions
    ) -> None:
        """An internal access: record where it left the session's context, relative to
        the segment it falls in (``hit_positions``), and forget the context after it.

        The divergence is the deepest common node of the prompt's path and the session's
        chain (found walking up from the session's end: O(depth), like ``walk``).
        """
        node: Node | None = end
        while node is not None and node.depth >= 0 and (
            node.depth >= len(path) or path[node.depth] is not node
        ):
            node = node.parent
        common = (node.depth + 1 if node is not None else 0) * self.config.chunk_tokens
        where = session.segments.locate(common)
        if where is not None:
            positions.observe(*where)
        session.segments.cut(common)

    def complete(
        self,
        handle: RequestHandle,
        input_tokens: int,
        now: float,
        boundaries: Sequence[int] | None = None,
    ) -> tuple[int, int]:
        """Store what the request computed; returns ``(kv chunks, snapshots)`` stored.

        The engine has finished loading by now, so the request's pins are released first:
        what it read may be moved or evicted to make room for what it computed.
        """
        chunk = self.config.chunk_tokens
        # The hit counts as read when the engine releases it (NOTE 1); a handle that
        # pinned nothing (``attach``) refreshes nothing.
        self.queue.touch(
            handle.pinned, min(handle.match.hit_chunks, len(handle.pinned)), now, sample=False
        )
        self.release(handle)
        nodes = self.index.insert_chain(handle.keys[: input_tokens // chunk])
        # Other requests may have evicted part of the matched prefix since ``begin``: the
        # engine computed (or loaded) those chunks anyway, so they are stored again.
        start = 0
        while start < len(nodes) and nodes[start].kv_tiers:
            start += 1
        stored_kv = start
        for node in nodes[start:]:
            if not self.store.store_kv(node, self.config.kv_chunk_bytes, now, rerank=False):
                break
            stored_kv += 1
        if stored_kv < len(nodes):
            self.index.prune(nodes[-1])
        # The session moves before the new snapshots are ranked: their cost depends on
        # the hit density of the sessions through them (``index`` ``weight``), which
        # moving the session changes along its whole path.
        old_end = self._move_session(handle, nodes, stored_kv, input_tokens)
        self.index.sessions[handle.session_id].segments.append(input_tokens, handle.kind)
        # A chain may stop short of ``input_tokens`` (a trace that hashes fewer chunks):
        # the plan must end on the chain, or its final snapshot would have no node.
        plan = (
            list(boundaries)
            if boundaries is not None
            else self.snapshot_plan(
                handle.match.kv_chunks * chunk,
                min(input_tokens, len(nodes) * chunk),
                handle.kind,
                handle.segment_start,
            )
        )
        snaps = 0
        if stored_kv:
            # The new tail is pinned while its snapshots are placed, so that placing one
            # cannot evict the KV it belongs to; the final one goes first: it is always
            # kept, the intermediate ones compete for what room is left.
            leaf = nodes[stored_kv - 1]
            leaf.pins += 1
            try:
                segments = self.index.sessions[handle.session_id].segments
                for pos in reversed(plan):
                    i = pos // chunk - 1
                    if 0 <= i < stored_kv and not nodes[i].snap_tiers:
                        nodes[i].seg_offset = segments.boundary(pos)
                        snaps += self.store.store_snapshot(
                            nodes[i], self.config.snapshot_bytes, now, final=pos == plan[-1]
                        )
            finally:
                leaf.pins -= 1
        if stored_kv > start:
            # One re-ranking pass for the chain stored without it: the parent side of the
            # first new chunk (its old tail changed), then every new chunk once (evictions
            # during the stores may have queued some of them as leaves they no longer are).
            self.queue.update_around(nodes[start])
            for node in nodes[start:stored_kv]:
                self.queue.update(node)
            self.queue.deferred = False  # every unit the stores changed is re-ranked
        self._retire(old_end, nodes[stored_kv - 1] if stored_kv else None, now)
        return stored_kv - start, snaps

    def promote(self, handle: RequestHandle, tier: int, now: float) -> int:
        """Move the prompt's cached KV (prefix first) and its resumed snapshot to ``tier``.

        Called between ``begin`` and ``complete``, while the request still pins its path,
        so making room cannot evict what is being promoted; stops at the first object that
        does not fit. Returns the bytes moved. (The simulator's model of vLLM keeping what
        a request loaded in its GPU pool, ``sim/policy.py``.)
        """
        store, queue = self.store, self.queue
        bit = 1 << tier
        hit = handle.match.hit_node
        moved: list[Node] = []
        nbytes = 0
        for node in handle.pinned:
            if not node.kv_tiers:
                break  # evicted since begin: complete() stores it again
            if node.kv_tiers & bit:
                continue
            if not store.promote(node, KV, tier, now, rerank=False):
                break
            nbytes += node.kv_bytes
            moved.append(node)
        if (
            hit is not None
            and hit.snap_tiers
            and not hit.snap_tiers & bit
            and hit.kv_tiers & bit
            and store.promote(hit, SNAPSHOT, tier, now, rerank=False)
        ):
            nbytes += hit.snap_bytes
            moved.append(hit)
        if moved:
            # Units whose per-tier bytes changed: anchors on the path, and the zone
            # below its deepest promoted node (tails running through it).
            for node in handle.pinned:
                if node.snap_tiers or not node.kv_children:
                    queue.update(node)
            queue.update_around(moved[-1])
            queue.deferred = False  # every unit the moves changed is re-ranked
        return nbytes

    def release(self, handle: RequestHandle) -> None:
        pinned = handle.pinned
        for node in pinned:
            node.pins -= 1
        # A pinned node whose content was lost meanwhile (``lose``) was kept only for
        # the pin; deepest first, so each prune sees its children already gone. The
        # pins are a chain from the root (``begin``) and KV is prefix-closed, so those
        # nodes are its tail: found from its end instead of testing every node.
        cut = len(pinned)
        while cut and not pinned[cut - 1].kv_tiers:
            cut -= 1
        for node in reversed(pinned[cut:]):
            if not node.pins and node.key in self.index.nodes:
                self.index.prune(node)
        handle.pinned = []

    def _move_session(
        self, handle: RequestHandle, nodes: list[Node], stored: int, input_tokens: int
    ) -> Node | None:
        """Point the session at its new end; returns its previous end (or None)."""
        sid = handle.session_id
        old = self.index.sessions.get(sid)
        old_end = old.node if old is not None else None
        end = nodes[stored - 1] if stored else self.index.root
        session = self.index.set_session(sid, end, max(1, input_tokens))
        if session.last_access is None:
            # A session's first request: its access was this handle's ``begin``.
            session.last_access = handle.began
        return old_end

    def _retire(self, old_end: Node | None, end: Node | None, now: float) -> None:
        """The previous end stopped being a final snapshot: retire it, re-rank both."""
        if old_end is not None and old_end is not end and old_end.depth >= 0:
            # Still the end of another session: still somebody's final snapshot.
            if old_end.snap_tiers and old_end.key in self.index.nodes and not old_end.ends:
                self.store.retire_final(old_end, now)
            if self.index.get(old_end.key) is old_end:
                self.queue.update_around(old_end)
        if end is not None and self.index.get(end.key) is end:
            self.queue.update_around(end)
