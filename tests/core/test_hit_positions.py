"""Measured hit positions (``core.hit_positions``): the estimate, its fallback, the
placement it drives, and how the request path feeds it. Every expected value is derived
by hand in the comment next to it."""

from __future__ import annotations

import math

import pytest

from lmcache_histate.core.cache import CacheConfig, HiStateCache
from lmcache_histate.core.hit_positions import HitPositions, SegmentLog
from lmcache_histate.core.index import PrefixIndex
from lmcache_histate.core.interval import IntervalController
from lmcache_histate.core.rank import expected_recompute
from lmcache_histate.core.tiers import TierSpec


def worked_example() -> HitPositions:
    """The module docstring's example: B = 4, offsets in bins (3, 0, 1, 8)."""
    h = HitPositions(bins=4)
    for b, n in enumerate((3, 0, 1, 8)):
        for _ in range(n):
            h.observe((b + 0.5) / 4)
    return h


def test_no_data_is_exactly_uniform() -> None:
    h = HitPositions(bins=8)
    assert h.probabilities() == [1 / 8] * 8  # (0 + 1) / (0 + 8)
    assert h.density() == [1.0] * 8
    assert h.spread() == 1.0 and h.effective_length(1000) == 1000.0
    assert h.warp(0.3) == pytest.approx(0.3, abs=1e-12)  # G = identity
    assert h.zone_factor(0.2, 0.7) == pytest.approx(1.0, abs=1e-12)
    assert (h.samples, h.count()) == (0, 0)


def test_worked_example_estimate() -> None:
    h = worked_example()
    # p_b = (n_b + 1) / (12 + 4) = (4, 1, 2, 9) / 16; w_b = 4 · p_b.
    assert h.probabilities() == [4 / 16, 1 / 16, 2 / 16, 9 / 16]
    assert h.density() == [1.0, 0.25, 0.5, 2.25]
    # s = (√1 + √0.25 + √0.5 + √2.25) / 4 = (1 + 0.5 + 0.70711 + 1.5) / 4 = 0.92678.
    assert h.spread() == pytest.approx((3.0 + math.sqrt(0.5)) / 4, abs=1e-12)
    # L_eff = s² · 8,448 = 0.858915 · 8,448 = 7,256.11.
    assert h.effective_length(8448) == pytest.approx(7256.114, abs=1e-3)
    # √w CDF edges: cumulative (1, 1.5, 2.20711, 3.70711) / 3.70711
    #   = 0.269752, 0.404628, 0.595372, 1. G⁻¹(0.5): bin 2, (2 + (0.5 − 0.404628)
    #   / 0.190744) / 4 = (2 + 0.5) / 4 = 0.625.
    assert h.warp(0.5) == pytest.approx(0.625, abs=1e-6)
    assert h.warp(0.0) == 0.0 and h.warp(1.0) == 1.0
    # W at bin edges (0, 0.25, 0.3125, 0.4375, 1): W(0.75) − W(0.5) = 0.125 over 0.25
    # of the segment: mean relative density 0.5 (= w_2).
    assert h.mass(0.5, 0.75) == pytest.approx(0.125, abs=1e-12)
    assert h.zone_factor(0.5, 0.75) == pytest.approx(0.5, abs=1e-12)
    # Mid-bin: W(0.875) = 0.4375 + 0.5625 · 0.5 = 0.71875; W(0.125) = 0.125.
    assert h.mass(0.125, 0.875) == pytest.approx(0.59375, abs=1e-12)
    assert h.zone_factor(0.6, 0.6) == 1.0  # empty zone


def test_worked_example_placement() -> None:
    """Module docstring: L = 8,448, I = 2,112 (the only supported interval), warped grid
    t = 2,112 / 7,256.11 · (1, 2, 3) = 0.291065, 0.582130, 0.873195 (4 · 2,112 ≥ L_eff):
    u1 = (1 + (0.291065 − 0.269752) / 0.134876) / 4 = 0.289505 → 8,448 · u1 = 2,445.7;
    u2 = (2 + (0.582130 − 0.404628) / 0.190744) / 4 = 0.732650 → 6,189.4;
    u3 = (3 + (0.873195 − 0.595372) / 0.404628) / 4 = 0.921654 → 7,786.1; then the end."""
    h = worked_example()
    ctl = IntervalController(chunk_tokens=1, snapshot_tokens=100, supported=[2112])
    assert ctl.boundaries(0, 8448, positions=h) == [2446, 6189, 7786, 8448]
    # Uniform: the plain grid 2,112, 4,224, 6,336 (8,448 is the end).
    assert ctl.boundaries(0, 8448) == [2112, 4224, 6336, 8448]
    assert ctl.boundaries(0, 8448, positions=HitPositions()) == [2112, 4224, 6336, 8448]


