"""The request path with measured hit positions, from the survivors of a mutation run
(docs/testing.md §4): the content kind and the segment start a handle carries, where an
internal hit is recorded, and the plan ``complete`` stores.
Every expected value is derived by hand in the comment next to it.

The skewed estimate used below (``_skewed``): 8 internal hits of kind ``tool`` in the
last of the 8 bins (offset 0.95). Global: ``p = (n + 1) / (8 + 8)`` = (1, …, 1, 9) / 16.
Kind ``tool``: ``p_k = (n_k + 8·p) / (8 + 8)`` = (0.5, …, 0.5, 12.5) / 16.

* ``tool``: ``w = 8·p_k`` = (0.25 ×7, 6.25), ``√w`` = (0.5 ×7, 2.5), sum 6, ``s = 0.75``,
  ``s² = 0.5625``; √-CDF edges ``k/12`` (k ≤ 7), then 1.
  Segment of 800 tokens (chunks of 100, ``I = 100``): ``L_eff = 450``; ``t = j·100/450``
  for j = 1..4 (400 < 450): ``t = 2/9`` → bin 2, ``u = (2 + (2/9 − 2/12)·12) / 8 = 1/3``
  → 266.7 → chunk 300; ``t = 4/9`` → bin 5, ``u = (5 + 1/3) / 8`` → 533.3 → 500;
  ``t = 6/9`` → bin 7, ``u = (7 + (6/9 − 7/12) / (5/12)) / 8 = 7.2 / 8`` → 720 → 700;
  ``t = 8/9`` → ``u = (7 + (8/9 − 7/12) / (5/12)) / 8 = 7.7333 / 8`` → 773 → 800 = the
  end, dropped. Plan ``[300, 500, 700, 800]``.
* unknown kind (global): ``w`` = (0.5 ×7, 4.5), ``√w`` = (0.707107 ×7, 2.121320), sum
  7.071068, ``s² = (7.071068 / 8)² = 0.78125``, edges ``k/10`` (k ≤ 7), then 1.
  ``L_eff = 625``, ``t = 0.16 j`` for j = 1..6: ``u·8`` = 1.6, 3.2, 4.8, 6.4,
  7 + 0.1/0.3 = 7.333, 7 + 0.26/0.3 = 7.867 → chunks 200, 300, 500, 600, 700, (800
  dropped). Plan ``[200, 300, 500, 600, 700, 800]``.
"""

from __future__ import annotations

import pytest
from test_placement_rules import DISK, cache, request

from lmcache_histate.core.cache import CacheConfig, HiStateCache
from lmcache_histate.core.tiers import TierSpec

SNAP = "snapshot"


def _cache() -> HiStateCache:
    # One supported interval: the controller always chooses I = 100 (one chunk).
    return HiStateCache(CacheConfig(
        chunk_tokens=100, kv_chunk_bytes=100, snapshot_bytes=50,
        tiers=(TierSpec("cpu", 10**6), TierSpec("disk", 10**6)),
        supported_intervals=(100,), hit_positions="measured",
    ))


def _skewed() -> HiStateCache:
    cache = _cache()
    for _ in range(8):
        cache._positions.observe(0.95, "tool")  # bin int(0.95 · 8) = 7
    return cache


def _snapshot_chunks(cache: HiStateCache, keys: list[int]) -> list[int]:
    """Token positions (chunk ends) of ``keys`` holding a snapshot on some tier."""
    return [(i + 1) * 100 for i, k in enumerate(keys) if cache.tiers_of(k, SNAP)]


def test_the_plan_follows_the_kind_and_the_segment_start() -> None:
    cache = _skewed()
    # Module docstring: the kind's estimate, the global one, and (uniform) every chunk.
    assert cache.snapshot_plan(0, 800, "tool") == [300, 500, 700, 800]
    assert cache.snapshot_plan(0, 800) == [200, 300, 500, 600, 700, 800]
    # Span [0, 1,600) whose new input starts at 800: the plain grid (I = 100) up to 800,
    # then the tool plan shifted by 800: 1,100, 1,300, 1,500, 1,600.
    assert cache.snapshot_plan(0, 1600, "tool", 800) == [
        100, 200, 300, 400, 500, 600, 700, 800, 1100, 1300, 1500, 1600
    ]


def test_a_handle_carries_the_kind_and_where_its_input_starts() -> None:
    cache = _cache()
    first = cache.begin("s", [1, 2, 3, 4], 1.0, "text")
    # A new session: its input starts at token 0.
    assert (first.kind, first.segment_start) == ("text", 0)
    cache.complete(first, 400, 1.5)
    second = cache.begin("s", [1, 2, 3, 4, 5, 6], 2.0, "tool")
    # The session's context ends at 400: the new input starts there.
    assert (second.kind, second.segment_start) == ("tool", 400)


