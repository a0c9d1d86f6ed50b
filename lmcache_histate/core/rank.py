"""The rank of an eviction unit: its expected recompute cost ``C`` and its score ``H``.

One formula, two halves: the eviction queue (``eviction``) ranks each *unit* by
``H = t + τ·ln(C/M)``, ``t`` its last access, ``M`` the bytes it frees and ``C`` what
evicting it costs. The first half below says what a unit is and how ``C`` is priced
(NOTE 1-3); the second why ``H`` has this form and how its recency scale ``τ`` is
calibrated online (NOTE 4-7).

**Units and their expected recompute cost ``C``.**

The eviction queue ranks *units*, not raw objects, because objects are only worth
something together:

* **snapshot unit** — an intermediate snapshot (its node has KV descendants). Evicting
  it alone is safe: a hit that would have used it falls back to the previous kept
  snapshot on the same prefix.
* **bundle** — a KV leaf that holds a snapshot: the last KV segment (from the nearest
  ancestor that holds a snapshot or where the prefix branches, exclusive, down to the
  leaf) plus the snapshot at its end. This is the paper's per-session *final bundle*;
  its KV is useless without its snapshot and vice versa, so they go together.
* **dead tail** — a KV leaf without a snapshot, with the same KV segment: no hit can
  ever land in it (hits need a snapshot), so its expected cost is zero.

On every tier but the last, a snapshot unit also carries the KV segment above it (up
to the previous snapshot or branch point): moving it down is always safe, and it is the
only way interior KV can make room in a fast tier (see ``unit_parts``).

Cold sessions (our choice where the paper is silent): once a session's final bundle is
evicted, the previous intermediate snapshot becomes the end of a KV leaf, i.e. the anchor
of a new bundle made of the preceding segment. A cold prefix therefore peels off from
its tail one snapshot interval at a time, each step priced like any other unit, and the
shared parts of branched prefixes stay as long as any branch below them does.

``C`` (expected extra recompute tokens if the unit goes) weights hit positions as the
paper does: with probability ``p_end`` (an EMA over observed accesses) an access
continues the session's context from its end, otherwise it lands uniformly on an
internal position of the session's context. Removing the snapshot at ``p`` whose
previous kept snapshot on the prefix is at ``p_prev`` makes every hit position in
``[p, next kept snapshot)`` fall back by ``p - p_prev`` tokens. ``C`` sums this over the
sessions whose hits can need the snapshot, one access each: it is the loss *when they
come back*. Whether they come back is the recency term's business (``H``, below); the
paper's ``1/N`` (every live session equally likely to be next) is a constant factor that
the score ignores by construction, so it is not applied.

**End hits of an intermediate snapshot: priced as the resume point it is once the tail
below it has left** (NOTE 1). Every session passing the snapshot (``Node.passes``) counts
an end access, not only those ending in its zone: ``mass = (1 − p_end)·internal +
p_end·passes``.

NOTE 1 (why: granularity, measured). Where units leave the cache (the last tier) a
cold session's units must leave
*from the tail*, one interval at a time (the peel above): each step frees one
segment and the session, if it comes back, still resumes from the snapshot above it.
Priced by internal hits alone (``C = δ·(1 − p_end)·…``, ``p_end`` ≈ 0.97 in the Weka
traces), an intermediate snapshot is the cheapest thing in the tier and goes *first*;
once a session's intermediates are gone its KV belongs to one bundle from its root to
its end, and that bundle leaves at once. Measured on the whole Weka folder at 1/8 of the
paper's CPU+disk: 281 end-of-context requests lost 240K tokens each that way, while
``file-lru`` (objects peeled a chunk at a time) kept resume points
(``benchmarks/sim_eviction.md``). Per byte the two orders lose the same when *both*
units go (a merged bundle loses ``p_end·(δ_s + δ_t)`` for ``δ_s + δ_t + N_s`` bytes, the
pair ``p_end·δ_t`` for ``δ_t + N_s`` and then ``p_end·δ_s`` for ``δ_s + N_s``); they
differ when only part of the room is needed, which is the common case (a store needs one
chunk, the merged bundle frees a whole context). Pricing the snapshot's end hits as
needed makes its ``C/M = p_end·δ_s / N_s`` exceed the tail bundle's ``p_end·δ_t / (δ_t +
N_s) < p_end`` whenever ``δ_s ≥ N_s`` (intervals are ``√(2·L·N_s·F)``, above ``N_s`` for
any segment ``L > N_s / 2F``), so at equal recency the tail goes first. While the tail
is cached this overstates the snapshot's value (the end hit resumes from the final
snapshot, not from it): an upper bound that only matters once the tail is the next
victim, which is exactly when the snapshot becomes the session's resume point. A tail in
a tier above the last cannot be the next victim (units leave the cache from the last
tier), so with ``hidden`` the bound is weighted there by the chance that the tail is
gone when the session returns (NOTE 3).

NOTE 2 (measured positions in ``C``). Internal hits are not uniform inside a segment
(``hit_positions``: most land near a segment's end). A snapshot's internal mass is the
uniform one times the mean relative density over its zone's offsets, with the global
estimate (a node keeps its offset, not its segment's content kind: 8 bytes per node, not
a reference). A zone that spans a segment boundary (its snapshots between were dropped)
keeps the uniform mass: its offsets are not one interval of one segment.

NOTE 3 (end hits a tail in a faster tier still serves, ``hidden``). A session passing
the snapshot through a child whose KV sits in a tier above the last still has its tail
below in the cache's faster tiers: its end hit resumes from that tail's final snapshot
unless the tail has been demoted to the last tier and dropped by the time the session
returns. ``hidden[mask]`` (``eviction`` NOTE 7) is the share of such end hits the tail
still serves, by the KV tier mask of the child; the session counts ``1 − hidden`` of an
end access here. Only the first chunk below is read (a store or a promotion puts the
whole prompt path in a fast tier, and a tail leaves it whole or from its leaf up): one
look per child, no walk, and the child is what every move of it re-ranks around.

**The eviction score ``H`` and the online calibration of its recency scale ``τ``.**


**Why not the paper's ``H = t + τ·C/M`` as is.** ``t`` is a time and ``C/M`` a ratio of
token counts; ``τ`` converts one into the other, so its right value depends on the
trace: on how many sessions share the cache (the paper's hit-position model divides
``C`` by the number of live sessions) and on how long sessions idle between requests.
Measured on the shared Weka subset at 1/8 of the paper's CPU+disk
(``benchmarks/sim_eviction.md``): with ``τ = 600 s`` and 21–83 sessions in the index, the
cost term ``τ·C/M`` of the victims had a median of 0.003 s (p99 4.7–15 s) while the
sessions' re-access gaps had a median of 13.5 s and a mean of 64 s: ``H`` was LRU.

**The model behind the score.** Evicting unit ``x`` loses ``C_x`` recompute tokens each
time a session that needs ``x`` comes back. Whether it comes back is what recency
estimates: we take the probability that a unit idle for ``a = now − t`` seconds is still
going to be read as ``exp(−a/T)``, ``T`` the mean gap between consecutive accesses of a
session (the exponential model with the observed mean, the maximum-likelihood fit). The
expected loss per byte freed is then ``exp(−a/T) · C/M``; the victim is the unit where
it is lowest. Taking ``T · ln(·)`` (monotone) and adding ``now`` (the same for every
unit) gives the ranking key::

    H = t + τ · ln(C / M),      τ = T (seconds; observed online)

Lowest ``H`` goes first, as in the paper, and ``τ`` has a meaning that does not depend
on the trace: **one e-fold of expected loss per byte is worth τ seconds of recency**,
and ``τ`` is the sessions' own re-access scale, measured, not tuned.

* Scale-free: multiplying every ``C`` by a constant (e.g. ``1/N`` for ``N`` sessions, or
  tokens → seconds of prefill at any constant rate) adds the same ``τ·ln k`` to every
  ``H`` and changes no decision. So ``C`` here is per re-access of the sessions whose
  hits need the unit (``expected_recompute``), with no ``1/N``.
* ``τ = 0`` is LRU (``H = t``), whatever ``C``.
* ``C = 0`` (a dead tail: nothing can hit in it) is floored at ``MIN_RATIO``: such units
  go before anything that can still be hit unless that is more than
  ``−ln(MIN_RATIO) ≈ 20.7`` re-access scales older.

**Worked example** (``τ = 60 s``, ``p_end = 0.95``, ``N_s = 1,572`` token units).
* A session's final bundle (its last 4,224-token segment plus its final snapshot):
  ``C = 4,224 · 0.95 = 4,013`` tokens, ``M = 4,224 + 1,572 = 5,796``, ``ln(C/M) = −0.37``.
* An intermediate snapshot on disk with the same spacing, one session through it,
  remaining internal-hit mass 0.5: ``C = 4,224 · (0.05 · 0.5 + 0.95 · 1) = 4,118``
  (its end hits count: the resume point once the tail below has left, NOTE
  1), ``M = 1,572``, ``ln(C/M) = +0.96``. Its ``H`` is ``60 · (0.96 + 0.37) = 80 s``
  above the bundle's at equal ``t``: a cold session leaves from its tail, one interval
  at a time, and an idle session's bundle goes before an active session's history
  snapshot unless it is more than 80 s more recent.
* An intermediate snapshot one 528-token chunk after the previous one (Figure 7's S2):
  ``C = 528 · 0.975 = 515``, ``ln(515/1,572) = −1.12``: ``60 · (1.12 − 0.37) = 45 s``
  *below* the bundle at equal ``t``: a snapshot that saves little recompute goes before
  the final bundle of a session waiting on a tool, which is the paper's Figure 7.
(The second example prices the end hits as if the tail below had left. While that tail
is in a tier above the last, ``exposed_ends`` weights them by the chance it has left the
cache when the session returns, ``exp(−S/τ)`` with ``S`` the tiers' measured dwell
times: at ``S = 340 s``, ``C = 119.5``, ``ln(119.5/1,572) = −2.58``, 133 s below the bundle
at equal ``t`` (``eviction`` NOTE 7).)
With the paper's form, ``τ = 600 s`` and ``C`` divided by 65 sessions, the gap between
the bundle and an internal-hit-only snapshot (``C = 4,224 · 0.05 · 0.5 = 106``) was
``600 · (4,013/5,796 − 106/1,572) / 65 = 5.8 s``: a few seconds of recency, i.e. LRU.

NOTE 4 (calibration). ``T`` is an EMA of the gaps between consecutive accesses of the
same session (``begin`` of request ``i+1`` minus ``begin`` of request ``i``: think time,
prefill and decode), seeded by its first sample as ``ResidenceTracker`` does. Before any
gap was seen there is no evidence of a recency scale and ``τ = 0`` (LRU).
NOTE 5 (drift). ``τ`` and ``p_end`` drift with every sample; queued ranks are not
re-computed for it (that is O(n)). A candidate is re-ranked when it reaches the top of a
heap (``EvictionQueue.victim``), so drift delays a unit's turn by at most the drift of
its own ``H`` since it was last ranked.
NOTE 6 (which tiers rank by cost). Moving a unit one tier down loses nothing but
speed, and that loss is the same per byte for every unit (``C ∝ M``: ``ln(C/M)`` one
constant, ``H`` = ``t`` + a constant), which argued for recency in every tier but the
last. That argument misses what the order of demotions decides in an exclusive
hierarchy: a unit leaves the cache from the last tier, and which units reach the last
tier first is decided by the tiers above it. With only the last tier ranked by cost,
``C`` chose among the oldest bytes of the cache, a window the size of the last tier.
So every tier HiState manages ranks by ``H`` (the paper's placement: "KV moves to disk
only when CPU memory is full, by the eviction ranking"); only the engine's own block
pool ranks by recency (``CacheConfig.recency_tiers``: the simulator's GPU tier; vLLM's
prefix cache is LRU and HiState does not rank its blocks). Measured on the whole Weka
folder at 1/8 of the paper's CPU+disk, with recency from release and the last tier
deciding by ``H`` (``placement`` NOTE 1), at three load offsets (sessions 55, 60, 65 s
apart), mean TTFT: CPU by recency 8.05 / 8.12 / 8.06 s, CPU by ``H`` 7.92 / 7.62 / 7.78 s
(``file-lru`` 8.46 / 8.04 / 9.01 s); the GPU ranked by ``H`` as well 7.84 s (60 s
apart): it pushed active sessions' history out of the engine's pool, as measured before
on the compressed subset (``benchmarks/sim_eviction.md``).
NOTE 7 (calibrating on whether a session returns; ``ReturnScale``, the
``histate-return-tau`` row). The mean gap ``T`` says how soon a session that returns does
so; eviction needs whether a session idle ``a`` seconds returns at all, and the two
differ when gaps are heavy-tailed and some sessions never return. On the shared Weka
subset (``benchmarks/sim_pressure.md``): mean gap 40 s, median 13-14 s, yet a session
unread 150 s comes back with probability 0.69, where ``exp(−150/T)`` says 0.08. A single
``τ`` fits ``P(return | idle a) = exp(−a/τ)`` at one idle only, so it is fitted at the age
where the last tier decides: ``D``, the dwell times of every tier summed (``eviction``
NOTE 7: how long a unit unread since it was stored sits before it leaves the cache).
Among the idles that reached ``D``, those that ended in a return are the gaps longer
than ``D`` (counted in log bins, ``GAP_BINS_PER_DOUBLING`` to a doubling: ``D``'s own bin,
a 4.4 % band, counts as not longer); those that did not are the sessions idle longer
than ``D`` now (a session that never returns stays in that count; one that will return
is counted until it does). With ``b`` and ``p`` those counts, the Krichevsky-Trofimov
estimate ``r = (b + ½)/(b + p + 1)`` (never 0 or 1) gives ``τ = D / −ln r``. Before
anything has left the last tier ``D`` is unmeasured and ``τ`` is the mean gap ``T``
(NOTE 4). The estimate is redone once per ``max(1, sessions)`` gaps (it scans the
sessions and the bins), so its cost per access is amortised O(1).
Worked example: ``D = 150 s``; 188 gaps longer than 150 s, 83 sessions idle longer
(those that ended): ``r = 188.5/272 = 0.693``, ``τ = 150/0.367 = 409 s``, against
``T = 40 s``. A bundle unread 150 s then sits ``150/409 = 0.37`` e-folds below a fresh
one, not ``150/40 = 3.75``.
Measured (``benchmarks/sim_pressure.md``, last section, 3 and 5 repeats): ``τ`` ends a
replay at 371-405 s; ahead of the mean-gap ``τ`` beyond the spread at 48 sessions × 1/4
of the paper's CPU+disk, behind it within the spread at 24 sessions and at 48 × 1/8, the
same at × 1 and × 1/2. So it is a row (``histate-return-tau``), not the default.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from enum import Enum
from typing import Protocol

from .ema import DEFAULT_ALPHA, SeededEMA
from .hit_positions import HitPositions
from .index import Node

__all__ = [
    "END_PROBABILITY_PRIOR",
    "GAP_BINS_PER_DOUBLING",
    "KIND_BUNDLE",
    "KIND_DEAD",
    "KIND_SNAPSHOT",
    "MIN_RATIO",
    "HitModel",
    "ReaccessScale",
    "ReturnScale",
    "UnitKind",
    "expected_recompute",
    "freed_in",
    "log_ratio",
    "score",
    "tail_chain",
    "tier_bytes",
    "unit_kind",
    "unit_nodes",
    "unit_parts",
]

END_PROBABILITY_PRIOR = 0.9
"""``p_end`` before any access was seen (``CacheConfig.end_probability_prior``'s default)."""


class UnitKind(Enum):
    SNAPSHOT = "snapshot"
    BUNDLE = "bundle"
    DEAD = "dead"


# The members as module constants, for the hot paths: on Python 3.11 reading
# ``UnitKind.SNAPSHOT`` calls the enum's member descriptor (~0.2 µs, measured; a module
# constant ~0.02 µs), and every re-rank compares kinds several times.
KIND_SNAPSHOT, KIND_BUNDLE, KIND_DEAD = UnitKind.SNAPSHOT, UnitKind.BUNDLE, UnitKind.DEAD


class HitModel:
    """Online estimate of how accesses are spread over a session's context."""

    __slots__ = ("alpha", "end_probability", "samples")

    def __init__(
        self,
        alpha: float = DEFAULT_ALPHA,
        prior: float = END_PROBABILITY_PRIOR,
    ) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior must be in [0, 1], got {prior}")
        self.alpha = alpha
        self.end_probability = prior
        self.samples = 0

    def observe(self, at_end: bool) -> None:
        """Record whether an access continued its session from the end of its context."""
        self.end_probability += self.alpha * ((1.0 if at_end else 0.0) - self.end_probability)
        self.samples += 1


def unit_kind(node: Node) -> UnitKind | None:
    """The kind of unit anchored at ``node``, or None if no unit is anchored there."""
    if node.kv_tiers and not node.kv_children:  # a KV leaf: KV, and no child with KV
        return KIND_BUNDLE if node.snap_tiers else KIND_DEAD
    if node.snap_tiers:
        return KIND_SNAPSHOT
    return None


def tail_chain(leaf: Node) -> Iterator[Node]:
    """KV nodes freed with the tail unit anchored at ``leaf`` (leaf first)."""
    node = leaf
    while True:
        yield node
        parent = node.parent
        if parent is None or parent.depth < 0 or parent.snap_tiers or parent.kv_children != 1:
            return
        node = parent


def unit_parts(anchor: Node, *, alone: bool) -> tuple[Node | None, Iterable[Node]]:
    """``(snapshot node or None, KV nodes, lazily)`` that leave a tier with the unit at
    ``anchor``; ``alone`` when it leaves the last tier (dropped), not when it is demoted.

    The one statement of what a unit is made of (``unit_nodes`` lists it; the queue's
    pin check and its bytes-in-one-tier walk it: each runs for every victim). The
    snapshot node, when there is one, is ``anchor``; the KV nodes are ``tail_chain(anchor)``
    (``anchor`` first), except that an intermediate snapshot dropped ``alone`` carries
    none: dropping must keep KV prefix-closed. Demoting breaks nothing, so there an
    intermediate snapshot also carries the KV segment above it: otherwise KV lying
    between two snapshots would belong to no unit until every snapshot below it is gone,
    and it could never leave a fast tier.
    """
    kind = unit_kind(anchor)
    if kind is None:
        return None, ()
    if kind is KIND_SNAPSHOT:
        return anchor, () if alone else tail_chain(anchor)
    return (anchor if kind is KIND_BUNDLE else None), tail_chain(anchor)


def freed_in(anchor: Node, tier: int, *, alone: bool) -> int:
    """Bytes the unit at ``anchor`` frees in ``tier``: its ``unit_parts`` there (``alone``
    out of the last tier). 0 where no unit is anchored."""
    snap, chain = unit_parts(anchor, alone=alone)
    bit = 1 << tier
    freed = snap.snap_bytes if snap is not None and snap.snap_tiers & bit else 0
    for node in chain:  # a loop, not sum(<generator>): this runs for every victim
        if node.kv_tiers & bit:
            freed += node.kv_bytes
    return freed


def tier_bytes(
    anchor: Node, kind: UnitKind, last: int, tiers_of: Sequence[tuple[int, ...]]
) -> tuple[list[int], Node]:
    """``(bytes freed in each tier 0 … last, top of the KV walk)`` of the unit at
    ``anchor``, of ``kind`` (``unit_kind``); ``tiers_of[mask]`` lists the tiers in ``mask``
    (a table: this runs for every re-ranked unit).

    Every tier but the last demotes (a snapshot unit carries its KV segment); the
    last drops (a snapshot unit goes alone): ``unit_parts`` in every tier at once.
    Objects sit on one tier each, except final snapshots with a write-through copy. The
    KV walk is ``tail_chain`` inlined (this runs for every re-ranked unit); its top
    (``anchor`` when it is not walked) has no snapshot between it and ``anchor``, so the
    queue starts the cost's search for the previous snapshot there
    (``expected_recompute``'s ``above``) instead of walking the segment again.
    """
    out = [0] * (last + 1)
    if kind is not KIND_DEAD:
        for t in tiers_of[anchor.snap_tiers]:
            out[t] += anchor.snap_bytes
    if kind is KIND_SNAPSHOT and last == 0:
        return out, anchor
    # A snapshot unit's KV does not leave the last tier with it (it goes alone).
    kv_mask = ~(1 << last) if kind is KIND_SNAPSHOT else -1
    # Bytes are summed per run of nodes on the same tiers (a segment mostly sits on one
    # tier) and added to ``out`` once per run: integers, so any order is exact.
    node = anchor
    mask, run = node.kv_tiers & kv_mask, 0
    while True:
        if node.kv_tiers & kv_mask != mask:
            for t in tiers_of[mask]:
                out[t] += run
            mask, run = node.kv_tiers & kv_mask, 0
        run += node.kv_bytes
        parent = node.parent
        if parent is None or parent.depth < 0 or parent.snap_tiers or parent.kv_children != 1:
            for t in tiers_of[mask]:
                out[t] += run
            return out, node
        node = parent


def unit_nodes(anchor: Node, *, demote: bool = False) -> tuple[Node | None, list[Node]]:
    """``unit_parts`` with the KV nodes listed (leaf first); ``demote`` = not ``alone``."""
    snap, chain = unit_parts(anchor, alone=not demote)
    return snap, list(chain)


def expected_recompute(
    node: Node,
    chunk_tokens: int,
    end_probability: float,
    attention_tokens: float = math.inf,
    positions: HitPositions | None = None,
    above: Node | None = None,
    hidden: Sequence[float] | None = None,
) -> float:
    """``C`` of the snapshot at ``node``: expected extra recompute if it goes.

    ``above``, if given, is where the search for the previous snapshot may start: ``node``
    or an ancestor with no snapshot between the two (the top of ``tail_chain(node)``,
    which a caller that walked it already holds).

    In linear-token equivalents: every loss counted here is the recompute of
    ``[p_prev, p)``, which with causal attention costs ``a·δ + b·(p² − p_prev²)/2``
    seconds, i.e. ``δ · (1 + (p + p_prev) / (2K))`` tokens at the linear rate ``a``,
    ``K = a/b`` = ``attention_tokens`` (the context length where attention costs as much
    per token as the rest; ``inf`` = tokens only).

    Walks the snapshot's *zone* (descendants reachable without crossing another
    snapshot): sessions ending in the zone lose ``p - p_prev`` on internal hits in
    ``[p, P_s)``; sessions passing a boundary snapshot at ``q`` lose it on internal hits
    in ``[p, q)``, whose mass is ``(q - p) · weight(q)``. Every session passing the
    snapshot (``node.passes``) loses it on an end access once its tail is gone (module
    NOTE 1); with ``hidden``, the sessions leaving it through a child whose KV is in a
    tier above the last count ``1 − hidden[child.kv_tiers]`` of one (NOTE 3).

    With measured hit ``positions`` each internal mass is scaled by the mean relative
    hit density over the zone's offsets in its segment (``HitPositions.zone_factor``,
    NOTE 2): from the snapshot's offset (0 if it closes its segment: the zone opens the
    next one) to the boundary snapshot's, or to the segment's end for a session ending
    in the zone.
    """
    if not node.snap_tiers:
        return 0.0
    p = (node.depth + 1) * chunk_tokens
    # The nearest snapshot above the search's start (or the root): a walk up.
    prev = (node if above is None else above).parent
    while prev is not None and prev.depth >= 0 and not prev.snap_tiers:
        prev = prev.parent
    delta = p - (0 if prev is None or prev.depth < 0 else (prev.depth + 1) * chunk_tokens)
    lo = node.seg_offset
    measured = positions is not None and lo >= 0.0
    if lo >= 1.0:
        lo = 0.0
    to_end = positions.zone_factor(lo, 1.0) if measured else 1.0  # type: ignore[union-attr]
    children_of_node = node.children
    internal = 0.0
    stack: list[Node] = []
    q: Node | None = node
    while True:
        # Depth first, the last child without a snapshot next (not through the stack:
        # a zone is mostly a chain), the others stacked: the order, and so the sum's
        # rounding, of a plain stack walk.
        if q is None:
            if not stack:
                break
            q = stack.pop()
        ends, children = q.ends, q.children  # each read once: this runs per re-rank
        if ends:
            for session in ends:
                if session.end_tokens > p:
                    internal += to_end * (session.end_tokens - p) / session.end_tokens
        q = None
        if children:
            for child in children.values():
                if child.snap_tiers:
                    mass = ((child.depth + 1) * chunk_tokens - p) * child.weight
                    hi = child.seg_offset
                    if measured and lo < hi <= 1.0:
                        mass *= positions.zone_factor(lo, hi)  # type: ignore[union-attr]
                    internal += mass
                else:
                    if q is not None:
                        stack.append(q)
                    q = child
    passes: float = node.passes
    if hidden is not None and children_of_node:
        # NOTE 3: a session whose tail below starts in a fast tier resumes from that
        # tail unless it has left the cache by the time the session returns.
        for child in children_of_node.values():
            passes -= hidden[child.kv_tiers] * child.passes
    mass = (1.0 - end_probability) * internal + end_probability * passes
    return delta * mass * (1.0 + (2 * p - delta) / (2.0 * attention_tokens))

MIN_RATIO = 1e-9
# NOTE 7: gaps are counted in log bins this many to a doubling (4.4 % wide), from
# ``_GAP_FLOOR_S`` up (``_GAP_BINS`` of them: 2^40 ms, about 35 years).
GAP_BINS_PER_DOUBLING = 16
_GAP_FLOOR_S = 1e-3
_GAP_BINS = 40 * GAP_BINS_PER_DOUBLING


def log_ratio(cost: float, freed: float) -> float:
    """``ln(max(C/M, MIN_RATIO))``: the term ``τ`` scales in ``H`` (``M <= 0`` counts as
    the floor), as a shared index publishes it for its own script to rank by."""
    ratio = cost / freed if freed > 0 else 0.0
    return math.log(ratio if ratio > MIN_RATIO else MIN_RATIO)


def score(access: float, cost: float, freed: float, tau: float) -> float:
    """``H = t + τ · ln(max(C/M, MIN_RATIO))`` (module docstring); ``τ = 0`` gives ``t``."""
    if tau <= 0.0:
        return access
    return access + tau * log_ratio(cost, freed)


class ReaccessScale(SeededEMA):
    """EMA of the gaps between consecutive accesses of a session: the score's ``τ``."""

    __slots__ = ()

    @property
    def gap_ema(self) -> float:
        return self.value

    @property
    def tau(self) -> float:
        """Seconds of recency per e-fold of expected loss per byte (0 until observed)."""
        return self.value

    def observe_at(self, gap: float, now: float) -> None:
        """One gap, ending at ``now`` (the time is for ``ReturnScale``; here it is unused)."""
        self.observe(gap)


class _Idle(Protocol):
    last_access: float | None


def gap_bin(gap: float) -> int:
    """The log bin of a gap of ``gap`` seconds (NOTE 7); gaps under the floor go in bin 0."""
    if gap <= _GAP_FLOOR_S:
        return 0
    k = int(GAP_BINS_PER_DOUBLING * math.log2(gap / _GAP_FLOOR_S)) + 1
    return k if k < _GAP_BINS else _GAP_BINS - 1


class ReturnScale(ReaccessScale):
    """``τ`` fitted to whether a session idle ``D`` seconds returns (NOTE 7).

    ``sessions``: every known session by id (their ``last_access``, the index's own map);
    ``dwell``: the eviction queue's dwell EMAs per tier (``eviction`` NOTE 7), bound by the
    cache after the queue is built. The EMA of the gaps (``gap_ema``) is kept: it is ``τ``
    until something has left the last tier.
    """

    __slots__ = ("_bins", "_due", "_tau", "dwell", "sessions")

    def __init__(self, alpha: float, sessions: Mapping[str, _Idle]) -> None:
        super().__init__(alpha)
        self.sessions = sessions
        self.dwell: Sequence[SeededEMA] = ()
        self._bins = [0] * _GAP_BINS
        self._due = 0
        self._tau = 0.0

    @property
    def tau(self) -> float:
        return self._tau

    def observe_at(self, gap: float, now: float) -> None:
        self.observe(gap)
        self._bins[gap_bin(gap)] += 1
        if self.samples < self._due:
            return
        reach = self.reach()
        if reach <= 0.0:
            self._tau = self.value  # due again at the next gap
        else:
            self._tau = self.estimate(reach, now)
            self._due = self.samples + max(1, len(self.sessions))

    def reach(self) -> float:
        """``D``: the tiers' dwell times summed, 0 until something has left the last tier."""
        dwell = self.dwell
        if not dwell or not dwell[-1].samples:
            return 0.0
        return sum([d.value for d in dwell])

    def estimate(self, reach: float, now: float) -> float:
        """``τ = D / −ln r`` with ``D = reach`` at ``now`` (NOTE 7)."""
        back = sum(self._bins[gap_bin(reach) + 1 :])
        gone = sum(
            1
            for s in self.sessions.values()
            if s.last_access is not None and now - s.last_access > reach
        )
        return reach / -math.log((back + 0.5) / (back + gone + 1.0))