def test_the_warp_applies_to_the_new_segment_only() -> None:
    """A span [0, 12,672) whose new input starts at 4,224 (the states of the earlier
    context were evicted): the plain grid up to 4,224 (I = 2,112: 2,112), a state at
    4,224, then the worked example's warped grid over [4,224, 12,672) (L = 8,448):
    4,224 + (2,446, 6,189, 7,786) = 6,670, 10,413, 12,010, and the end."""
    h = worked_example()
    ctl = IntervalController(chunk_tokens=1, snapshot_tokens=100, supported=[2112])
    assert ctl.boundaries(0, 12672, positions=h, segment_start=4224) == [
        2112, 4224, 6670, 10413, 12010, 12672
    ]
    # The new input starts at or before the span: the whole span is warped.
    assert ctl.boundaries(4224, 12672, positions=h, segment_start=0) == [
        6670, 10413, 12010, 12672
    ]
    # It starts at the end (nothing new): the plain grid.
    assert ctl.boundaries(0, 8448, positions=h, segment_start=8448) == [2112, 4224, 6336, 8448]


def test_placement_snaps_to_chunks_and_drops_duplicates() -> None:
    """Chunks of 1,000 tokens, segment [2,000, 8,000), I = 1,000. Every observed hit in
    the last of 2 bins: p = (0 + 1, 998 + 1) / 1,000 = (0.001, 0.999), w = (0.002,
    1.998); s = (0.044721 + 1.413506) / 2 = 0.729114, s² = 0.531607, L_eff = 3,189.6:
    warped grid t = 1,000 · (1, 2, 3) / 3,189.6 = 0.313518, 0.627036, 0.940555.
    √w edges (0, 0.030668, 1): u = (1 + (t − 0.030668) / 0.969332) / 2 = 0.645901,
    0.807629, 0.969359 → 2,000 + 6,000 · u = 5,875.4, 6,845.8, 7,816.2 → chunks 6,000,
    7,000, 8,000: the last is the segment's end, so it is the final snapshot only."""
    h = HitPositions(bins=2)
    for _ in range(998):
        h.observe(0.75)
    ctl = IntervalController(chunk_tokens=1000, snapshot_tokens=10, supported=[1000])
    assert ctl.boundaries(2000, 8000, positions=h) == [6000, 7000, 8000]


def test_a_kind_backs_off_to_the_global_estimate() -> None:
    h = HitPositions(bins=2)
    h.observe(0.9, "tool_result")
    h.observe(0.95, "tool_result")
    h.observe(0.1, "text")
    h.observe(0.2, "text")
    h.observe(0.7)  # kind unknown: global only
    # Global n = (2, 3): p = (3/7, 4/7). tool_result: own (0, 2), N = 2:
    # ((0 + 2 · 3/7) / 4, (2 + 2 · 4/7) / 4) = (6/28, 22/28); text: own (2, 0):
    # ((2 + 6/7) / 4, (8/7) / 4) = (20/28, 8/28).
    assert h.spread() == pytest.approx((math.sqrt(6 / 7) + math.sqrt(8 / 7)) / 2)  # cached
    assert h.probabilities() == pytest.approx([3 / 7, 4 / 7])
    assert h.probabilities("tool_result") == pytest.approx([6 / 28, 22 / 28])
    assert h.probabilities("text") == pytest.approx([20 / 28, 8 / 28])
    assert h.probabilities("image") == pytest.approx([3 / 7, 4 / 7])  # never seen: global
    assert (h.count("tool_result"), h.count(), h.samples) == (2, 5, 5)
    # w = 2 · p = (12/28, 44/28); s = (√(12/28) + √(44/28)) / 2 = (0.654654 + 1.253566)
    # / 2 = 0.954110; L_eff of 100 tokens = 100 · s² = 91.0326.
    assert h.density("tool_result") == pytest.approx([12 / 28, 44 / 28])
    s = (math.sqrt(12 / 28) + math.sqrt(44 / 28)) / 2
    assert h.spread("tool_result") == pytest.approx(s)
    assert h.effective_length(100, "tool_result") == pytest.approx(100 * s * s)
    # √w edges (0, 0.654654 / 1.908220 = 0.343070, 1): G⁻¹(0.5) = (1 + (0.5 − 0.343070)
    # / 0.656930) / 2 = 0.619442.
    assert h.warp(0.5, "tool_result") == pytest.approx(0.619442, abs=1e-6)
    # tool_result: W(0.75) = 6/28 + 22/28 · 0.5 = 17/28, W(0.25) = 6/28 · 0.5 = 3/28.
    assert h.mass(0.25, 0.75, "tool_result") == pytest.approx(0.5, abs=1e-12)
    assert h.zone_factor(0.5, 1.0, "tool_result") == pytest.approx(22 / 14, abs=1e-12)