def test_complete_stores_the_plan_of_the_handles_kind() -> None:
    cache = _skewed()
    keys = list(range(1, 9))
    handle = cache.begin("s", keys, 1.0, "tool")
    assert cache.complete(handle, 800, 1.5) == (8, 4)  # 8 chunks, plan of 4 states
    assert _snapshot_chunks(cache, keys) == [300, 500, 700, 800]


def test_complete_warps_only_the_new_input_after_a_short_chain() -> None:
    """The first request hashes 4 chunks of an 800-token input: the context (segment
    log) ends at 800, the chain at 400. The second request (1,600 tokens, kind tool)
    matches 4 chunks: its plan spans [400, 1,600) with the new input from 800: plain
    grid 500, 600, 700, 800, then 800 + (300, 500, 700, 800)."""
    cache = _skewed()
    keys = list(range(1, 17))
    first = cache.begin("s", keys[:4], 1.0, "text")
    cache.complete(first, 800, 1.5)
    second = cache.begin("s", keys, 2.0, "tool")
    assert (second.match.kv_chunks, second.segment_start) == (4, 800)
    cache.complete(second, 1600, 2.5)
    new = [p for p in _snapshot_chunks(cache, keys) if p > 400]
    assert new == [500, 600, 700, 800, 1100, 1300, 1500, 1600]


def test_an_internal_hit_is_recorded_at_its_offset_under_its_segments_kind() -> None:
    """Segments [0, 400) text and [400, 800) tool_result. A prompt keeping chunks 0-6
    leaves the context at 700: offset (700 − 400) / 400 = 0.75 of the tool_result
    segment, bin int(0.75 · 8) = 6. Then the context is [0, 700) + [700, 900) (text); a
    prompt sharing no chunk leaves it at 0: offset 0 of the text segment, bin 0."""
    a = list(range(1, 9))
    cache = _cache()
    for keys, tokens, now, kind in (
        (a[:4], 400, 1.0, "text"), (a, 800, 2.0, "tool_result"),
        ([*a[:7], 100, 101], 900, 3.0, "text"),
    ):
        cache.complete(cache.begin("s", keys, now, kind), tokens, now + 0.5)
    positions = cache._positions
    assert (positions.count("tool_result"), positions.count("text")) == (1, 0)
    # Global p = (n + 1) / (1 + 8): bin 6 holds 2/9, the others 1/9.
    assert positions.probabilities() == pytest.approx([1 / 9] * 6 + [2 / 9, 1 / 9])
    cache.complete(cache.begin("s", [500], 4.0, "text"), 100, 4.5)
    assert (positions.count("tool_result"), positions.count("text")) == (1, 1)
    # Global counts (1, 0, 0, 0, 0, 0, 1, 0): p = (2, 1, 1, 1, 1, 1, 2, 1) / 10.
    assert positions.probabilities() == pytest.approx([0.2] + [0.1] * 5 + [0.2, 0.1])


def test_the_cost_a_deployment_reads_uses_the_measured_positions() -> None:
    """``eviction_inputs`` of the snapshot at 500 after one 800-token tool request
    (snapshots at 300, 500, 700, 800; offsets in the segment 0.375, 0.625, 0.875, 1).
    Zone of 500: down to the boundary snapshot at 700; ``δ = 500 − 300 = 200``.
    Internal mass ``(700 − 500) · weight = 200 / 800 = 0.25`` (one session, ``P = 800``),
    scaled by the global density over offsets [0.625, 0.875): ``(W(7/8) − W(5/8)) / 0.25
    = (7/16 − 5/16) / 0.25 = 0.5`` → 0.125. No access sampled yet: ``p_end = 0.9``, one
    session passes. ``C = 200 · (0.1 · 0.125 + 0.9 · 1) = 182.5`` (uniform: 0.25 → 185);
    ``token_bytes = 100 // 100 = 1``. An intermediate snapshot sits on disk (tier 1)
    and leaves it alone: 50 bytes."""
    cache = _skewed()
    keys = list(range(1, 9))
    cache.complete(cache.begin("s", keys, 1.0, "tool"), 800, 1.5)
    t, cost, freed = cache.eviction_inputs(5, SNAP, 1)
    assert (t, freed) == (1.5, 50.0)
    assert cost == pytest.approx(182.5)


