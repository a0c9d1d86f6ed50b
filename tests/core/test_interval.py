"""Interval control: the brief's worked example and the discrete choice."""

from __future__ import annotations

import math

import pytest

from lmcache_histate.core.interval import (
    IntervalController,
    ResidenceTracker,
    supported_intervals,
)
from lmcache_histate.core.rank import HitModel


def test_continuous_optimum_matches_brief_example() -> None:
    ctl = IntervalController(chunk_tokens=1, snapshot_tokens=100, supported=[1])
    assert ctl.continuous_optimum(8000, factor=1.0) == pytest.approx(1264.9, abs=0.1)
    assert ctl.continuous_optimum(8000, factor=4.0) == pytest.approx(2529.8, abs=0.1)
    # Factor 4 doubles the optimum.
    assert ctl.continuous_optimum(8000, 4.0) == pytest.approx(2 * ctl.continuous_optimum(8000, 1.0))


@pytest.mark.parametrize(
    ("factor", "expected", "cost"),
    [
        # F = 1: I* = √(2·8,000·100) = 1,264.9, between 1,056 and 1,584:
        #   1,056 → 528 + 800,000/1,056 = 528 + 757.575758 = 1,285.575758;
        #   1,584 → 792 + 505.050505 = 1,297.050505 → 1,056.
        (1.0, 1056, 1285.575758),
        # F = 4: I* = 2,529.8: 2,112 → 1,056 + 3,200,000/2,112 = 2,571.151515;
        #   2,640 → 1,320 + 1,212.121212 = 2,532.121212; 3,168 → 2,594.101010 → 2,640.
        (4.0, 2640, 2532.121212),
    ],
)
def test_choice_is_nearest_supported_interval(factor: float, expected: int, cost: float) -> None:
    ctl = IntervalController(chunk_tokens=528, snapshot_tokens=100)
    choice = ctl.choose(8000, factor)
    assert choice.interval == expected
    assert choice.cost == pytest.approx(cost, abs=1e-6)
    assert choice.pressure_factor == factor
    # I* = √(2·8,000·100·F): 1,264.911 (F = 1), 2,529.822 (F = 4).
    assert choice.continuous_optimum == pytest.approx(1264.911 * math.sqrt(factor), abs=1e-3)


def test_pressure_factor_from_residence_times() -> None:
    res = ResidenceTracker(alpha=0.5)
    ctl = IntervalController(chunk_tokens=528, snapshot_tokens=100, residence=res)
    assert ctl.pressure_factor == 0.0  # no snapshot has left: storing one is free
    assert ctl.choose(8000).interval == 528  # the densest grid: one state per chunk
    res.observe_kv(400.0)  # the first sample seeds the average: 400 (not 0.5·400)
    assert ctl.pressure_factor == 0.0  # snapshots still never left
    res.observe_snapshot(100.0)  # seeds: 100
    assert ctl.pressure_factor == 4.0  # 400 / 100
    assert ctl.choose(8000).interval == 2640
    # Snapshots evicted even sooner: 100 + 0.5·(20 − 100) = 60 → F = 400/60 = 6.666667,
    # sparser snapshots: I* = √(2·8,000·100·6.666667) = 3,266.0: 3,168 → 1,584 +
    # 5,333,333/3,168 = 1,584 + 1,683.5 = 3,267.5; 3,696 → 1,848 + 1,443.0 = 3,291.0;
    # 2,640 → 1,320 + 2,020.2 = 3,340.2 → 3,168.
    res.observe_snapshot(20.0)
    assert (res.snapshot_ema, res.kv_ema) == (60.0, 400.0)
    assert ctl.pressure_factor == pytest.approx(400 / 60)
    assert ctl.choose(8000).interval == 3168


def test_residence_averages_are_seeded_by_their_first_sample() -> None:
    # α = 0.05: the first KV sample is the average (30), the second moves it by 5 %:
    # 30 + 0.05·(10 − 30) = 29. Unseeded, the average would start at 0.05·30 = 1.5.
    res = ResidenceTracker(alpha=0.05)
    res.observe_kv(30.0)
    assert res.kv_ema == 30.0
    res.observe_kv(10.0)
    assert res.kv_ema == pytest.approx(29.0)
    assert res.kv_samples == 2
    res.observe_snapshot(8.0)
    assert (res.snapshot_ema, res.snapshot_samples) == (8.0, 1)
    assert res.pressure_factor == pytest.approx(29.0 / 8.0)


