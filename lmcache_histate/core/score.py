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
