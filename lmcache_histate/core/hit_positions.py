"""Measured hit positions: where internal hits land inside a segment, learned online.

The paper prices a snapshot and spaces a segment's snapshots as if a hit that does not
continue a session from its end (an *internal* hit: a rewrite, a truncation, a retry)
landed uniformly inside the segment, and names that as a limitation. Agents truncate at
recurring places. Measured on the shared Weka folder (398 sessions, 24,108 requests,
64-token blocks): 1,578 requests diverge inside their session's earlier context, and the
offset of the divergence inside the segment it falls in (``u = (d − start)/(end −
start)``, ten bins) is ``233 53 16 18 17 47 157 120 349 568``: 58 % in the last fifth of
a segment, 15 % in its first tenth, 4 % in the middle fifth. By content type (the
``input_types`` of the request that appended the segment) a ``tool_result`` segment is
cut in its last fifth 83 % of the time, a ``text`` one 45 %.

**What is learned.** Per content *kind* (``None`` = unknown), counts ``n_b`` of the
offsets in ``B`` equal bins of ``[0, 1)``. The estimate is additive smoothing towards
the level above (the standard hierarchical Dirichlet-mean estimate, no constant to
tune beyond its strength ``B``, one pseudo-count per bin):

    global:  p_b = (n_b + 1) / (N + B)
    kind k:  p_kb = (n_kb + B · p_b) / (N_k + B)

With no data both are exactly uniform (the paper's model, the fallback); with ``N``
samples the data weigh ``N / (N + B)``. ``w_b = B · p_b`` is the relative density
(mean 1 over the segment; uniform = 1 everywhere).

**Where it is used.**

1. *Snapshot placement* (``warp``, ``spread``). Hits at density ``f(x)`` and snapshots
   at local density ``λ(x)`` lose ``∫ f / (2λ) dx`` tokens per hit (half the local
   spacing); for a fixed count ``∫ λ = k`` this is least at ``λ ∝ √f`` (Lagrange:
   ``f / (2λ²) = μ``), the classic companding rule, where it equals
   ``(∫ √f)² / (2k)``. In units of the segment, ``∫ √f dx = √L · s`` with
   ``s = (1/B) Σ_b √w_b ≤ 1`` (Cauchy–Schwarz; 1 iff uniform): the segment costs what a
   uniform segment of *effective length* ``L_eff = s² · L`` costs. So the interval
   controller chooses the interval ``I`` for ``L_eff`` (the paper's rule, unchanged),
   lays the uniform grid ``I, 2I, … < L_eff`` in the warped coordinate
   ``t = G(u) = (1/s) ∫_0^u √w``, and maps it back: snapshot ``j`` at
   ``u_j = G⁻¹(j · I / L_eff)``. Uniform ``w`` gives ``G = id``, ``L_eff = L``: exactly
   the paper's grid. This is the continuous form of placing checkpoints under a
   distribution of overlap depths, which "Sparse Prefix Caching for Hybrid and
   Recurrent LLM Serving" (arXiv 2605.05219) solves exactly with an O(N·M) dynamic
   program (we cite the idea from its abstract; its text was not available here).
   Ours is O(B) per segment, on the chunk grid by rounding.
2. *Cost* (``zone_factor``). A snapshot's internal-hit mass over its zone ``[p, q)`` is
   the uniform mass times the mean relative density over the zone's offsets,
   ``(W(u_q) − W(u_p)) / (u_q − u_p)``, ``W`` the CDF of ``w``.

**Worked example** (``B = 4``, kind ``None``, 12 observed offsets in bins
``(3, 0, 1, 8)``). ``p = (4, 1, 2, 9) / 16``, ``w = (1, 0.25, 0.5, 2.25)``,
``√w = (1, 0.5, 0.707, 1.5)``, ``s = 3.707 / 4 = 0.927``, ``s² = 0.859``. A segment of
``L = 8,448`` tokens costs like one of ``L_eff = 7,256``. If the controller picks
``I = 2,112`` for it, the warped grid is ``t = 0.291, 0.582, 0.873``; ``G`` at the bin
edges is ``(0, 0.270, 0.405, 0.595, 1)``, so ``u = 0.25 + (0.291 − 0.270)/(0.135·4) =
0.290``, ``u = 0.5 + (0.582 − 0.405)/(0.191·4) = 0.733``, ``u = 0.75 + (0.873 −
0.595)/(0.405·4) = 0.922``: snapshots at tokens 2,446, 6,189, 7,786 of the segment
(before rounding to chunks) instead of 2,112, 4,224, 6,336: denser where the hits are.

NOTE 1 (bins, not a parametric family). The measured shape is bimodal (start and end of
a segment) and kind-dependent; a histogram makes no assumption and costs O(B) per
estimate. ``B = 8`` bins: a segment is a few to a few dozen chunks, finer bins would
resolve nothing the chunk grid can express.
NOTE 2 (cached estimate). ``observe`` drops the cached tables (every kind backs off to
the global counts); a query rebuilds its kind's table once in O(B). Every query is O(B)
at most (O(log B) for ``G⁻¹``), independent of the number of sessions, nodes or samples.
NOTE 3 (segment offsets, not absolute depths). The offset is relative to the segment the
hit falls in (one request's appended input), which is what recurs across turns of an
agent (the end of a tool output, the start of a user message); absolute depths do not
recur across sessions.
NOTE 4 (off by default). ``CacheConfig.hit_positions`` is ``"uniform"`` unless set: in the
simulator this model won on the bundled sample at 2 GiB (mean TTFT −18 %) and on the
shared subset at 1/8 of the paper's CPU+disk (p99 −3 %) and on the whole Weka folder at
the paper's capacity (p99 −3.6 %), and lowered the whole folder's reuse-sensitive mean at
1/8, 1/4 and 1× (−3 to −4 %), but lost on its mean and p99 at 1/8 (+12 %, +7 %) and 1/4
(+8.5 %, +3.8 %), with placement alone and with ``C`` alone
(``benchmarks/sim_eviction.md``); why was not traced. One candidate, not
tested: with the divergence floored to the simulator's 528-token chunks (re-binned
offline), 31 % of the offsets above fall in a segment's first twentieth or before its
start, a flooring artefact this histogram cannot tell from a genuine early cut.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Hashable

__all__ = ["DEFAULT_BINS", "HitPositions", "SegmentLog"]

DEFAULT_BINS = 8


class _Table:
    """Derived per-kind tables: relative density, its CDF, and the √-warp's CDF."""

    __slots__ = ("cdf", "density", "spread", "warp_cdf")

    def __init__(self, probs: list[float]) -> None:
        bins = len(probs)
        self.density = [bins * p for p in probs]
        cdf = [0.0]
        for p in probs:
            cdf.append(cdf[-1] + p)
        self.cdf = cdf
        roots = [math.sqrt(w) for w in self.density]
        total = sum(roots)
        self.spread = total / bins
        warp = [0.0]
        for r in roots:
            warp.append(warp[-1] + r / total)
        warp[-1] = 1.0
        self.warp_cdf = warp


