"""Measured hit positions, the edges of what they drive: the interval's factor and the
new segment's start in the warped grid, a kind's own estimate, two grid points rounding
to one chunk, and C at the snapshot offsets 0 and 1. Every expected value is derived by
hand in the comment next to it (``test_hit_positions.py`` has the estimate itself)."""

from __future__ import annotations

import pytest

from lmcache_histate.core.hit_positions import HitPositions
from lmcache_histate.core.index import PrefixIndex
from lmcache_histate.core.interval import IntervalController
from lmcache_histate.core.rank import expected_recompute


def controller() -> IntervalController:
    """Chunks of 10 tokens, N_s = 1, intervals (10, 40): cost(I) = I/2 + F·L/I, so
    cost(10) < cost(40) iff 5 + F·L/10 < 20 + F·L/40 iff F·L < 200."""
    return IntervalController(chunk_tokens=10, snapshot_tokens=1, supported=[10, 40])


def test_the_factor_reaches_both_parts_of_a_measured_grid() -> None:
    """Context [100, 560), the new segment from 300; no hit measured yet (uniform, s = 1,
    identity warp). F = 0.4: the recomputed head [100, 300) is planned for the whole
    460 tokens (F·L = 184 < 200: I = 10), the segment [300, 560) for its 260 (104: 10):
    every chunk from 110 to 560. With the learned F (1, no samples) both would be 40."""
    got = controller().boundaries(100, 560, factor=0.4, positions=HitPositions(bins=4),
                                  segment_start=300)
    assert got == list(range(110, 561, 10))


def test_a_segment_start_inside_a_chunk_splits_at_that_chunks_start() -> None:
    """F = 1.5, context [100, 560), the new segment from token 305: the split is 300 (the
    chunk holding 305 starts there). Head: F·460 = 690 > 200: I = 40 -> 140, 180, 220,
    260, then 300; segment [300, 560): F·260 = 390: I = 40 -> 340, ..., 540 (j·40 < 260:
    j = 1..6), then 560."""
    got = controller().boundaries(100, 560, factor=1.5, positions=HitPositions(bins=4),
                                  segment_start=305)
    assert got == [140, 180, 220, 260, 300, 340, 380, 420, 460, 500, 540, 560]


def test_a_kind_plans_with_its_own_estimate() -> None:
    """B = 2, 998 hits at 0.75 of "tool" segments and 998 at 0.25 of "text" ones. Global
    counts (998, 998): p = (0.5, 0.5), uniform: L_eff = 6,000, I = 1,000, identity warp:
    2,000 + 1,000·j. "tool": own (0, 998) smoothed towards the global p:
    ((0 + 2·0.5) / 1,000, (998 + 1) / 1,000) = (0.001, 0.999), the estimate of
    test_placement_snaps_to_chunks_and_drops_duplicates: 6,000, 7,000, 8,000. "text"
    mirrors it: √w edges (0, 0.969332, 1), the same t = 0.313518, 0.627036, 0.940555 ->
    u = t / 0.969332 / 2 = 0.161720, 0.323440, 0.485160 -> 2,000 + 6,000·u = 2,970.3,
    3,940.6, 4,911.0 -> chunks 3,000, 4,000, 5,000."""
    h = HitPositions(bins=2)
    for _ in range(998):
        h.observe(0.75, "tool")
        h.observe(0.25, "text")
    ctl = IntervalController(chunk_tokens=1000, snapshot_tokens=10, supported=[1000])
    assert ctl.boundaries(2000, 8000, positions=h) == [3000, 4000, 5000, 6000, 7000, 8000]
    assert ctl.boundaries(2000, 8000, positions=h, kind="tool") == [6000, 7000, 8000]
    assert ctl.boundaries(2000, 8000, positions=h, kind="text") == [3000, 4000, 5000, 8000]


def test_two_grid_points_in_one_chunk_give_one_snapshot() -> None:
    """B = 2, hits 6 at 0.25 and 2 at 0.75: p = (7/10, 3/10), w = (1.4, 0.6), √w =
    (1.183216, 0.774597), s = 0.978906, s² = 0.958258; segment [0, 1,000), chunks of 100,
    I = 100: L_eff = 958.258, t_j = j · 0.104356 for j = 1..9. √w edge 0.604356. Below it
    u = t / (2 · 0.604356): u · 10 = j · 0.863357 = 0.86, 1.73, 2.59, 3.45, 4.32 -> chunks
    1, 2, 3, 3, 4; above it u = (1 + (t − 0.604356) / 0.395644) / 2: t_6..9 = 0.626134,
    0.730490, 0.834846, 0.939202 -> u · 10 = 5.28, 6.59, 7.91, 9.23 -> 5, 7, 8, 9. The
    fourth point lands in chunk 3 again and is dropped."""
    h = HitPositions(bins=2)
    for offset in (0.25,) * 6 + (0.75,) * 2:
        h.observe(offset)
    ctl = IntervalController(chunk_tokens=100, snapshot_tokens=10, supported=[100])
    assert ctl.boundaries(0, 1000, positions=h) == [100, 200, 300, 400, 500, 700, 800, 900,
                                                    1000]


def _tree(h_offsets: tuple[float, float, float]) -> list:  # type: ignore[type-arg]
    """test_cost_scales_internal_mass_by_the_zone_density's tree: chunks of 10 tokens,
    chain 1-6, snapshots after 2, 4 and 6 at the given segment offsets; session a ends at
    6 (60 tokens), b at 3 (35 tokens)."""
    index = PrefixIndex(10)
    n = index.insert_chain([1, 2, 3, 4, 5, 6])
    for node in n:
        index.set_kv(node, 1, 40, 0.0)
    for i, offset in zip((1, 3, 5), h_offsets, strict=True):
        index.set_snapshot(n[i], 1, 200, 0.0)
        n[i].seg_offset = offset
    index.set_session("a", n[5], 60)
    index.set_session("b", n[2], 35)
    return n


def test_cost_at_the_snapshot_offsets_zero_and_one() -> None:
    """Hits B = 2, two at 0.75: w = (0.5, 1.5), W(0.25) = 0.125, W(0.5) = 0.25.
    S2 at offset 0 (the zone starts its segment), S4 at 0.25: b's end hit in the zone
    is scaled by the density over [0, 1) = 1 (0.428571); S4's boundary mass
    (40 − 20)/60 = 0.333333 by W(0.25)/0.25 = 0.5: internal 0.595238, passes 2:
    C = 20 · (0.1 · 0.595238 + 0.9 · 2) = 37.190476 (uniform: 37.523810).
    S4 closing its segment (offset 1: its zone opens the next one, offsets from 0) with
    S6 at 0.5 of that segment: S6's mass (60 − 40)/60 = 0.333333 by W(0.5)/0.5 = 0.5:
    C = 20 · (0.1 · 0.166667 + 0.9) = 18.333333 (uniform: 18.666667)."""
    h = HitPositions(bins=2)
    h.observe(0.75)
    h.observe(0.75)
    n = _tree((0.0, 0.25, 1.0))
    assert expected_recompute(n[1], 10, 0.9, positions=h) == pytest.approx(37.190476, abs=1e-5)
    n = _tree((0.5, 1.0, 0.5))
    assert expected_recompute(n[3], 10, 0.9, positions=h) == pytest.approx(18.333333, abs=1e-5)