def test_the_interval_is_chosen_from_the_new_segment_not_the_context() -> None:
    """A 1,000-token segment at the end of a 10,000-token context (chunk 100, N_s = 50).

    Cost I/2 + 50·L/I with L = 1,000: I* = √100,000 = 316.2; 300 → 150 + 166.67 =
    316.67, 400 → 200 + 125 = 325 → 300: states at 9,300, 9,600, 9,900 and the final
    10,000. (Chosen from the whole context, L = 10,000, I* = 1,000 would leave only the
    final one.)
    """
    ctl = IntervalController(chunk_tokens=100, snapshot_tokens=50)
    assert ctl.boundaries(9000, 10000, factor=1.0) == [9300, 9600, 9900, 10000]
    # A segment that starts mid-chunk starts on the grid below (the previous final):
    # 9,050 → 9,000, and an end mid-chunk is rounded down: 10,040 → 10,000.
    assert ctl.boundaries(9050, 10040, factor=1.0) == [9300, 9600, 9900, 10000]


def test_boundaries_are_chunk_aligned_and_end_with_final() -> None:
    ctl = IntervalController(chunk_tokens=528, snapshot_tokens=100)
    points = ctl.boundaries(1000, 9100, factor=1.0)
    assert all(p % 528 == 0 for p in points)
    assert points[-1] == 9100 - 9100 % 528
    step = ctl.choose(points[-1] - 528, factor=1.0).interval  # segment starts at 1000 → 528
    assert points[0] == 528 + step
    gaps = [b - a for a, b in zip(points, points[1:], strict=False)][:-1]  # noqa: RUF007
    assert gaps and all(g == step for g in gaps)
    assert ctl.boundaries(1000, 1050) == []


def test_bad_inputs_are_rejected_with_clear_messages() -> None:
    with pytest.raises(ValueError, match="multiples of the chunk size 528"):
        IntervalController(chunk_tokens=528, snapshot_tokens=100, supported=[500])
    with pytest.raises(ValueError, match="N_s"):
        IntervalController(chunk_tokens=528, snapshot_tokens=0)
    assert supported_intervals(528, 3) == (528, 1056, 1584)
    assert math.isclose(IntervalController(528, 100).continuous_optimum(0), 0.0)


def test_supported_intervals_and_the_cost_of_nothing() -> None:
    assert supported_intervals(1, 1) == (1,)
    with pytest.raises(ValueError, match="chunk_tokens must be positive, got 0"):
        supported_intervals(0)
    with pytest.raises(ValueError, match="max_multiple must be positive, got 0"):
        supported_intervals(528, 0)
    ctl = IntervalController(chunk_tokens=10, snapshot_tokens=50)
    assert ctl.cost(100, 0) == 0.0  # an empty segment costs nothing
    assert ctl.cost(100, 1, 1.0) == 50.0 + 50 * 1 / 100  # I/2 + F·N_s·L/I, F = 1
    assert ctl.cost(100, 1) == 50.0  # F = 0 (nothing has left the cache): I/2 alone


def test_an_explicit_factor_overrides_the_measured_pressure() -> None:
    """Measured F = 4 (KV 400 s, snapshots 100 s); the segment of the test above with
    F = 1 given explicitly still gets interval 300, and F = 4 (I* = √400,000 = 632.5):
    600 → 300 + 333.3 = 633.3, 700 → 350 + 285.7 = 635.7 → 600: 9,600 and the final."""
    res = ResidenceTracker()
    res.observe_kv(400.0)
    res.observe_snapshot(100.0)
    ctl = IntervalController(chunk_tokens=100, snapshot_tokens=50, residence=res)
    assert ctl.boundaries(9000, 10000, factor=1.0) == [9300, 9600, 9900, 10000]
    assert ctl.boundaries(9000, 10000) == [9600, 10000]
    assert ctl.cost(600, 1000) == pytest.approx(300 + 4 * 50 * 1000 / 600)


