"""The eviction score ``H`` and the online calibration of its recency scale ``τ``.

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
  hits need the unit (``units.expected_recompute``), with no ``1/N``.
* ``τ = 0`` is LRU (``H = t``), whatever ``C``.
* ``C = 0`` (a dead tail: nothing can hit in it) is floored at ``MIN_RATIO``: such units
  go before anything that can still be hit unless that is more than
  ``−ln(MIN_RATIO) ≈ 20.7`` re-access scales older.

**Worked example** (``τ = 60 s``, ``p_end = 0.95``, ``N_s = 1,572`` token units).
* A session's final bundle (its last 4,224-token segment plus its final snapshot):
  ``C = 4,224 · 0.95 = 4,013`` tokens, ``M = 4,224 + 1,572 = 5,796``, ``ln(C/M) = −0.37``.
* An intermediate snapshot on disk with the same spacing, one session through it,
  remaining internal-hit mass 0.5: ``C = 4,224 · (0.05 · 0.5 + 0.95 · 1) = 4,118``
  (its end hits count: the resume point once the tail below has left, ``units`` NOTE
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

NOTE 1 (calibration). ``T`` is an EMA of the gaps between consecutive accesses of the
same session (``begin`` of request ``i+1`` minus ``begin`` of request ``i``: think time,
prefill and decode), seeded by its first sample as ``ResidenceTracker`` does. Before any
gap was seen there is no evidence of a recency scale and ``τ = 0`` (LRU).
NOTE 2 (drift). ``τ`` and ``p_end`` drift with every sample; queued ranks are not
re-computed for it (that is O(n)). A candidate is re-ranked when it reaches the top of a
heap (``EvictionQueue.victim``), so drift delays a unit's turn by at most the drift of
its own ``H`` since it was last ranked.
NOTE 3 (which tiers rank by cost). Moving a unit one tier down loses nothing but
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
NOTE 4 (calibrating on whether a session returns; ``ReturnScale``, the
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
(NOTE 1). The estimate is redone once per ``max(1, sessions)`` gaps (it scans the
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
from collections.abc import Mapping, Sequence
from typing import Protocol

from .ema import SeededEMA

__all__ = ["GAP_BINS_PER_DOUBLING", "MIN_RATIO", "ReaccessScale", "ReturnScale", "score"]

MIN_RATIO = 1e-9
# NOTE 4: gaps are counted in log bins this many to a doubling (4.4 % wide), from
# ``_GAP_FLOOR_S`` up (``_GAP_BINS`` of them: 2^40 ms, about 35 years).
GAP_BINS_PER_DOUBLING = 16
_GAP_FLOOR_S = 1e-3
_GAP_BINS = 40 * GAP_BINS_PER_DOUBLING


def score(access: float, cost: float, freed: float, tau: float) -> float:
    """``H = t + τ · ln(max(C/M, MIN_RATIO))`` (module docstring); ``τ = 0`` gives ``t``."""
    if tau <= 0.0:
        return access
    ratio = cost / freed if freed > 0 else 0.0
    return access + tau * math.log(ratio if ratio > MIN_RATIO else MIN_RATIO)


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
    """The log bin of a gap of ``gap`` seconds (NOTE 4); gaps under the floor go in bin 0."""
    if gap <= _GAP_FLOOR_S:
        return 0
    k = int(GAP_BINS_PER_DOUBLING * math.log2(gap / _GAP_FLOOR_S)) + 1
    return k if k < _GAP_BINS else _GAP_BINS - 1


class ReturnScale(ReaccessScale):
    """``τ`` fitted to whether a session idle ``D`` seconds returns (NOTE 4).

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
        """``τ = D / −ln r`` with ``D = reach`` at ``now`` (NOTE 4)."""
        back = sum(self._bins[gap_bin(reach) + 1 :])
        gone = sum(
            1
            for s in self.sessions.values()
            if s.last_access is not None and now - s.last_access > reach
        )
        return reach / -math.log((back + 0.5) / (back + gone + 1.0))
