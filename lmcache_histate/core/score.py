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
NOTE 3 (demotion is not loss). In a tier that is not the last, the victim moves one
tier down; nothing has to be recomputed. What it costs is that its bytes are read from
the slower tier the next time they are needed: ``(1/B_lower − 1/B_tier)`` seconds per
byte, the same for every byte of every unit, so ``C ∝ M``, ``ln(C/M)`` is one constant
for all units and ``H`` is ``t`` plus that constant: LRU over units. The cost term only
ranks where units leave the cache (the last tier's heap). Measured on the shared subset
at 1/16–1/4 of the paper's CPU+disk with the load compressed (``sim_eviction.md``),
ranking demotions by ``ln(C/M)`` too pushed active sessions' history out of the GPU in
favour of idle sessions' final bundles and lost to plain ``lru`` by up to 10 % on
reuse-sensitive requests.
"""

from __future__ import annotations

import math

from .ema import SeededEMA

__all__ = ["MIN_RATIO", "ReaccessScale", "score"]

MIN_RATIO = 1e-9


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