def test_counts_small_samples_and_the_factor_of_a_choice() -> None:
    """Samples below 1 s are kept (0.5, then 0.5 + 0.05·(0.25 − 0.5) = 0.4875); every
    snapshot sample is counted (2). A choice reports the factor it used: measured
    F = 0.4875 / 0.25 = 1.95 when none is given, else the given one."""
    res = ResidenceTracker(alpha=0.05)
    res.observe_kv(0.5)
    assert res.kv_ema == 0.5
    res.observe_snapshot(0.25)
    res.observe_snapshot(0.25)
    res.observe_kv(0.25)
    assert res.kv_ema == pytest.approx(0.4875)
    assert (res.snapshot_ema, res.snapshot_samples) == (0.25, 2)
    ctl = IntervalController(chunk_tokens=10, snapshot_tokens=50, residence=res)
    assert ctl.choose(1000).pressure_factor == pytest.approx(1.95)
    assert ctl.choose(1000, factor=3.0).pressure_factor == 3.0


def test_snapshots_leaving_before_any_kv_give_the_neutral_factor() -> None:
    """Snapshot samples without a KV one: the snapshot side is tighter, by an unknown
    amount: F = 1 (interval NOTE 2), so an 8,000-token segment with N_s = 100 gets the
    F = 1 choice of the test above (1,056), not the densest grid (528)."""
    res = ResidenceTracker()
    ctl = IntervalController(chunk_tokens=528, snapshot_tokens=100, residence=res)
    res.observe_snapshot(5.0)
    assert ctl.pressure_factor == 1.0
    assert ctl.choose(8000).interval == 1056


def test_the_initial_factor_holds_until_a_snapshot_leaves() -> None:
    """``initial_factor`` 1 (the paper's neutral start): F = 1 with no samples and with KV
    samples only; the first snapshot sample replaces it with the measured ratio
    (KV 400 s / snapshots 100 s = 4). Negative or infinite initial factors are refused."""
    res = ResidenceTracker(alpha=0.5, initial_factor=1.0)
    assert res.pressure_factor == 1.0
    res.observe_kv(400.0)
    assert res.pressure_factor == 1.0
    res.observe_snapshot(100.0)
    assert res.pressure_factor == 4.0
    for bad in (-0.5, math.inf):
        with pytest.raises(ValueError, match="initial_factor must be a finite number ≥ 0"):
            ResidenceTracker(initial_factor=bad)


# The step price: Qwen3.5-9B on an H100 (module docstring's worked example): C = 528,
# N_s = 1,572, step grid B = 15C = 7,920 (budget 8,192 in whole blocks), σ = 25 tokens.
H100_CHUNK = 528


def h100(step_price: float = 0.0, hits: HitModel | None = None) -> IntervalController:
    return IntervalController(H100_CHUNK, 1572, step_tokens=15 * H100_CHUNK,
                              step_price=step_price, hits=hits)


def test_extra_step_ends_are_zero_on_the_grid_and_below_one_per_snapshot_off_it() -> None:
    ctl = h100(step_price=25)
    seg = 60 * H100_CHUNK  # 31,680 tokens
    assert ctl.extra_step_ends(15 * H100_CHUNK, seg) == 0.0
    assert ctl.extra_step_ends(30 * H100_CHUNK, seg) == 0.0
    # 19C: 31,680 / 10,032 = 3.1579 snapshots, each 2 − 19/15 = 0.7333 extra: 2.3158.
    assert ctl.extra_step_ends(19 * H100_CHUNK, seg) == pytest.approx(2.315789, abs=1e-6)
    # One block: 60 snapshots x (1 − 1/15) = 56 extra steps (60 steps instead of 4).
    assert ctl.extra_step_ends(H100_CHUNK, seg) == pytest.approx(56.0)


def test_the_step_price_enters_the_cost_and_the_worked_example_keeps_19_chunks() -> None:
    seg = 60 * H100_CHUNK
    priced, free = h100(step_price=25), h100(step_price=0)
    assert free.cost(19 * H100_CHUNK, seg, 1.0) == pytest.approx(5016 + 4964.210526, abs=1e-5)
    assert priced.cost(19 * H100_CHUNK, seg, 1.0) == pytest.approx(
        5016 + 4964.210526 + 25 * 2.315789, abs=1e-4)  # 10,038.1
    assert priced.cost(15 * H100_CHUNK, seg, 1.0) == pytest.approx(3960 + 6288)  # on the grid
    assert priced.cost(20 * H100_CHUNK, seg, 1.0) == pytest.approx(5280 + 4716 + 50)
    assert priced.choose(seg, 1.0).interval == free.choose(seg, 1.0).interval == 19 * H100_CHUNK