def test_eviction_inputs_of_a_branching_chunk_are_none() -> None:
    """Sessions s (chunks 1-4) and t (1, 2, 9, 10), 400 tokens each with I = 400: one
    final snapshot per session, at chunks 4 and 10. Chunk 2 has two KV children and no
    snapshot: no unit frees it from the CPU tier, so there are no inputs to rank."""
    cache = HiStateCache(CacheConfig(
        chunk_tokens=100, kv_chunk_bytes=100, snapshot_bytes=50,
        tiers=(TierSpec("cpu", 10**6), TierSpec("disk", 10**6)),
        supported_intervals=(400,),
    ))
    cache.complete(cache.begin("s", [1, 2, 3, 4], 1.0), 400, 1.5)
    cache.complete(cache.begin("t", [1, 2, 9, 10], 2.0), 400, 2.5)
    assert cache.tiers_of(2, "kv") == 0b01 and not cache.tiers_of(2, SNAP)
    assert cache.eviction_inputs(2, "kv", 0) is None


def test_stats_report_the_reaccess_gap_and_the_residence_averages() -> None:
    """Session s begins at 1.0 and again at 4.0: one re-access gap, 4.0 − 1.0 = 3.0, which
    seeds its average. Nothing has left a tier yet: both residence averages are at their
    start value 0.0 (seconds), not unknown."""
    cache = _cache()
    cache.complete(cache.begin("s", [1, 2], 1.0), 200, 1.5)
    cache.complete(cache.begin("s", [1, 2, 3], 4.0), 300, 4.5)
    stats = cache.stats()
    assert (stats.reaccess_gap_s, stats.reaccess_samples) == (3.0, 1)
    assert (stats.kv_residence_s, stats.snapshot_residence_s) == (0.0, 0.0)


@pytest.mark.parametrize(("disk", "moved"), [(25, 10), (40, 30)])
def test_a_promotion_that_makes_room_samples_the_residence_at_its_time(
    disk: int, moved: int
) -> None:
    """Chunks of 10 tokens, KV 10 B, snapshots 20 B (``test_placement_rules.cache``). B
    [7, 8] at t = 0 puts its intermediate snapshot (chunk 7) on disk: 20 B used. A [1] at
    t = 1 keeps its KV and final snapshot on CPU. A comes back at t = 5 and promotes its
    prompt to disk. Disk of 25 B: A's KV (10 B) needs room (5 B free), so B's snapshot is
    dropped (the last tier's only unpinned unit): residence 5 − 0 = 5 s; A's snapshot
    (20 B) then does not fit beside its pinned KV (15 B free): 10 B moved. Disk of 40 B:
    the KV fits (20 B free), the snapshot needs room (10 B free): B's snapshot is
    dropped, the same 5 s; 10 + 20 = 30 B moved."""
    c, _ = cache(cpu=1000, disk=disk)
    request(c, "B", [7, 8], 0.0, [10, 20])
    request(c, "A", [1], 1.0, [10])
    assert c.stats().used_bytes[DISK] == 20
    handle = c.begin("A", [1], 5.0)
    assert c.promote(handle, DISK, 5.0) == moved
    stats = c.stats()
    assert (stats.dropped_units, stats.snapshot_residence_s) == (1, 5.0)
    c.release(handle)
    c.check()


def test_a_request_shorter_than_a_chunk_stores_nothing() -> None:
    """5 tokens of 10-token chunks: no whole chunk, so no KV and no snapshot (0, 0); the
    session ends at the root (no end token to come back to)."""
    c, _ = cache(cpu=1000, disk=1000)
    handle = c.begin("A", [1], 0.0)
    assert c.complete(handle, 5, 0.5) == (0, 0)
    assert (c.session_end("A"), len(c.nodes())) == (None, 0)
    c.check()


def test_a_request_that_stores_nothing_still_re_ranks_its_end() -> None:
    """A [1, 2, 3] at t = 0: snapshot at 20 tokens (chunk 2, intermediate: disk) and the
    final one at 30 (chunk 3). A new session C reads the whole chain at t = 4 and stores
    nothing new (no chunk past the match: ``complete``'s own re-ranking pass is empty):
    the session set at chunk 3 changes the weights along [1, 2, 3], and the re-ranking
    around C's end is what brings chunk 2's queued rank up to date. ``check(exact=True)``
    is the quiescent-point check (``EvictionQueue.check``): every queued rank equals a
    fresh ``rank()``. Fixed ``τ`` and ``ema_alpha = 1e-12`` keep ``τ`` and ``p_end`` from
    drifting (by < 1e-11, inside its 1e-9 tolerance). NOTE: a rank left too *low* here is
    repaired by ``victim`` when popped; this pins the eager re-rank, not a victim order."""
    c = HiStateCache(CacheConfig(
        chunk_tokens=10, kv_chunk_bytes=10, snapshot_bytes=20,
        tiers=(TierSpec("cpu", 1000), TierSpec("disk", 1000)), tau=1.0, ema_alpha=1e-12,
    ))
    request(c, "A", [1, 2, 3], 0.0, [20, 30])
    c._queue.check(exact=True)
    assert c.complete(c.begin("C", [1, 2, 3], 4.0), 30, 4.0) == (0, 0)
    c._queue.check(exact=True)