def test_queries_clamp_to_the_segment() -> None:
    h = worked_example()
    assert h.cumulative(0.0) == 0.0 and h.cumulative(1.0) == pytest.approx(1.0)
    assert h.cumulative(1.5) == pytest.approx(1.0) and h.cumulative(-0.5) == 0.0
    assert h.warp(1.5) == 1.0 and h.warp(-0.5) == 0.0
    one = HitPositions(bins=1)  # one bin: always uniform
    one.observe(0.3)
    assert one.density() == [1.0] and one.warp(0.4) == pytest.approx(0.4)


@pytest.mark.parametrize("offset", [-0.1, 1.0, 1.5])
def test_offsets_outside_a_segment_are_refused(offset: float) -> None:
    with pytest.raises(ValueError, match="offset"):
        HitPositions().observe(offset)


def test_a_hit_at_a_segment_start_counts_in_the_first_bin() -> None:
    h = HitPositions(bins=2)
    h.observe(0.0)
    assert h.probabilities() == [2 / 3, 1 / 3]  # (1 + 1, 0 + 1) / (1 + 2)


def test_bins_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bins"):
        HitPositions(bins=0)


def test_segment_log_locates_cuts_and_appends() -> None:
    log = SegmentLog()
    assert log.locate(0) is None
    log.append(100, "text")
    log.append(300, "tool_result")
    log.append(300, "ignored")  # no new tokens: no segment
    log.append(400)
    assert (log.starts, log.end) == ([0, 100, 300], 400)
    assert log.locate(0) == (0.0, "text")
    assert log.locate(150) == (0.25, "tool_result")  # (150 − 100) / (300 − 100)
    assert log.locate(399) == (0.99, None)  # (399 − 300) / 100
    assert log.locate(400) is None and log.locate(-1) is None
    log.cut(250)  # keeps [0, 100) and [100, 250)
    assert (log.starts, log.kinds, log.end) == ([0, 100], ["text", "tool_result"], 250)
    assert log.locate(175) == (0.5, "tool_result")  # (175 − 100) / 150
    log.cut(400)  # beyond the end: nothing to forget
    assert log.end == 250
    log.append(500, "text")
    assert log.locate(250) == (0.0, "text")
    log.cut(100)  # at a segment start: that segment goes
    assert (log.starts, log.end) == ([0], 100)
    log.cut(0)
    assert (log.starts, log.kinds, log.end) == ([], [], 0)


def _cache(mode: str = "measured") -> HiStateCache:
    return HiStateCache(CacheConfig(
        chunk_tokens=100, kv_chunk_bytes=100, snapshot_bytes=50,
        tiers=(TierSpec("cpu", 10**6), TierSpec("disk", 10**6)),
        supported_intervals=(100, 200), hit_positions=mode,
    ))


def _serve(cache: HiStateCache, keys: list[int], tokens: int, now: float, kind: str) -> None:
    handle = cache.begin("s", keys, now, kind)
    cache.complete(handle, tokens, now + 0.5)


def test_the_request_path_records_where_an_internal_hit_leaves_its_segment() -> None:
    """Session s: 400 tokens (chunks 0-3, text), then 800 (chunks 4-7, tool_result):
    segments [0, 400) and [400, 800). A request keeping chunks 0-6 and rewriting the
    rest leaves the context at 700 tokens: offset (700 − 400) / 400 = 0.75 of the
    tool_result segment. A request continuing from the end records nothing."""
    a = list(range(1, 9))
    cache = _cache()
    _serve(cache, a[:4], 400, 1.0, "text")
    _serve(cache, a, 800, 2.0, "tool_result")
    assert cache.stats().hit_position_samples == 0  # both at the end
    _serve(cache, [*a[:7], 100, 101], 900, 3.0, "text")
    status = cache.stats()
    assert status.hit_position_samples == 1
    # One sample in bin 6 of 8: p = (1, …, 2, 1) / 9, w = 8/9 × 7 and 16/9:
    # s = (7 · √(8/9) + √(16/9)) / 8 = (7 · 0.942809 + 1.333333) / 8 = 0.991624.
    assert status.hit_position_spread == pytest.approx(0.991624, abs=1e-6)
    # The context was cut at 700 and the rewrite appended [700, 900): a prompt cut at
    # chunk 2 (200 tokens) lands at offset 0.5 of the first (text) segment.
    _serve(cache, [*a[:2], 200], 300, 4.0, "text")
    assert cache.stats().hit_position_samples == 2