def test_a_high_step_price_moves_the_choice_onto_the_step_grid() -> None:
    # σ = 200: 19C costs 9,980.2 + 463.2 = 10,443.4, 20C 9,996 + 400 = 10,396,
    # 15C 10,248 + 0 -> 15C.
    assert h100(step_price=200).choose(60 * H100_CHUNK, 1.0).interval == 15 * H100_CHUNK


def test_free_storage_puts_a_state_at_every_step_end_not_every_chunk() -> None:
    """NOTE 2: F = 0 prices storage at 0, not step ends: with a step grid whose price is
    unknown (σ = 0) or with no access ever landing inside a context (q = 0) the plan is
    one state per step (I = B); without a grid it is one per chunk."""
    seg = 60 * H100_CHUNK
    at_end = HitModel(prior=1.0)  # q = 0: every access continues from its end
    assert h100(step_price=25, hits=at_end).boundaries(0, seg + 100, factor=0.0) == [
        7920, 15840, 23760, 31680]
    assert h100().choose(seg, 0.0).interval == 15 * H100_CHUNK  # σ = 0, at the prior q
    plain = IntervalController(H100_CHUNK, 1572)
    assert plain.choose(seg, 0.0).interval == H100_CHUNK
    # A segment shorter than one step: the final state only.
    assert h100().boundaries(0, 10 * H100_CHUNK, factor=0.0) == [10 * H100_CHUNK]


# NOTE 3's worked example: an 8K turn, L = 16C = 8,448, on the H100 grid at σ = 25.
TURN = 16 * H100_CHUNK


def test_free_storage_cost_is_the_weighted_recompute_plus_the_step_ends() -> None:
    """cost₀(I) = q·I/2 + σ·(L/I)·(ceil(I/B) − I/B) at the prior q = 0.1 (p_end 0.9):
    1C 26.4 + 25·16·14/15 = 399.733; 4C 105.6 + 25·4·11/15 = 178.933; 15C 396 + 0;
    16C 422.4 + 25·1·(2 − 16/15) = 445.733. An empty segment costs nothing."""
    ctl = h100(step_price=25)
    assert ctl.internal_probability == pytest.approx(0.1)
    assert ctl.free_storage_cost(H100_CHUNK, TURN) == pytest.approx(399.733333, abs=1e-5)
    assert ctl.free_storage_cost(4 * H100_CHUNK, TURN) == pytest.approx(178.933333, abs=1e-5)
    assert ctl.free_storage_cost(15 * H100_CHUNK, TURN) == pytest.approx(396.0)
    assert ctl.free_storage_cost(16 * H100_CHUNK, TURN) == pytest.approx(445.733333, abs=1e-5)
    assert ctl.free_storage_cost(4 * H100_CHUNK, 0) == 0.0
    # A 1-token segment at 4C: q·I/2 = 105.6 plus 1/2,112 snapshots x 11/15 extra ends.
    assert ctl.free_storage_cost(4 * H100_CHUNK, 1) == pytest.approx(
        105.6 + 25 / 2112 * 11 / 15)


@pytest.mark.parametrize(
    ("end_probability", "chunks", "plan", "cost"),
    [
        # q = 0.1: 2C 226.133, 3C 185.867, 4C 178.933, 5C 185.333 -> 4C.
        (0.9, 4, [2112, 4224, 6336, 8448], 178.933333),
        # q = 0.03: 6C 87.52, 7C 55.44 + 30.476 = 85.916, 8C 86.693, 15C 118.8 -> 7C.
        (0.97, 7, [3696, 7392, 8448], 85.916190),
        # q = 0: σ·extra alone, 0 on the grid -> 15C (the smallest with no step end).
        (1.0, 15, [7920, 8448], 0.0),
    ],
)
def test_free_storage_on_a_priced_grid_buys_states_the_hits_pay_for(
    end_probability: float, chunks: int, plan: list[int], cost: float
) -> None:
    ctl = h100(step_price=25, hits=HitModel(prior=end_probability))
    choice = ctl.choose(TURN, 0.0)
    assert choice.interval == chunks * H100_CHUNK
    assert choice.cost == pytest.approx(cost, abs=1e-5)
    assert choice.pressure_factor == 0.0
    assert ctl.boundaries(0, TURN + 100, factor=0.0) == plan