class HitPositions:
    """Online histogram of internal-hit offsets inside segments, per content kind."""

    __slots__ = ("_counts", "_tables", "bins", "samples")

    def __init__(self, bins: int = DEFAULT_BINS) -> None:
        if bins <= 0:
            raise ValueError(f"bins must be positive, got {bins}")
        self.bins = bins
        self.samples = 0
        self._counts: dict[Hashable, list[int]] = {}
        self._tables: dict[Hashable, _Table] = {}

    def observe(self, offset: float, kind: Hashable = None) -> None:
        """Record an internal hit at ``offset`` ∈ [0, 1) of a segment of ``kind``."""
        if not 0.0 <= offset < 1.0:
            raise ValueError(f"offset must be in [0, 1), got {offset}")
        b = int(offset * self.bins)  # < bins: offset < 1
        for key in {kind, None}:
            self._counts.setdefault(key, [0] * self.bins)[b] += 1
        self.samples += 1
        self._tables.clear()  # every kind backs off to the global counts

    def count(self, kind: Hashable = None) -> int:
        """Samples seen for ``kind`` (``None``: all kinds)."""
        return sum(self._counts.get(kind, ()))

    def probabilities(self, kind: Hashable = None) -> list[float]:
        """``p_b`` of ``kind`` (module docstring): smoothed towards the global estimate."""
        b = self.bins
        glob = self._counts.get(None)
        probs = [1 / b] * b if glob is None else [(n + 1) / (sum(glob) + b) for n in glob]
        own = self._counts.get(kind) if kind is not None else None
        if own is None:
            return probs
        n_kind = sum(own)
        return [(own[i] + b * probs[i]) / (n_kind + b) for i in range(b)]

    def _table(self, kind: Hashable) -> _Table:
        table = self._tables.get(kind)
        if table is None:
            table = self._tables[kind] = _Table(self.probabilities(kind))
        return table

    def density(self, kind: Hashable = None) -> list[float]:
        """Relative density ``w_b`` per bin (mean 1; all 1 = uniform)."""
        return list(self._table(kind).density)

    def spread(self, kind: Hashable = None) -> float:
        """``s = (1/B) Σ √w_b`` ∈ (0, 1]: a segment costs what one ``s²`` as long costs."""
        return self._table(kind).spread

    def effective_length(self, tokens: float, kind: Hashable = None) -> float:
        """``L_eff = s² · L`` (module docstring, placement)."""
        s = self._table(kind).spread
        return s * s * tokens

    def cumulative(self, u: float, kind: Hashable = None) -> float:
        """``W(u)``: the share of a segment's internal hits at offsets below ``u``
        (piecewise linear; ``u`` clamped to [0, 1])."""
        cdf = self._table(kind).cdf
        x = min(1.0, max(0.0, u)) * self.bins
        b = min(self.bins - 1, int(x))
        return cdf[b] + (cdf[b + 1] - cdf[b]) * (x - b)

    def mass(self, lo: float, hi: float, kind: Hashable = None) -> float:
        """``W(hi) − W(lo)``: the share of a segment's internal hits in offsets [lo, hi)."""
        return self.cumulative(hi, kind) - self.cumulative(lo, kind)

    def zone_factor(self, lo: float, hi: float, kind: Hashable = None) -> float:
        """Mean relative density over offsets [lo, hi) (1 for uniform, or if empty)."""
        if hi <= lo:
            return 1.0
        return self.mass(lo, hi, kind) / (hi - lo)

    def warp(self, t: float, kind: Hashable = None) -> float:
        """``G⁻¹(t)``: the offset at which the √-density's CDF reaches ``t`` ∈ [0, 1]."""
        edges = self._table(kind).warp_cdf  # strictly increasing: every p_b > 0
        t = min(1.0, max(0.0, t))
        b = min(self.bins - 1, bisect_right(edges, t) - 1)
        return (b + (t - edges[b]) / (edges[b + 1] - edges[b])) / self.bins


