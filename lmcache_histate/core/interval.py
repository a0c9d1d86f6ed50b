"""Interval control: how densely to snapshot a newly added context segment.

For a segment of ``L`` new tokens we save a recurrent-state snapshot every ``I`` tokens
(plus, always, at the segment's end). A denser interval shortens the recompute after a
hit that lands inside the segment; a sparser one stores fewer snapshots. With the hit
position uniform inside the segment the expected recompute is ≈ ``I/2`` tokens and the
storage is ``L/I`` snapshots of ``N_s`` KV-token units each, weighted by the pressure
factor ``F``. Minimising ``I/2 + F·N_s·L/I`` gives the paper's continuous optimum
``I* = sqrt(2·L·N_s·F)``.

``F = EMA(KV residence) / EMA(snapshot residence)``: when snapshots are evicted sooner
than KV, the snapshot tier is the tight one, so ``F`` grows and snapshots get sparser.
While no snapshot has left the cache ``F`` is ``initial_factor`` (default 0: every chunk
gets a snapshot); once snapshots leave but no KV has, ``F`` is 1 (NOTE 2).

The engine can only capture states at multiples of its block (chunk) size, so the choice
is the supported interval with the lowest cost (the one next to ``I*`` on the convex
cost curve). The segment's start is covered by the previous segment's final snapshot.

The price of a step end. A recurrent state exists only where a prefill step ends, and
the engine ends a step every ``B`` tokens anyway (its step budget, rounded down to whole
blocks: ``step_tokens``). A planned state on that grid is free; one between grid points
costs one more step end (the engine's scheduler ends a step there and goes on). With a
snapshot every ``I`` tokens from the segment start, each run of ``I`` tokens takes
``ceil(I/B)`` steps, so the segment takes ``(L/I)·ceil(I/B)`` steps instead of ``L/B``:
``(L/I)·(ceil(I/B) − I/B)`` extra step ends, at most one per snapshot and none when ``B``
divides ``I``. At ``σ`` (``step_price``: the fixed time of one step, beyond its per-token
work, in tokens of prefill time) the cost is

    cost(I) = I/2 + F·N_s·L/I + σ·(L/I)·(ceil(I/B) − I/B).

Worked example (Qwen3.5-9B on an H100, ``lmcache_histate/data/cost_model_qwen35_9b_h100
.yaml``; block N = C = 528, ``N_s`` = 1,572 KV tokens): vLLM's OpenAI-server budget 8,192
gives ``B`` = 15 blocks = 7,920 tokens; ``σ`` = 2 ms step overhead (``sim/capture.py``
``STEP_OVERHEAD_S``) / 80 µs per prefill token = 25 tokens. A 32K segment (L = 60C =
31,680) at F = 1: without the step term the best interval is 19C = 10,032 (cost 5,016 +
4,964.2 = 9,980.2; 18C: 4,752 + 5,240.0 = 9,992.0; 20C: 5,280 + 4,716.0 = 9,996.0). With
it, 19C costs 25·(31,680/10,032)·(ceil(19/15) − 19/15) = 25·3.158·0.733 = 57.9 more
(10,038.1), and 15C = B, on the grid, costs 3,960 + 6,288.0 + 0 = 10,248.0; 20C: 25·3·(2 −
20/15) = 50.0 more (10,046.0); 18C: 25·3.333·0.8 = 66.7 (10,058.7): the choice stays 19C
(three snapshots, two extra step ends, 4 ms). The price moves the choice when the interior
states are many and the curve is flat; at F = 0 it decides it (NOTE 3).

NOTE 1 (a warp per segment). Measured hit positions (``hit_positions``) are offsets inside
one segment, so their warp applies to the segment a request appends, not to the whole
span it recomputes: when eviction took the states of earlier segments the recomputed span
covers several of them, and one warp over it would put the segments' hit clusters at
the span's two ends only. The earlier part keeps the plain grid, plus a state where the
new segment starts (the previous request's final state, recomputed). Measured effect:
``benchmarks/sim_eviction.md`` (it does not rescue the whole-folder loss at 1/8).

NOTE 2 (free storage). The storage term prices a snapshot by what it displaces, and the
residence times measure that only once something has been displaced. A snapshot tier
that has never evicted a snapshot has room: storing one more displaces nothing, so its
price is 0, which is also ``T_KV / T_state`` read literally (a snapshot residence that
has not ended is longer than any observed KV one). Free storage does not make a step end
free, and with the storage term gone nothing in the paper's cost bounds the step ends:
``I/2`` alone is least at one state per chunk, which would end every prefill step after
one block for every request while the cache warms up (in the H100 example a 32K segment
would take 60 steps instead of 4: 56 more step ends, 112 ms). So at ``F = 0`` with a
step grid the step ends are weighed against what they buy, per prefill (NOTE 3); where
their price is unknown (``step_price`` 0: a live server before the engine's step
scheduler has measured it, or behind an engine without that scheduler) the choice is
among the intervals that cost no step end (multiples of ``B``, the longest supported one
if none is); without a step grid it is one state per chunk. The live engine measures
``σ`` as the fixed time of a step over its time per prefill token, from its own busy
steps (``backends/vllm/step_scheduler.py``: ``StepPriceFit``), and sends it with each plan request
(``HiStateCache.set_step_grid``). The first snapshot that leaves starts the average and
the paper's cost follows it.
Snapshots leaving while no KV has is evidence the snapshot side is the tighter one, but
not of by how much: ``F`` stays at the neutral 1 until KV leaves too. A deployment that
would rather start from the paper's neutral factor sets ``initial_pressure_factor: 1``.

NOTE 3 (free storage on a priced step grid). The step price is paid on every prefill of
the segment; the recompute a state saves is collected only by an access that lands
inside the segment. So at ``F = 0`` both are priced per prefill, the recompute weighted
by ``q = 1 − p_end``, the measured share of accesses that land inside their session's
context instead of continuing it from its end (``rank.HitModel``: an EMA over every
access, prior ``p_end`` 0.9):

    cost₀(I) = q·I/2 + σ·(L/I)·(ceil(I/B) − I/B)        (``free_storage_cost``)

(the storage term is 0: NOTE 2). A state between two grid points is planned only where
the recompute it saves, weighted by ``q``, exceeds the step end it costs: for ``I < B``
the minimiser of the smooth form is ``I ≈ √(2σL/q)``. With ``q = 0`` every interval
costs its step ends alone and the choice is ``B`` (the smallest interval with none):
the grid. One-block steps come back only where they pay: ``I = C`` beats ``2C`` iff
``q·C/2 > σ·L/(2C)``, i.e. ``q > σ·(L/C)/C``; at the H100's ``σ/C`` = 25/528 that takes
``q > 0.047`` per chunk of the segment (a 16-chunk segment would need ``q > 0.76``;
``q ≤ 1`` never allows it above 21 chunks); whatever the choice, a planned state costs
at most one extra step end (``ceil(I/B) − I/B < 1``).
Worked example (H100: C = 528, B = 15C = 7,920, σ = 25; an 8K turn, L = 16C = 8,448):
with the grid alone the states are at 7,920 and 8,448, and a hit uniform in the segment
recomputes (7,920²/2 + 528²/2)/8,448 = 3,729 tokens. A fresh server (``q`` = 0.1, the
prior) costs 1C: 26.4 + 25·16·(14/15) = 399.7; 2C: 52.8 + 25·8·(13/15) = 226.1; 3C:
79.2 + 25·5.333·(12/15) = 185.9; 4C: 105.6 + 25·4·(11/15) = 178.9; 5C: 132 + 25·3.2·
(10/15) = 185.3; 15C: 396 + 0 = 396: the choice is 4C, states at 2,112, 4,224, 6,336
and 8,448: four steps instead of two (two extra step ends, 50 tokens, 4 ms) for an
expected recompute of 1,056 tokens (2,673 fewer, 267.3 per prefill at ``q`` = 0.1). At
``q`` = 0.03 (the Weka folder's ``p_end`` ≈ 0.97): 5C: 39.6 + 53.3 = 92.9; 6C: 47.5 +
25·2.667·0.6 = 87.5; 7C: 55.4 + 25·2.286·(8/15) = 85.9; 8C: 63.4 + 25·2·(7/15) = 86.7;
15C: 118.8: 7C, states at 3,696, 7,392 and 8,448 (one extra step end). What it leaves
out: the live scheduler pins a planned state's block from its step end until its store
has the data, and the simulator charges each mid-prefill state's device → host copy
(``sim/capture.py``: 51.5 MB at 50 GB/s, 1 ms ≈ 13 tokens at the H100's 80 µs); neither
is priced here (a live ``σ`` is the engine's measured step time only). Nor is the room
a denser plan takes: storage is free only until the tier fills, and a denser start may
fill it sooner (not traced: on the bundled Weka sample at 2 + 2 + 4 GiB,
``tests/data/pinned``, HiState's mean goes 0.476 → 0.499 s against the grid alone, at the
paper's capacities 0.237 → 0.230 s). At
``F > 0`` the step term is added to the paper's per-hit cost unweighted (the example
above): against the recompute a step end weighs ``q`` times less there than here;
pricing both per prefill would divide ``σ`` by ``q`` at every factor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import partial

from .ema import DEFAULT_ALPHA, check_alpha, seeded_step
from .hit_positions import HitPositions
from .rank import HitModel

__all__ = [
    "INITIAL_PRESSURE_FACTOR",
    "MAX_INTERVAL_CHUNKS",
    "IntervalController",
    "ResidenceTracker",
    "check_step_price",
    "check_step_tokens",
    "supported_intervals",
]

INITIAL_PRESSURE_FACTOR = 0.0
"""The pressure factor until a snapshot has left the cache (NOTE 2; storage is free)."""
MAX_INTERVAL_CHUNKS = 64
"""The longest interval offered, in chunks, without a list of supported intervals."""


def check_step_tokens(step_tokens: int | None, chunk_tokens: int) -> int | None:
    """``step_tokens`` if it is None or a positive multiple of ``chunk_tokens``, else
    ``ValueError`` naming both."""
    if step_tokens is not None and (
        isinstance(step_tokens, bool) or not isinstance(step_tokens, int)
        or step_tokens <= 0 or step_tokens % chunk_tokens
    ):
        raise ValueError(
            f"step_tokens must be a positive multiple of the chunk size {chunk_tokens} "
            f"(the step budget rounded down to whole chunks), got {step_tokens!r}"
        )
    return step_tokens


def check_step_price(step_price: float) -> float:
    """``step_price`` as a float if it is a finite number ≥ 0, else ``ValueError``."""
    if isinstance(step_price, bool) or not isinstance(step_price, int | float) \
            or not 0.0 <= step_price < math.inf:
        raise ValueError(f"step_price must be a finite number ≥ 0, got {step_price!r}")
    return float(step_price)


class ResidenceTracker:
    """Exponential moving averages of how long KV chunks and snapshots stay cached.

    Fed by eviction events (``residence = evicted_at - stored_at``). ``initial_factor`` is
    the pressure factor until a snapshot has left (NOTE 2).
    """

    __slots__ = (
        "alpha", "initial_factor", "kv_ema", "kv_samples", "snapshot_ema", "snapshot_samples"
    )

    def __init__(
        self,
        alpha: float = DEFAULT_ALPHA,
        initial_factor: float = INITIAL_PRESSURE_FACTOR,
    ) -> None:
        self.alpha = check_alpha(alpha)
        if not 0.0 <= initial_factor < math.inf:
            raise ValueError(f"initial_factor must be a finite number ≥ 0, got {initial_factor}")
        self.initial_factor = float(initial_factor)
        self.kv_ema = 0.0
        self.snapshot_ema = 0.0
        self.kv_samples = 0
        self.snapshot_samples = 0

    def observe_kv(self, residence: float) -> None:
        self.kv_ema = self._update(self.kv_ema, self.kv_samples, residence)
        self.kv_samples += 1

    def observe_snapshot(self, residence: float) -> None:
        self.snapshot_ema = self._update(self.snapshot_ema, self.snapshot_samples, residence)
        self.snapshot_samples += 1

    def _update(self, ema: float, samples: int, value: float) -> float:
        return seeded_step(ema, samples, value, self.alpha)

    @property
    def pressure_factor(self) -> float:
        """``T_KV / T_state``: ``initial_factor`` until a snapshot has left the cache, 1
        until KV has too (NOTE 2)."""
        if self.snapshot_samples == 0:
            return self.initial_factor
        if self.kv_samples == 0:
            return 1.0
        if self.snapshot_ema <= 0.0:
            return 1.0 if self.kv_ema <= 0.0 else 1e6
        return max(self.kv_ema / self.snapshot_ema, 1e-6)


def supported_intervals(
    chunk_tokens: int, max_multiple: int = MAX_INTERVAL_CHUNKS
) -> tuple[int, ...]:
    """Every multiple of the engine's chunk size up to ``max_multiple`` chunks."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if max_multiple <= 0:
        raise ValueError(f"max_multiple must be positive, got {max_multiple}")
    return tuple(chunk_tokens * k for k in range(1, max_multiple + 1))