def test_the_free_storage_choice_follows_the_hit_model_it_is_given() -> None:
    """α = 0.5 from p_end 0.9: one internal access -> 0.45 (q = 0.55): 1C 145.2 + 373.333
    = 518.533, 2C 290.4 + 173.333 = 463.733, 3C 435.6 + 106.667 -> 2C; a second ->
    0.225 (q = 0.775 > σ·16/C = 0.758, NOTE 3): 1C 204.6 + 373.333 = 577.933 beats 2C
    409.2 + 173.333 = 582.533 -> one state per chunk. At F = 1 the paper's cost ignores q."""
    hits = HitModel(alpha=0.5, prior=0.9)
    ctl = h100(step_price=25, hits=hits)
    assert ctl.choose(TURN, 0.0).interval == 4 * H100_CHUNK
    at_one = ctl.choose(TURN, 1.0).interval
    hits.observe(False)
    assert ctl.internal_probability == pytest.approx(0.55)
    assert ctl.choose(TURN, 0.0).interval == 2 * H100_CHUNK
    hits.observe(False)
    assert ctl.choose(TURN, 0.0).interval == H100_CHUNK
    assert ctl.choose(TURN, 0.0).cost == pytest.approx(577.933333, abs=1e-5)
    assert ctl.choose(TURN, 1.0).interval == at_one


def test_free_storage_with_a_price_and_no_interval_on_the_grid_weighs_them_all() -> None:
    """Intervals 1C..4C only, q = 0 (p_end 1): no interval is free of step ends, so the
    price alone decides: 1C 25·16·14/15 = 373.3 ... 4C 25·4·11/15 = 73.3 -> 4C (the
    unpriced rule takes the longest too, test below)."""
    ctl = IntervalController(H100_CHUNK, 1572, [k * H100_CHUNK for k in (1, 2, 3, 4)],
                             step_tokens=15 * H100_CHUNK, step_price=25,
                             hits=HitModel(prior=1.0))
    choice = ctl.choose(TURN, 0.0)
    assert (choice.interval, choice.cost) == (4 * H100_CHUNK, pytest.approx(73.333333))


@pytest.mark.parametrize("bad", [{"step_tokens": 1000}, {"step_tokens": 0},
                                 {"step_tokens": 528, "step_price": -1.0}])
def test_step_settings_are_checked(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="step_"):
        IntervalController(H100_CHUNK, 1572, **bad)  # type: ignore[arg-type]


def test_step_grid_edges_one_token_chunks_non_integers_and_infinite_prices() -> None:
    """A 1-token grid on 1-token chunks is a grid (every token a step end); 2.0 or "64" is
    not an integer grid; an infinite step price is refused; the default price is 0 (a
    priced and an unpriced controller cost the same off the grid: 19C at F = 1)."""
    from lmcache_histate.core.cache import check_step_tokens

    assert check_step_tokens(1, 1) == 1
    assert check_step_tokens(None, 528) is None
    for bad in (1056.0, "1056", True):
        with pytest.raises(ValueError, match="step_tokens must be a positive multiple"):
            check_step_tokens(bad, 528)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step_price must be a finite number"):
        h100(step_price=math.inf)
    seg = 60 * H100_CHUNK
    assert h100().cost(19 * H100_CHUNK, seg, 1.0) == pytest.approx(5016 + 4964.210526, abs=1e-5)


def test_extra_step_ends_without_a_grid_or_segment_and_for_one_token() -> None:
    """No grid: 0 extra step ends; a 0-token segment: 0; one token at I = C on a 15C grid:
    1/528 snapshots x (1 − 1/15) = 0.0017677."""
    plain = IntervalController(H100_CHUNK, 1572)
    assert plain.extra_step_ends(H100_CHUNK, 60 * H100_CHUNK) == 0.0
    assert h100().extra_step_ends(H100_CHUNK, 0) == 0.0
    assert h100().extra_step_ends(H100_CHUNK, 1) == pytest.approx(1 / 528 * 14 / 15)


def test_free_storage_with_no_interval_on_the_grid_takes_the_longest() -> None:
    """F = 0 and a grid of 15C with intervals of 1C..4C only: none costs no step end, so
    the choice is the longest (4C: the fewest extra step ends)."""
    ctl = IntervalController(H100_CHUNK, 1572, [k * H100_CHUNK for k in (1, 2, 3, 4)],
                             step_tokens=15 * H100_CHUNK)
    assert ctl.choose(60 * H100_CHUNK, 0.0).interval == 4 * H100_CHUNK