class SegmentLog:
    """One session's segments: where each starts (tokens) and its content kind.

    Segments are appended in order and tile the context ``[0, end)``; a rewrite at
    ``d`` keeps the segments that start below ``d`` and cuts the last of them at ``d``.
    ``locate`` is O(log segments).
    """

    __slots__ = ("end", "kinds", "starts")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.kinds: list[Hashable] = []
        self.end = 0

    def locate(self, position: int) -> tuple[float, Hashable] | None:
        """``(offset in its segment, the segment's kind)`` of a token ``position``
        inside the context, or None if it lies outside ``[0, end)``."""
        if not self.starts or not 0 <= position < self.end or position < self.starts[0]:
            return None
        i = bisect_right(self.starts, position) - 1
        stop = self.starts[i + 1] if i + 1 < len(self.starts) else self.end
        return (position - self.starts[i]) / (stop - self.starts[i]), self.kinds[i]

    def cut(self, position: int) -> None:
        """The context diverged at ``position``: forget what lies at or beyond it."""
        i = bisect_left(self.starts, position)
        del self.starts[i:]
        del self.kinds[i:]
        self.end = min(self.end, position)  # 0 when nothing is left: position ≤ 0

    def boundary(self, position: int) -> float:
        """The offset in (0, 1] of a state at the end of token ``position − 1`` (a
        snapshot at ``position``) in the segment it closes or lies in; -1 if outside."""
        if not self.starts or not self.starts[0] < position <= self.end:
            return -1.0
        i = bisect_left(self.starts, position) - 1
        stop = self.starts[i + 1] if i + 1 < len(self.starts) else self.end
        return (position - self.starts[i]) / (stop - self.starts[i])

    def append(self, end: int, kind: Hashable = None) -> None:
        """A request extended the context to ``end`` tokens with input of ``kind``."""
        if end > self.end:
            self.starts.append(self.end)
            self.kinds.append(kind)
            self.end = end