def test_uniform_mode_learns_nothing_and_plans_the_plain_grid() -> None:
    a = list(range(1, 9))
    cache = _cache("uniform")
    _serve(cache, a[:4], 400, 1.0, "text")
    _serve(cache, a, 800, 2.0, "tool_result")
    _serve(cache, [*a[:7], 100, 101], 900, 3.0, "text")
    assert cache.stats().hit_position_samples is None
    measured = _cache()
    assert measured.snapshot_plan(0, 800) == cache.snapshot_plan(0, 800)


def test_config_names_the_key_and_its_values() -> None:
    with pytest.raises(ValueError, match="hit_positions must be one of measured, uniform"):
        _cache("learned")


def test_cost_scales_internal_mass_by_the_zone_density() -> None:
    """Chunks of 10 tokens, chain 1-6, snapshots after 2 (token 20: offset 0.5 of the
    segment [0, 40)), 4 (40: closes it, offset 1) and 6 (60); session a ends at 6 (60
    tokens), b at 3 (35 tokens). Hits measured in the last half of a segment 3 times
    out of 4: B = 2, two samples at 0.75: p = (0 + 1, 2 + 1) / 4, w = (0.5, 1.5).
    S2 (p = 20, δ = 20, passes a and b = 2, p_end = 0.9). Its zone: node 3 (b ends:
    uniform mass (35 − 20) / 35 = 0.428571) and boundary S4 (mass (40 − 20) · 1/60 =
    0.333333, only a passes 4). Both lie in offsets [0.5, 1) of the segment: mean
    density (W(1) − W(0.5)) / 0.5 = 0.75 / 0.5 = 1.5.
    measured: internal = 1.5 · 0.761905 = 1.142857, C = 20 · (0.1 · 1.142857 + 0.9 · 2)
    = 38.285714; uniform: C = 20 · (0.0761905 + 1.8) = 37.523810."""
    index = PrefixIndex(10)
    n = index.insert_chain([1, 2, 3, 4, 5, 6])
    for node in n:
        index.set_kv(node, 1, 40, 0.0)
    for i, offset in ((1, 0.5), (3, 1.0), (5, 1.0)):
        index.set_snapshot(n[i], 1, 200, 0.0)
        n[i].seg_offset = offset
    index.set_session("a", n[5], 60)
    index.set_session("b", n[2], 35)
    h = HitPositions(bins=2)
    h.observe(0.75)
    h.observe(0.75)
    assert expected_recompute(n[1], 10, 0.9, positions=h) == pytest.approx(38.285714, abs=1e-5)
    assert expected_recompute(n[1], 10, 0.9) == pytest.approx(37.523810, abs=1e-5)
    # A boundary snapshot at a lower offset lies in a later segment (the zone spans a
    # boundary): its mass stays uniform, b's is still scaled:
    # internal = 0.333333 + 1.5 · 0.428571 = 0.976190, C = 20 · (0.097619 + 1.8) = 37.952381.
    n[3].seg_offset = 0.25
    assert expected_recompute(n[1], 10, 0.9, positions=h) == pytest.approx(37.952381, abs=1e-5)
    # S4 closes its segment: its zone opens the next one, offsets [0, 1) up to S6 at the
    # next segment's end: mean density 1, the uniform C: δ = 20, internal (60 − 40)/60,
    # passes 1 (a): 20 · (0.1 · 0.333333 + 0.9) = 18.666667.
    n[3].seg_offset = 1.0
    assert expected_recompute(n[3], 10, 0.9, positions=h) == pytest.approx(18.666667, abs=1e-5)
    # Offset unknown (a snapshot stored without a session's segments): uniform.
    n[1].seg_offset = -1.0
    assert expected_recompute(n[1], 10, 0.9, positions=h) == pytest.approx(37.523810, abs=1e-5)


def test_segment_log_boundary_offsets() -> None:
    log = SegmentLog()
    assert log.boundary(10) == -1.0
    log.append(100)
    log.append(300)
    log.append(400)
    assert log.boundary(50) == 0.5  # (50 − 0) / 100
    assert log.boundary(100) == 1.0  # closes [0, 100)
    assert log.boundary(150) == 0.25  # (150 − 100) / 200
    assert log.boundary(300) == 1.0
    assert log.boundary(350) == 0.5  # (350 − 300) / 100
    assert log.boundary(400) == 1.0  # closes the last segment, at the context's end
    assert log.boundary(0) == -1.0 and log.boundary(401) == -1.0
