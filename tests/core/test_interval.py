"""Interval control: the brief's worked example and the discrete choice."""

from __future__ import annotations

import math

import pytest

from lmcache_histate.core.interval import (
    IntervalController,
    ResidenceTracker,
    supported_intervals,
)


def test_continuous_optimum_matches_brief_example() -> None:
    ctl = IntervalController(chunk_tokens=1, snapshot_tokens=100, supported=[1])
    assert ctl.continuous_optimum(8000, factor=1.0) == pytest.approx(1264.9, abs=0.1)
    assert ctl.continuous_optimum(8000, factor=4.0) == pytest.approx(2529.8, abs=0.1)
    # Factor 4 doubles the optimum.
    assert ctl.continuous_optimum(8000, 4.0) == pytest.approx(2 * ctl.continuous_optimum(8000, 1.0))


@pytest.mark.parametrize(("factor", "expected"), [(1.0, 1056), (4.0, 2640)])
def test_choice_is_nearest_supported_interval(factor: float, expected: int) -> None:
    ctl = IntervalController(chunk_tokens=528, snapshot_tokens=100)
    choice = ctl.choose(8000, factor)
    assert choice.interval == expected
    nearest = min(ctl.supported, key=lambda i: abs(i - choice.continuous_optimum))
    assert choice.interval == nearest
    # And it is the exact minimiser of the discrete cost over the supported set.
    assert choice.cost == min(ctl.cost(i, 8000, factor) for i in ctl.supported)


def test_pressure_factor_from_residence_times() -> None:
    res = ResidenceTracker(alpha=0.5)
    ctl = IntervalController(chunk_tokens=528, snapshot_tokens=100, residence=res)
    assert ctl.pressure_factor == 1.0  # no evidence yet
    res.observe_kv(400.0)
    assert ctl.pressure_factor == 1.0  # snapshots never left yet
    res.observe_snapshot(100.0)
    assert ctl.pressure_factor == pytest.approx(4.0)
    assert ctl.choose(8000).interval == 2640
    # Snapshots evicted even sooner: sparser snapshots.
    res.observe_snapshot(20.0)
    assert ctl.pressure_factor > 4.0
    assert ctl.choose(8000).interval >= 2640


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
