"""The unified cost-aware eviction queue: ``H = t + τ · ln(C / M)``, lowest ``H`` goes first.

Intermediate snapshots, bundles and dead tails (see ``rank``) compete in one ranking.
``t`` is the unit's last access, ``C`` its expected recompute (tokens), ``M`` the bytes it
frees *in the tier that must make room*, in KV-token units (``bytes /
kv_bytes_per_token``), ``τ`` the recency scale; why the cost enters through a logarithm
and how ``τ`` is calibrated online is ``rank``'s docstring. A unit holding nothing in a
tier frees nothing there, so it is not a candidate for that tier: the queue keeps one
addressable heap per tier (the engine's own pool ranks by recency, NOTE 2): an
:class:`IndexedHeap`, defined at the end of this module (NOTEs 9-11).

``H`` depends on neighbours (inserting a snapshot shortens its predecessor's zone,
evicting one lengthens it), so every structural change re-ranks the units around it
(``update_around``). Accesses and drift do not re-rank anything (NOTE 1).

Pinned units (any node pinned by an in-flight load or by the request being stored)
are never returned as victims.

NOTE 1 (lazy refresh). An access only writes the new ``t`` into the nodes it refreshes
(every node of the hit prefix with refresh-all, the hit node without): O(1) per node
and no heap operation, so a hit costs the same whatever the number of units on its
path. Since ``t`` only grows, a refreshed unit's queued rank is a lower bound of its
true ``H``. ``victim`` re-ranks the top of the heap before returning it and pushes it
back when its ``H`` rose, until the top is current: each refreshed unit is re-ranked
at most once per time it reaches the top, however often it was hit meanwhile (a hot
prefix is hit every turn and almost never reaches the top). The same check absorbs
the slow drift of ``τ`` and ``p_end`` (``rank`` NOTE 5).

NOTE 2 (tiers). The engine's own pool (the first ``recency_tiers`` tiers) ranks by
``t`` alone; every other tier by ``H`` (``rank`` NOTE 6).

NOTE 3 (ties go deepest first). Refresh-all gives every unit of a prefix the same
``t``, and where ranks are ``t`` alone (NOTE 2, or ``τ = 0``) they tie; the heap then takes the
deepest unit first (``tie = −depth``), as vLLM's reverse-order block freeing does. The
head of a prefix is read by every hit through it, the tail only by hits that reach it,
so a cold prefix leaves a tier from its tail: what stays is still a prefix. (Insertion
order, the heap's default, would take the head first: it was stored earliest.)

NOTE 4 (stamps: a top whose inputs did not change is not re-ranked). Re-ranking the top
in ``victim`` (NOTE 1) was one of the three zone walks of an eviction, and between
requests it only confirms ranks that nothing has touched since they were queued
(``benchmarks/README.md`` "core_ops": evict ×0.93). ``update`` stamps the node
with the queue's ``epoch`` and the ``access`` it ranked with, and ``victim`` takes a
top as current, without re-ranking it, only if both still match: the inputs of its
rank are then those it was queued with, so a fresh rank would equal the queued one.
Every input is covered: ``access`` by the stamp; ``τ``, ``p_end``, the hit positions
and the queue's own settings by ``_epoch_now`` (a new epoch whenever any of them
differs from the last time it looked; every stamp is taken right after it looked);
a change of structure by ``update_around``, which re-ranks (and so re-stamps) every
unit it changes, as ``check(exact=True)`` asserts; the sessions' hit densities by
the index, which resets the stamps on the path they change (``index`` invariants);
and a change of structure whose re-ranking a caller defers (``rerank=False`` in
``TieredStore``) by ``deferred``: while it is set no stamp is trusted. ``victim``'s
own re-rank of one tier resets the stamp (the unit's other tiers were not re-ranked).
A returning session's ``begin`` samples ``p_end`` and ``τ``: under a stream of requests a
stamp lasts until the next one. ``check`` re-ranks every unit a stamp vouches for and
asserts that its queued rank is the fresh one.

NOTE 5 (a snapshot dropped alone, the common eviction). When only a node's snapshot
comes or goes, the node's parent keeps its KV and its children, so unless the parent
holds a snapshot (whose zone changed) it is still no unit and holds no entry:
``update_around(snapshot_only=True)`` skips its re-rank, one of the four in such an
eviction (``benchmarks/README.md`` "core_ops"). Everything else is
re-ranked as after any change, the parent's other branches included, although their
ranks do not read ``node``: a re-rank also refreshes a rank that drifted since it was
queued (``τ``, ``p_end``, session densities: NOTE 1's lower bounds are approximate
under drift), and skipping those moved decisions in the pinned simulations.

NOTE 6 (refresh what a hit used: ``refresh_used``). A hit reads the KV of every chunk of
its prefix and ONE snapshot, the one it resumed from. Refresh-all writes ``now`` into
every node of the prefix, so a mid-prefix snapshot that no hit has resumed from for
an hour ranks as hot as the KV it sits on for as long as the prefix is read: under
pressure the cache keeps stale mid-prefix snapshots (and, in the upper tiers, where
an intermediate snapshot's unit moves with its KV zone, that zone too) and drops the
snapshots hits resume from (``lru-refresh-all`` loses to ``lru`` there). Each node
therefore keeps two times: ``access`` (the prefix through it was read: refresh-all)
and ``used`` (its snapshot was stored or resumed from). Under ``refresh_used`` the
unit of an intermediate snapshot (kind ``KIND_SNAPSHOT``) ranks by ``used`` in every
tier; bundles and dead tails, whose KV a hit through them reads, by ``access``. A
zone's KV that leaves with a stale snapshot is still read by the hot prefix through
it: it is found in the next tier down (tiers are exclusive and KV prefix-closed, so
the chain stays a prefix), one tier slower, instead of holding a fast tier for a
snapshot nobody resumes from. Worked example, τ = 100 s, last tier: a prefix
A(snap)→B(snap, the session's end) is stored at t = 0 and hit from B at t = 300 s and
t = 600 s. With refresh-all A ranks at 600 + τ·ln(C_A/M); with ``refresh_used`` at
0 + τ·ln(C_A/M), 600 s lower: six e-folds of cost per byte, so it goes before any
snapshot resumed from within the last ten minutes unless its cost per byte is
e^6 ≈ 400 times theirs, while the bundle at B ranks by 600 under both. No constant:
it is the paper's ``H`` with ``t`` the last time the thing being freed was needed.
Stamps (NOTE 4) stay sound: ``used`` changes only where ``access`` becomes ``now``
too (``touch`` clears the stamp of the hit node in case ``access`` already was ``now``).

NOTE 7 (a snapshot's end hits, weighted by the chance its session's tail is gone by then:
``exposed_ends``). ``rank`` prices an intermediate snapshot ``x`` as the resume point it
becomes once the tail below it has left: every session passing ``x`` adds ``p_end·δ`` to
``C`` (``rank`` NOTE 1). That is right where the tail can be the next thing to go, the
last tier, and an overstatement while the tail sits in a faster tier: a unit leaves the
cache only from the last tier, so a tail in the engine's pool or in CPU memory must
first be demoted there and then dropped, and until then an end hit resumes from the
tail's own final snapshot. With refresh-all the overstatement costs most: every hit
writes ``now`` into ``x`` and ``C`` prices it as the session's fallback, so the
mid-prefix snapshots of the sessions being served (tails in the GPU) outrank the final
bundles of sessions idle for a minute, and under pressure the last tier keeps fallbacks
nobody falls back to and drops the bundles idle sessions resume from. (48 sessions at
1/4 of the paper's CPU+disk, one replay of ``benchmarks/sim_pressure.py``'s cell:
1,466 bundles dropped against 393 intermediate snapshots, 94 % of the disk's bytes
snapshots at the end.)

The score's own model gives the weight. A session returns after an idle gap that is
exponential with mean ``τ`` (``rank``); its tail, unread meanwhile, leaves the cache
after sitting in each tier from its own down to the last for that tier's *dwell* time
``D_k``: an EMA of how long the units leaving tier ``k`` had been unread
(``observe_demotion``, on every demotion and drop; the Che approximation of an LRU-like
cache). So an end hit of that session still needs ``x`` with probability
``exp(−S_k/τ)``, ``S_k = D_k + … + D_last``, ``k`` the fastest tier holding the KV of
the chunk just below ``x`` on its path; ``C`` counts ``passes − Σ (1 − exp(−S_k/τ))·
child.passes`` over the children of ``x`` (``rank.expected_recompute``'s ``hidden``,
NOTE 3 there). A tail in the last tier counts in full, as before: there it can be the
next victim, and ``x`` must outrank it so that a cold session still peels from its tail.
Before anything has left a tier every ``D`` is 0 and the weight 1: the paper's pricing
until there is evidence that fast tiers hold tails. No constant: two measured times, the
sessions' return scale and the tiers' dwell. The table of weights (per KV tier mask) is
read once per epoch (NOTE 4), when ``τ``'s samples move: the dwell EMAs are in no
basis of their own, so one epoch's ranks all use one table.

Worked example (``rank``'s numbers: ``τ = 60 s``, ``p_end = 0.95``, ``N_s = 1,572``,
``δ = 4,224``, internal mass 0.5). Session A was hit 10 s ago: its snapshot ``x`` is on
disk, its tail in the GPU. Session B has idled 60 s: its final bundle (``C = 4,013``,
``M = 5,796``) is on disk, ``H_B = now − 60 + 60·ln(4,013/5,796) = now − 82.1``. Paper
pricing: ``C_x = 4,224·(0.05·0.5 + 0.95) = 4,118``, ``H_x = now − 10 + 60·ln(4,118/1,572)
= now + 47.8``: B's bundle goes, ``x`` stays. With dwell times GPU 90 s, CPU 130 s, disk
120 s (about those of that cell), ``S = 340 s``: A's end hit needs ``x`` with
probability ``exp(−340/60) = 0.0035``, ``C_x = 4,224·(0.025 + 0.95·0.0035) = 119.5``,
``H_x = now − 10 + 60·ln(119.5/1,572) = now − 164.6``: ``x`` goes first, 82 s below B.
In the score's model (expected loss per byte ``exp(−a/τ)·C/M``) ``x`` then loses
0.846·0.076 = 0.064 and B's bundle 0.368·0.692 = 0.255. With the dwell times of a cache
whose fast tiers turn over in seconds (GPU 7 s, CPU 15 s, disk 50 s: ``S = 72 s``, the
bundled sample on 2 + 2 + 4 GiB), ``exp(−72/60) = 0.301``, ``C_x = 1,314``, ``H_x = now −
20.7``: B's bundle goes first, as in the paper's pricing, because A's tail is likely to
be gone before A returns.
Stamps (NOTE 4) stay sound: a child's tiers change only by a store, a move or a drop,
each of which re-ranks around the child, ``x`` included.

NOTE 8 (the refresh scope, learned: ``refresh_learned``). NOTE 6's two times are the two
ends of one choice: how much a *pass* (refresh-all writing ``now`` into a snapshot the hit
went through without resuming from it) says about a coming resume, against a *use* (the
snapshot was stored or resumed from). Refresh-all says a pass is worth a use, NOTE 6
that it is worth nothing. ``refresh_learned`` ranks an intermediate snapshot's unit by

    t = used + w · (access − used),      w ∈ [0, 1] learned,

in every tier: in the score's model (``rank``: the chance of a need decays as
``exp(−a/τ)`` with the age ``a``) a pass moves the unit's age back by ``w`` of the time
since its last use, so its chance of a need is ``P_use^(1−w) · P_pass^w``, the
log-linear blend of the two rules' estimates (``w = 1`` is refresh-all, ``w = 0``
``refresh_used``). ``w`` is the measured ratio of two resume rates (``PassValue``): every
intermediate snapshot is, at any time, in one of two classes, last refreshed by a use
(``access == used``) or by a pass (``access > used``); each hit (its lookup's touch, not
the engine's release) closes the time at risk of every snapshot it passes (no resume)
and of the one it resumes from (a resume), in the class each was in, and a snapshot
dropped from the last tier closes its own. ``w = (resumes_pass / seconds_pass) ÷
(resumes_use / seconds_use)``, clipped to 1: a pass is worth at most a use. Rates per
second at risk, not per snapshot: a rule that keeps passed snapshots longer adds to
their seconds as much as to their resumes, so the estimate does not simply confirm the
rule in force. Both sums decay by ``1 − α`` per resume (``α`` the core's EMA rate). Until
a used snapshot has been resumed from, ``w = 1``: the paper's refresh-all until there is
evidence. No constant: two measured rates. ``w`` changes only at a resume, which is in
the epoch's basis (NOTE 4), and every rank of an epoch uses the epoch's ``w``. Like ``τ``
(``rank`` NOTE 5) it drifts both ways, so a queued rank is no longer a lower bound in
the tiers ranked by ``t`` alone either (``check``): a unit whose ``w`` fell is re-ranked
when it reaches the top, and waits at most the drift of its own ``t``.

Worked example (no decay, for the arithmetic). Since the estimate started, snapshots last
refreshed by a use were at risk 400 s in all and resumed from twice; snapshots last
refreshed by a pass were at risk 6,000 s and resumed from once. The rates are 2/400 =
0.005/s and 1/6,000 = 0.000167/s, ``w = 0.000167/0.005 = 0.0333``. A snapshot ``x`` used
at 0 s and passed at 600 s ranks at ``t = 0 + 0.0333·600 = 20`` s: with ``τ = 100`` s,
``(600 − 20)/100 = 5.8`` e-folds of cost per byte below refresh-all's rank, 0.2 above
``refresh_used``'s. Had the passed snapshots been resumed from 15 times in their 6,000 s
(0.0025/s), ``w = 0.5`` and ``t = 300`` s.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Iterator
from math import log
from typing import Generic, TypeVar

from .ema import SeededEMA, check_alpha
from .hit_positions import HitPositions
from .index import Node, PrefixIndex, bits
from .rank import (
    KIND_BUNDLE,
    KIND_DEAD,
    KIND_SNAPSHOT,
    MIN_RATIO,
    HitModel,
    ReaccessScale,
    expected_recompute,
    freed_in,
    score,
    tier_bytes,
    unit_nodes,
    unit_parts,
)

__all__ = ["EvictionQueue", "IndexedHeap", "PassValue"]


class EvictionQueue:
    """One ranking over all units, one heap per tier.

    ``tau`` None calibrates ``τ`` online from ``reaccess`` (the design, ``rank``); a
    number fixes it (0 = plain LRU over units). ``refresh_all`` controls whether a hit
    refreshes every unit on the prefix up to the hit (the paper's refresh-all) or only
    the unit that was hit; ``refresh_used`` ranks an intermediate snapshot's unit by when
    it was last resumed from (NOTE 6), ``refresh_learned`` by a time between that and its
    last refresh, weighted by the learned worth of a pass (NOTE 8); ``exposed_ends``
    weights a snapshot's end hits by the chance that the tail below it has left the cache
    when its session returns (NOTE 7).
    """

    def __init__(
        self,
        index: PrefixIndex,
        num_tiers: int,
        *,
        tau: float | None,
        token_bytes: int,
        hit_model: HitModel | None = None,
        reaccess: ReaccessScale | None = None,
        refresh_all: bool = True,
        refresh_used: bool = False,
        refresh_learned: bool = False,
        exposed_ends: bool = False,
        attention_tokens: float = math.inf,
        positions: HitPositions | None = None,
        recency_tiers: int = 0,
    ) -> None:
        if num_tiers <= 0:
            raise ValueError("num_tiers must be positive")
        if tau is not None and not tau >= 0:
            raise ValueError(f"tau must be ≥ 0 or None (calibrated), got {tau}")
        if not 0 <= recency_tiers < num_tiers:
            raise ValueError(f"recency_tiers must be in [0, {num_tiers - 1}], got {recency_tiers}")
        if token_bytes <= 0:
            raise ValueError(f"token_bytes must be positive, got {token_bytes}")
        self.index = index
        self.fixed_tau = None if tau is None else float(tau)
        self.token_bytes = token_bytes
        self.hit_model = hit_model if hit_model is not None else HitModel()
        self.reaccess = reaccess if reaccess is not None else ReaccessScale()
        self.refresh_all = refresh_all
        # NOTE 8: ``refresh_learned`` blends the two times of NOTE 6 by a learned weight.
        self.refresh_used = refresh_used or refresh_learned
        self.refresh_learned = refresh_learned
        self.pass_value = PassValue(self.reaccess.alpha)
        self._w = 1.0
        self.exposed_ends = exposed_ends
        # NOTE 7: how long the units leaving each tier had sat there unread (dwell), and
        # per KV tier mask the share of a passing session's end hits that its tail there
        # still serves (None: every end hit counts, the paper's pricing).
        self.dwell = [SeededEMA(self.reaccess.alpha) for _ in range(num_tiers)]
        self._hidden: list[float] | None = None
        self.attention_tokens = attention_tokens
        self.positions = positions
        self.recency_tiers = recency_tiers
        self.heaps: list[IndexedHeap[Node]] = [IndexedHeap() for _ in range(num_tiers)]
        # The tiers in each tier mask, ascending (``rank.tier_bytes``: a handful of tiers,
        # 2^n entries).
        self._tiers_of = [tuple(bits(mask)) for mask in range(1 << num_tiers)]
        # Stamps (NOTE 4): the epoch, the global inputs it was last seen with, and
        # whether a caller deferred re-ranking after a change of structure.
        self.epoch = 0
        self._basis: tuple[object, ...] | None = None
        self._tau, self._first = 0.0, num_tiers
        self.deferred = False

    # ----------------------------------------------------------------- ranking
    @property
    def tau(self) -> float:
        """The ``τ`` in use now: the fixed one, or the calibrated re-access scale."""
        return self.reaccess.tau if self.fixed_tau is None else self.fixed_tau

    def cost(self, node: Node, above: Node | None = None) -> float:
        """``rank.expected_recompute`` of ``node`` (``above``: where the search for its
        previous snapshot may start, see there)."""
        return expected_recompute(
            node,
            self.index.chunk_tokens,
            self.hit_model.end_probability,
            self.attention_tokens,
            self.positions,
            above,
            self._hidden,
        )

    def cost_bytes(self, anchor: Node, above: Node | None = None) -> float:
        """``C`` of the unit at ``anchor`` in the bytes ``M`` is counted in (0 for a unit
        without a snapshot: a KV tail resumes nothing)."""
        c = self.cost(anchor, above) if anchor.snap_tiers else 0.0
        return c * self.token_bytes

    def _first_cost_tier(self, tau: float) -> int:
        """The first tier ranked by ``H``; the tiers above it rank by ``t`` alone (LRU):
        the engine's own pool (NOTE 2, ``rank`` NOTE 6), and every tier when ``τ = 0``.
        The one statement of that rule (``_score``, ``_epoch_now`` for ``update``, and
        ``check`` read it)."""
        return self.recency_tiers if tau else len(self.heaps)

    def _score(self, anchor: Node, freed: int, tau: float, tier: int) -> float:
        """The unit's rank in ``tier`` (``update`` computes the same, inline)."""
        if tier < self._first_cost_tier(tau):
            return self._t_own(anchor, tier)
        return score(self._t_own(anchor, tier), self.cost_bytes(anchor), freed, tau)

    def _t_own(self, anchor: Node, tier: int) -> float:
        """``t`` of the unit at ``anchor``: for an intermediate snapshot's unit ``used``
        under ``refresh_used`` (NOTE 6), ``used + w·(access − used)`` under
        ``refresh_learned`` (NOTE 8, ``w`` the current epoch's); ``access`` otherwise (the
        same in every tier)."""
        if self.refresh_learned:
            self._epoch_now()  # the epoch of the ``w`` in force now
        if (
            self.refresh_used
            and anchor.snap_tiers
            and anchor.kv_children
        ):
            used = anchor.used
            return used + self._w * (anchor.access - used) if self.refresh_learned else used
        return anchor.access

    def inputs(self, anchor: Node, tier: int) -> tuple[float, float, int] | None:
        """``(t, C, M)`` of the unit at ``anchor`` for ``tier``: what the last tier's rank
        ``H = score(t, C, M, τ)`` is computed from; None if it frees nothing there."""
        freed = self._freed_in(anchor, tier)
        if freed <= 0:
            return None
        return self._t_own(anchor, tier), self.cost_bytes(anchor), freed

    def _freed_in(self, anchor: Node, tier: int) -> int:
        """Bytes the unit at ``anchor`` frees in ``tier`` (``rank.freed_in``)."""
        return freed_in(anchor, tier, alone=tier >= len(self.heaps) - 1)

    def rank(self, anchor: Node, tier: int) -> float | None:
        """``H`` of the unit at ``anchor`` for ``tier``; None if it frees nothing there."""
        freed = self._freed_in(anchor, tier)
        if freed <= 0:
            return None
        return self._score(anchor, freed, self.tau, tier)

    def arrival_rank(self, anchor: Node) -> float:
        """The rank the unit at ``anchor`` competes with in the last tier when it is
        demoted there (``placement`` NOTE 1): its ``H`` with ``M`` = every byte it would
        free there once it has arrived (its snapshot alone for an intermediate snapshot
        unit, which leaves the last tier without its KV; the whole unit otherwise)."""
        snap, chain = unit_nodes(anchor)
        freed = (snap.snap_bytes if snap is not None else 0) + sum(n.kv_bytes for n in chain)
        return self._score(anchor, freed, self.tau, len(self.heaps) - 1)

    def _epoch_now(self) -> int:
        """The epoch of the global inputs of every rank as they are now (NOTE 4): a new
        one whenever one of them differs from the last call. Counters, not values, for
        the estimates that drift (a value that drifts back is not the same input)."""
        positions = self.positions
        tau = self.tau
        basis = (
            tau,
            self.reaccess.samples,
            self.hit_model.end_probability,
            self.hit_model.samples,
            -1 if positions is None else positions.samples,
            self.attention_tokens,
            self.token_bytes,
            self.recency_tiers,
            self.pass_value.samples,
        )
        if basis != self._basis:
            self._basis = basis
            self.epoch += 1
            # What ``_update`` reads of them, read here once per epoch.
            self._tau, self._first = tau, self._first_cost_tier(tau)
            self._w = self.pass_value.weight if self.refresh_learned else 1.0
            self._hidden = self._hidden_now(tau)
        return self.epoch

    def _hidden_now(self, tau: float) -> list[float] | None:
        """Per KV tier mask, the share of a passing session's end hits that do not need
        the snapshot above because the session's tail starts in that tier (NOTE 7):
        ``1 − exp(−S/τ)``, ``S`` the dwell times summed from the mask's fastest tier down
        to the last; 0 where the mask has no tier above the last (or no KV). Read once
        per epoch (its inputs, the dwell EMAs, are folded in when ``τ``'s samples move,
        which is in the basis), so every rank of an epoch uses the same table."""
        if not self.exposed_ends or tau <= 0.0:
            return None
        last = len(self.heaps) - 1
        share = [0.0] * (last + 1)
        below = self.dwell[last].value
        for tier in range(last - 1, -1, -1):
            below += self.dwell[tier].value
            share[tier] = 1.0 - math.exp(-below / tau)
        table = []
        for mask in range(len(self._tiers_of)):
            tiers = self._tiers_of[mask]
            table.append(share[tiers[0]] if tiers else 0.0)
        return table

    def observe_demotion(self, anchor: Node, tier: int, now: float) -> None:
        """The unit at ``anchor`` is being pushed out of ``tier`` (demoted, or dropped
        from the last): one sample of that tier's dwell time (NOTE 7)."""
        if self.exposed_ends:
            self.dwell[tier].observe(now - anchor.access)
        if self.refresh_learned and tier == len(self.heaps) - 1 and anchor.snap_tiers:
            # NOTE 8: a snapshot leaving the cache closes its time at risk of a resume.
            passed = anchor.access > anchor.used
            if passed or anchor.kv_children:
                self.pass_value.expose(passed, now - anchor.access)

    def update(self, anchor: Node) -> None:
        """(Re-)rank the unit anchored at ``anchor`` in every tier (or drop it)."""
        self._update(anchor, self._epoch_now())

    def _update(self, anchor: Node, epoch: int) -> None:
        """``update`` with the epoch just read (one read per ``update_around``): nothing
        has changed since, so ``τ`` is still the one ``_epoch_now`` saw."""
        # ``unit_kind`` inline: this runs for every node ``update_around`` visits.
        snap = anchor.snap_tiers
        if anchor.kv_tiers and not anchor.kv_children:
            kind = KIND_BUNDLE if snap else KIND_DEAD
        elif snap:
            kind = KIND_SNAPSHOT
        else:
            kind = None
        if kind is None or anchor.depth < 0 or anchor.parent is None:
            for heap in self.heaps:
                heap.discard(anchor)
            return
        freed, top = tier_bytes(anchor, kind, len(self.heaps) - 1, self._tiers_of)
        tau, first = self._tau, self._first
        t, tie = anchor.access, -anchor.depth
        anchor.rank_stamp = (epoch, t)
        cost: float | None = None
        t_own = t
        if self.refresh_used and kind == KIND_SNAPSHOT:
            used = anchor.used
            t_own = used + self._w * (t - used) if self.refresh_learned else used
        for tier, heap in enumerate(self.heaps):
            m = freed[tier]
            if m <= 0:
                heap.discard(anchor)
            elif tier < first:
                heap.set(anchor, t_own, tie)
            else:
                if cost is None:
                    # C does not depend on the tier: one zone walk per unit, at the
                    # first tier that ranks by it (``cost_bytes`` inline).
                    cost = 0.0
                    if snap:
                        cost = self.token_bytes * expected_recompute(
                            anchor,
                            self.index.chunk_tokens,
                            self.hit_model.end_probability,
                            self.attention_tokens,
                            self.positions,
                            top,
                            self._hidden,
                        )
                # ``rank.score`` inline, the same operations in the same order (this
                # runs for every re-ranked unit in every tier): τ > 0 here, and m > 0.
                ratio = cost / m
                heap.set(anchor, t_own + tau * log(ratio if ratio > MIN_RATIO else MIN_RATIO), tie)

    def remove(self, anchor: Node) -> None:
        for heap in self.heaps:
            heap.discard(anchor)

    def update_around(self, node: Node, *, snapshot_only: bool = False) -> None:
        """Re-rank every unit whose extent or cost depends on ``node``.

        That is ``node`` itself; its parent (it may have become or stopped being a KV
        leaf); the nearest snapshot above (its zone contains ``node``); and, below the
        parent, the zone's boundary snapshots and KV leaves: their previous snapshot may
        have changed, and a tail segment running through the parent grows or shrinks
        when the parent gains or loses a branch. ``snapshot_only``: only ``node``'s
        snapshot came or went, so a parent without a snapshot is skipped (NOTE 5).
        """
        epoch = self._epoch_now()
        update = self._update
        update(node, epoch)
        parent = node.parent
        start = parent if parent is not None and parent.depth >= 0 else node
        if start is not node and (start.snap_tiers or not snapshot_only):
            update(start, epoch)
        above = start.parent
        while above is not None and above.depth >= 0 and not above.snap_tiers:
            above = above.parent
        if above is not None and above.depth >= 0:
            update(above, epoch)
        stack = list(start.children.values()) if start.children else []
        while stack:
            q = stack.pop()
            if not q.kv_tiers:
                # KV is prefix-closed: nothing below a chunk without KV holds a unit.
                self.remove(q)
                continue
            if q.snap_tiers or not q.kv_children:
                update(q, epoch)
            # Below ``node`` itself too: its own snapshot bounds the tails under it.
            if q.children and (not q.snap_tiers or q is node):
                stack.extend(q.children.values())

    # ----------------------------------------------------------------- access
    def touch(self, path: list[Node], hit_chunks: int, now: float, *, sample: bool = True) -> None:
        """A request read the prefix ``path[:hit_chunks]``: refresh it (NOTE 1).

        With refresh-all every node on the hit prefix gets ``now``; otherwise only the
        hit node (the snapshot that was loaded). Nothing is re-ranked here. ``sample``:
        the first of a request's two touches (its lookup), which ``refresh_learned``
        learns from (NOTE 8); the second (the engine's release) only refreshes.
        """
        if hit_chunks <= 0:
            return
        if self.refresh_learned and sample:
            self._learn(path, hit_chunks, now)
        if self.refresh_all:
            for node in path[:hit_chunks]:
                node.access = now
        else:
            path[hit_chunks - 1].access = now
        if self.refresh_used:
            hit = path[hit_chunks - 1]
            hit.used = now
            hit.rank_stamp = None

    def _learn(self, path: list[Node], hit_chunks: int, now: float) -> None:
        """One hit's samples for ``pass_value`` (NOTE 8), before it refreshes anything:
        each snapshot it passes closes its time at risk since its last refresh, the one it
        resumes from closes it with a resume. A snapshot counts while intermediate, and
        after its last pass whatever it became (``access > used``: a pass refreshed it
        last, so it had KV below then)."""
        value = self.pass_value
        for node in path[: hit_chunks - 1]:
            if node.snap_tiers:
                value.expose(node.access > node.used, now - node.access)
        hit = path[hit_chunks - 1]
        passed = hit.access > hit.used
        if passed or hit.kv_children:
            value.resume(passed, now - hit.access)

    # --------------------------------------------------------------- victims
    def pinned(self, anchor: Node, tier: int | None = None) -> bool:
        """Whether any part the unit would move out of ``tier`` is pinned.

        The parts are ``rank.unit_parts``' (the snapshot goes alone out of the last tier,
        and ``tier`` None means the last); walked, not listed (every victim is checked).
        """
        snap, chain = unit_parts(anchor, alone=tier is None or tier >= len(self.heaps) - 1)
        if snap is not None and snap.pins:
            return True
        # A loop, not any(<generator>): no generator is made when there is no chain (a
        # snapshot dropped alone, the common victim), measured.
        for node in chain:  # noqa: SIM110
            if node.pins:
                return True
        return False

    def victim(self, tier: int, below: float | None = None) -> tuple[Node, float] | None:
        """The unpinned unit with the lowest ``H`` in ``tier`` (and ``H < below``)."""
        heap = self.heaps[tier]
        skipped: list[tuple[Node, float]] = []
        found: tuple[Node, float] | None = None
        # No stamp is trusted while a re-ranking is deferred (NOTE 4).
        epoch = -2 if self.deferred else self._epoch_now()
        last = tier >= len(self.heaps) - 1
        while (top := heap.peek()) is not None:
            anchor, pri = top
            if below is not None and pri >= below:
                break
            if anchor.rank_stamp != (epoch, anchor.access):
                # Not stamped current (NOTE 4). Queued ranks are lower bounds after lazy
                # refreshes (NOTE 1): re-rank the top until it is current. Terminates: a
                # re-ranked entry is current.
                fresh = self.rank(anchor, tier)
                if fresh is None:
                    heap.discard(anchor)
                    continue
                if fresh > pri + 1e-9:
                    anchor.rank_stamp = None  # this tier only: not the whole unit
                    heap.set(anchor, fresh, -anchor.depth)
                    continue
            # ``pinned`` inline for the common victim, a snapshot dropped alone out of the
            # last tier (its parts are ``anchor`` alone, ``rank.unit_parts``).
            if (
                anchor.pins
                if last and anchor.kv_children and anchor.snap_tiers
                else self.pinned(anchor, tier)
            ):
                heap.discard(anchor)
                skipped.append((anchor, pri))
                continue
            found = (anchor, pri)
            break
        for anchor, pri in skipped:
            heap.set(anchor, pri, -anchor.depth)
        return found

    def check(self, exact: bool = False) -> None:
        """Assert the queue's invariants (O(n)).

        Every unit is queued in exactly the tiers where it frees bytes, and at a rank
        consistent with a fresh ``rank()``: in the tiers ranked by ``t`` alone (every tier
        when ``τ = 0``) a queued rank is never above the fresh one (accesses only raise
        ``t``, NOTE 1; not under ``refresh_learned``, whose ``w`` drifts, NOTE 8). On the
        cost-ranked tiers ``τ`` and ``p_end`` drift both ways, so there only ``exact``
        checks: every queued rank *equals* the fresh one, which holds
        whenever no access and no sample happened since the last structural change (a
        quiescent point). In every tier, a unit whose stamp ``victim`` would trust has a
        queued rank equal to the fresh one (NOTE 4), whether or not ``exact``.

        Reads the epoch as ``victim`` would (``_epoch_now``: a new epoch iff an input
        changed, the same one the next ``victim`` or ``update`` would start).
        """
        live = set(self.index.nodes.values())
        for heap in self.heaps:
            for anchor in heap:
                assert anchor in live, f"queued node {anchor} is not in the index"
        first = self._first_cost_tier(self.tau)
        epoch = None if self.deferred else self._epoch_now()
        for node in live:
            # Per tier through ``rank.unit_parts``: the hot path's ``tier_bytes`` computes
            # all tiers in one walk, so this also checks that walk against the definition.
            freed = [self._freed_in(node, tier) for tier in range(len(self.heaps))]
            stamped = epoch is not None and node.rank_stamp == (epoch, node.access)
            for tier, heap in enumerate(self.heaps):
                assert (freed[tier] > 0) == (node in heap), (node, tier, freed)
                if node not in heap:
                    continue
                queued, fresh = heap.priority(node), self.rank(node, tier)
                assert fresh is not None
                tol = 1e-9 * max(1.0, abs(fresh))
                if exact:
                    assert abs(queued - fresh) <= tol, f"stale rank {queued} ≠ {fresh}: {node}"
                    continue
                if tier < first and not self.refresh_learned:
                    # (``w`` drifts both ways under ``refresh_learned``, NOTE 8.)
                    assert queued <= fresh + tol, f"rank {queued} above fresh {fresh}: {node}"
                if stamped:
                    assert abs(queued - fresh) <= tol, f"stamped rank {queued} ≠ {fresh}: {node}"


class PassValue:
    """How much a pass (refresh-all's refresh of a snapshot a hit did not resume from) is
    worth against a use as evidence of a coming resume: ``weight`` = the resume rate of
    intermediate snapshots last refreshed by a pass ÷ that of those last refreshed by a
    use (stored or resumed from), clipped to ``[0, 1]`` (``EvictionQueue`` NOTE 8).

    Invariants: every sum is ≥ 0; ``weight`` is in ``[0, 1]`` and changes only at a
    resume (``samples`` counts them), 1 until a used snapshot has been at risk and
    resumed from (no evidence that a use outweighs a pass: refresh-all). Both classes'
    sums decay by ``1 − alpha`` at every resume: the rates are over about the last
    ``1/alpha`` resumes.
    """

    __slots__ = ("alpha", "exposure", "resumes", "samples", "weight")

    def __init__(self, alpha: float) -> None:
        self.alpha = check_alpha(alpha)
        # Index 0: last refreshed by a use; 1: by a pass.
        self.resumes = [0.0, 0.0]
        self.exposure = [0.0, 0.0]
        self.samples = 0
        self.weight = 1.0

    def expose(self, passed: bool, seconds: float) -> None:
        """A snapshot of that class was at risk for ``seconds`` without being resumed from."""
        self.exposure[passed] += max(0.0, seconds)

    def resume(self, passed: bool, seconds: float) -> None:
        """A snapshot of that class was resumed from ``seconds`` after its last refresh."""
        keep = 1.0 - self.alpha
        resumes, exposure = self.resumes, self.exposure
        for k in (0, 1):
            resumes[k] *= keep
            exposure[k] *= keep
        resumes[passed] += 1.0
        exposure[passed] += max(0.0, seconds)
        self.samples += 1
        if resumes[0] > 0.0 and exposure[0] > 0.0 and exposure[1] > 0.0:
            rate_used = resumes[0] / exposure[0]
            self.weight = min(1.0, resumes[1] / exposure[1] / rate_used)


# --------------------------------------------------------------------- the indexed heap

K = TypeVar("K", bound=Hashable)

COMPACT_MIN = 64

_heappush, _heappop = heapq.heappush, heapq.heappop

# An entry ``(tie, order, version, key, priority)``; a bucket is the one entry of its
# priority, or a ``heapq`` list of two or more.
_Entry = tuple[int, int, int, K, float]
_Bucket = _Entry[K] | list[_Entry[K]]


class IndexedHeap(Generic[K]):
    """Min-heap of ``(priority, key)`` with ``set`` / ``discard`` by key in O(log n): the
    priority queue behind every eviction decision (one per tier in :class:`EvictionQueue`).

    Eviction ranks change constantly (each structural change re-ranks the units around it,
    each victim check may re-rank the top), so the queue must support update and removal
    by key, not only push/pop. Ties are broken by an optional ``tie`` and then by insertion
    order, so the order is deterministic for a given sequence of operations.

    **Algorithm: a heap of priorities over buckets of entries, with lazy deletion.** An
    entry is ``(tie, order, version, key, priority)``; ``_live[key]`` is the key's current
    entry. Entries of equal priority share a *bucket* (``_buckets[priority]``: the entry
    itself when it is alone, else a ``heapq`` list ordered by ``(tie, order, version)``),
    and ``_heap`` is a ``heapq`` heap of the buckets' priorities: plain floats. ``set``
    adds a new entry to its priority's bucket (pushing the priority when the bucket is new)
    and makes it current; ``discard`` forgets the current entry. An entry that stops being
    current leaves its bucket at once if it was alone there (its priority stays in
    ``_heap``, stale, until it reaches the top), and stays in a shared bucket, stale, until
    that bucket reaches the top (an entry is stale when it is not ``_live[key]``). ``peek``
    and ``pop`` discard stale entries and priorities from the top. When stale priorities
    or entries outnumber the live keys they are rebuilt from what is live (O(n), paid once
    per n stale ones: O(1) amortised). Every operation is therefore a ``heapq`` push or
    pop, O(log n) in C, and a dict lookup or two.

    Invariants:
      * ``_live[key]`` is in ``_buckets[_live[key][4]]`` for every live key; ``len(self)``
        counts live keys;
      * a bucket is one live entry (a tuple) or a ``heapq`` list of two or more entries,
        live or stale, never empty; its priority is in ``_heap`` (a priority may also be
        there once more per bucket it had before: such a copy finds no bucket, or the
        current one, when it reaches the top, and is popped with it);
      * ``_entries`` counts the entries in all buckets; at most ``max(len(_live),
        COMPACT_MIN)`` of them are stale, and at most as many priorities in ``_heap``.

    NOTE 9 (why a heap of floats). A heap of entry tuples ``(priority, tie, order, version,
    key)`` would be the plain design. Comparing two tuples costs an equality
    and an order comparison of their first items, behind a pointer to each tuple, and the
    pops of a heap of 10⁵–10⁶ entries are bound by those reads: a pop of 372K tuples took
    about 3 µs, a pop of 372K floats 0.7–0.9 µs (``benchmarks/heap_pops.py``), and the
    victim search of an eviction pops about three times (``benchmarks/README.md``
    "core_ops"). Where ranks are ``H`` (sums of floats) equal priorities are rare,
    so a bucket is the entry itself (no list) and costs a dict lookup; where they tie (``t``
    alone: refresh-all gives a prefix one ``t``) a bucket is a small ``heapq`` list of
    tuples, the plain design's cost.

    NOTE 10 (the order). It is the one of whole entries ``(priority, tie, order, version)``:
    ``version`` is unique, so a comparison never reaches the key (keys need not be
    orderable). ``order`` is the key's insertion number, kept when its priority moves, so
    equal ``(priority, tie)`` go by insertion as in a heap updated in place; a key
    discarded and set again is inserted anew. Priorities are compared as floats (``-0.0``
    and ``0.0`` share a bucket, as they compared equal in a tuple) and must not be NaN.

    NOTE 11 (an entry alone leaves at once). Most stale entries were alone at their
    priority, and taking them out of the dict when they go stale (one lookup) keeps the
    common rebuild to the floats: ``list(_buckets)`` and a ``heapify``, 0.04 s for 400K
    live keys, as fast as a ``heapify`` of 400K entry tuples (a rebuild of the
    buckets themselves hashes every live priority anew: 0.11 s; it runs only when stale
    entries of shared buckets pile up). It also means that a bucket of one entry is live,
    which ``peek`` takes without a lookup.
    """

    __slots__ = ("_buckets", "_entries", "_heap", "_live", "_seq")

    def __init__(self) -> None:
        self._heap: list[float] = []
        self._buckets: dict[float, _Bucket[K]] = {}
        self._live: dict[K, _Entry[K]] = {}
        self._seq = 0
        self._entries = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._live))

    def priority(self, key: K) -> float:
        return self._live[key][4]

    def set(self, key: K, priority: float, tie: int = 0) -> None:
        """Insert ``key`` or move it to ``(priority, tie)``."""
        live, buckets = self._live, self._buckets
        old = live.get(key)
        self._seq += 1
        if old is None:
            order = self._seq
        elif old[4] == priority and old[0] == tie:
            return
        else:
            order = old[1]
            if buckets.get(old[4]) is old:
                # Alone at its priority: the bucket goes now, its float stays (NOTE 11).
                del buckets[old[4]]
                self._entries -= 1
        entry = (tie, order, self._seq, key, priority)
        live[key] = entry
        bucket = buckets.get(priority)
        if bucket is None:
            buckets[priority] = entry
            _heappush(self._heap, priority)
        elif type(bucket) is list:
            _heappush(bucket, entry)
        else:
            buckets[priority] = [bucket, entry] if bucket < entry else [entry, bucket]
        self._entries += 1
        # ``_compact``'s condition, inline: this runs for every re-rank.
        if old is not None:
            n, e = len(self._heap), self._entries
            if e > n:
                n = e
            if n > 2 * len(live) and n > 2 * COMPACT_MIN:
                self._compact()

    def discard(self, key: K) -> bool:
        """Remove ``key`` if present; returns whether it was."""
        live, buckets = self._live, self._buckets
        old = live.pop(key, None)
        if old is None:
            return False
        if buckets.get(old[4]) is old:
            del buckets[old[4]]
            self._entries -= 1
        n, e = len(self._heap), self._entries
        if e > n:
            n = e
        if n > 2 * len(live) and n > 2 * COMPACT_MIN:
            self._compact()
        return True

    def peek(self) -> tuple[K, float] | None:
        heap, buckets, live = self._heap, self._buckets, self._live
        while heap:
            priority = heap[0]
            bucket = buckets.get(priority)
            if type(bucket) is tuple:
                # A bucket of one entry is live: a stale one leaves at once (NOTE 11).
                return bucket[3], bucket[4]
            if bucket is not None:
                while bucket:
                    top = bucket[0]
                    if live.get(top[3]) is top:
                        return top[3], top[4]
                    _heappop(bucket)
                    self._entries -= 1
                del buckets[priority]
            _heappop(heap)
        return None

    def pop(self) -> tuple[K, float]:
        top = self.peek()
        if top is None:
            raise IndexError("pop from an empty IndexedHeap")
        key, priority = top
        del self._live[key]
        bucket = self._buckets[priority]
        self._entries -= 1
        if type(bucket) is list:
            _heappop(bucket)
            if bucket:
                return top
        del self._buckets[priority]
        _heappop(self._heap)
        return top

    def _compact(self) -> None:
        """Drop stale priorities and entries; callers do so once either outnumbers the live
        keys (and ``COMPACT_MIN``): ``max(len(_heap), _entries) > 2 · max(len(_live),
        COMPACT_MIN)``. Stale entries sit only in shared buckets (NOTE 11): while they are
        within that bound only the floats are rebuilt, from the buckets' priorities."""
        live = self._live
        if self._entries <= 2 * max(len(live), COMPACT_MIN):
            self._heap = list(self._buckets)
            heapq.heapify(self._heap)
            return
        # One entry per priority, the common case, in one pass; then the equal ones.
        buckets: dict[float, _Bucket[K]] = {entry[4]: entry for entry in live.values()}
        if len(buckets) < len(live):
            equal: dict[float, list[_Entry[K]]] = {}
            for entry in live.values():
                first = buckets[entry[4]]
                if first is not entry:
                    group = equal.get(entry[4])
                    if group is None:
                        equal[entry[4]] = [first, entry]
                    else:
                        group.append(entry)
            for priority, group in equal.items():
                heapq.heapify(group)
                buckets[priority] = group
        self._buckets = buckets
        self._heap = list(buckets)
        heapq.heapify(self._heap)
        self._entries = len(live)