@dataclass(frozen=True, slots=True)
class IntervalChoice:
    interval: int
    continuous_optimum: float
    pressure_factor: float
    cost: float


class IntervalController:
    """Chooses a segment's snapshot interval from ``supported`` (token counts)."""

    __slots__ = (
        "chunk_tokens", "hits", "residence", "snapshot_tokens", "step_price", "step_tokens",
        "supported",
    )

    def __init__(
        self,
        chunk_tokens: int,
        snapshot_tokens: float,
        supported: Sequence[int] | None = None,
        residence: ResidenceTracker | None = None,
        step_tokens: int | None = None,
        step_price: float = 0.0,
        hits: HitModel | None = None,
    ) -> None:
        """``step_tokens``: the engine's step grid ``B`` (its step budget rounded down to
        whole chunks; None: unknown, steps priced 0); ``step_price``: ``σ``, one step end's
        fixed time in tokens of prefill time (module docstring; 0: unpriced, NOTE 2);
        ``hits``: where accesses land (``q = 1 − p_end``, NOTE 3; None: a fresh
        ``HitModel`` at its prior)."""
        if snapshot_tokens <= 0:
            raise ValueError(f"snapshot_tokens (N_s) must be positive, got {snapshot_tokens}")
        self.step_tokens = check_step_tokens(step_tokens, chunk_tokens)
        self.step_price = check_step_price(step_price)
        self.chunk_tokens = chunk_tokens
        self.snapshot_tokens = float(snapshot_tokens)
        sup = tuple(sorted(set(supported))) if supported else supported_intervals(chunk_tokens)
        bad = [i for i in sup if i <= 0 or i % chunk_tokens]
        if bad:
            raise ValueError(
                f"supported intervals must be positive multiples of the chunk size "
                f"{chunk_tokens}; got {bad}"
            )
        self.supported = sup
        self.residence = residence if residence is not None else ResidenceTracker()
        self.hits = hits if hits is not None else HitModel()

    @property
    def pressure_factor(self) -> float:
        return self.residence.pressure_factor

    def continuous_optimum(self, segment_tokens: float, factor: float | None = None) -> float:
        f = self.pressure_factor if factor is None else factor
        return math.sqrt(2.0 * segment_tokens * self.snapshot_tokens * f)

    def cost(self, interval: int, segment_tokens: float, factor: float | None = None) -> float:
        """The paper's model: ``I/2`` expected recompute + ``F · N_s · L/I`` storage.

        The smooth form is used on purpose: its minimiser over the supported set is the
        supported interval next to ``I*`` on the convex curve, which is how the paper
        states the rule, and it does not flip between neighbours on rounding artefacts of
        where the segment happens to end.
        """
        f = self.pressure_factor if factor is None else factor
        if segment_tokens <= 0:
            return 0.0
        return (interval / 2.0 + f * self.snapshot_tokens * segment_tokens / interval
                + self.step_price * self.extra_step_ends(interval, segment_tokens))

    def extra_step_ends(self, interval: int, segment_tokens: float) -> float:
        """Step ends a snapshot every ``interval`` tokens adds to a segment's prefill:
        ``(L/I)·(ceil(I/B) − I/B)``; 0 without a step grid or when ``B`` divides ``I``."""
        grid = self.step_tokens
        if grid is None or segment_tokens <= 0:
            return 0.0
        return segment_tokens / interval * (-(-interval // grid) - interval / grid)

    @property
    def internal_probability(self) -> float:
        """``q = 1 − p_end``: the measured probability that an access lands inside its
        session's context instead of continuing it from its end (``rank.HitModel``)."""
        return 1.0 - self.hits.end_probability

    def free_storage_cost(self, interval: int, segment_tokens: float) -> float:
        """The cost at ``F = 0`` on a priced step grid (NOTE 3): ``q·I/2`` expected
        recompute per prefill of the segment + ``σ`` per extra step end."""
        if segment_tokens <= 0:
            return 0.0
        return (self.internal_probability * interval / 2.0
                + self.step_price * self.extra_step_ends(interval, segment_tokens))

    def choose(self, segment_tokens: float, factor: float | None = None) -> IntervalChoice:
        f = self.pressure_factor if factor is None else factor
        candidates = self.supported
        cost: Callable[[int], float] = partial(self.cost, segment_tokens=segment_tokens, factor=f)
        step = self.step_tokens
        if f == 0.0 and step is not None:
            if self.step_price > 0.0:
                # NOTE 3: storage is free and a step end is not; both priced per prefill.
                cost = partial(self.free_storage_cost, segment_tokens=segment_tokens)
            else:
                # NOTE 2: a step end of unknown price: only the states that cost none.
                free = tuple(i for i in candidates if i % step == 0)
                candidates = free or (max(candidates),)
        best = min(candidates, key=lambda i: (cost(i), i))
        return IntervalChoice(
            interval=best,
            continuous_optimum=self.continuous_optimum(segment_tokens, f),
            pressure_factor=f,
            cost=cost(best),
        )

    def boundaries(
        self,
        start_tokens: int,
        end_tokens: int,
        factor: float | None = None,
        positions: HitPositions | None = None,
        kind: Hashable = None,
        segment_start: int | None = None,
    ) -> list[int]:
        """Token positions (chunk-aligned, in ``(start, end]``) whose states to save.

        ``end_tokens`` is rounded down to the chunk grid: states exist only at chunk ends.
        The last one is the segment's final snapshot and is always included.
        With measured hit ``positions`` (of content ``kind``) the interval is chosen for
        the segment's effective length ``s²·L`` and the grid is laid in the warped
        coordinate and mapped back (``hit_positions``: snapshots ∝ √(hit density));
        uniform positions give exactly the plain grid. The measured offsets are relative
        to the segment the request appends, which starts at ``segment_start``; context
        recomputed before it (its cached states were evicted: earlier segments) gets the
        plain grid up to there and a state where the new segment starts (NOTE 1).
        """
        chunk = self.chunk_tokens
        end = end_tokens - end_tokens % chunk
        # The previous segment's final state sits on the chunk grid at or below its end.
        start = start_tokens - start_tokens % chunk
        if end <= start:
            return []
        split = start
        if segment_start is not None:
            split = max(start, segment_start - segment_start % chunk)
        if positions is None or split >= end:
            interval = self.choose(end - start, factor).interval
            return [*range(start + interval, end, interval), end]
        head: list[int] = []
        if split > start:
            interval = self.choose(end - start, factor).interval
            head = [*range(start + interval, split, interval), split]
            start = split
        return head + self._warped(start, end, factor, positions, kind)

    def _warped(
        self, start: int, end: int, factor: float | None, positions: HitPositions, kind: Hashable
    ) -> list[int]:
        """The measured-positions grid of one segment ``[start, end)`` (chunk-aligned)."""
        chunk = self.chunk_tokens
        length = end - start
        warped = positions.effective_length(length, kind)
        interval = self.choose(warped, factor).interval
        points: list[int] = []
        j = 1
        while j * interval < warped:
            offset = positions.warp(j * interval / warped, kind)
            pos = start + round(offset * length / chunk) * chunk
            if start < pos < end and (not points or pos > points[-1]):
                points.append(pos)
            j += 1
        points.append(end)
        return points
